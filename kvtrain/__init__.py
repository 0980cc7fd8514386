"""kvtrain: Megatron-Core pretraining of Llama-style LMs with KV shifting attention."""

from kvtrain import _megatron_jit

__version__ = "0.1.0"

_megatron_jit.install()  # before anything imports megatron: 3-5 s less per process
