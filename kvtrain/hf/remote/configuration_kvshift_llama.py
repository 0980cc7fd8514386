"""Configuration of a Llama with KV shifting attention (exported by kvtrain).

A ``LlamaConfig`` plus ``kv_shift``: ``{"shift": ["k", "v"], "window": 1,
"mode": "free"}`` (which projections are shifted, how many previous tokens
are mixed in, and how the stored coefficients become mixing weights), and
``reset_attention_mask`` (whether training kept packed documents apart; see
``modeling_kvshift_llama``).
Self-contained: imports only public transformers APIs.
"""

from transformers import LlamaConfig


class KVShiftLlamaConfig(LlamaConfig):
    """``LlamaConfig`` with the ``kv_shift`` options (kept as an extra attribute)."""

    model_type = "kvshift_llama"


__all__ = ["KVShiftLlamaConfig"]
