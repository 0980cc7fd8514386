"""kvtrain: Megatron-Core pretraining of Llama-style LMs with KV shifting attention."""

__version__ = "0.1.0"
