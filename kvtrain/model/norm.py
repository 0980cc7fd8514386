"""RMSNorm that works with sequence parallelism on every backend.

megatron's local spec wraps ``torch.nn.RMSNorm`` in ``WrappedTorchNorm``, which
refuses sequence parallelism (SP-capable norms come from TE or apex). With SP
the norm sees a sequence shard, so its weight gradient is partial on each TP
rank; marking ``weight.sequence_parallel`` makes megatron's
``finalize_model_grads`` all-reduce it over the TP group, which is all SP needs.
"""

from __future__ import annotations

import torch

from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` with megatron's norm constructor and SP marking."""

    def __init__(
        self,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "RMSNorm",
    ):
        if zero_centered_gamma or config.layernorm_zero_centered_gamma:
            raise ValueError("kvtrain's RMSNorm does not support zero-centered gamma")
        super().__init__(normalized_shape=hidden_size, eps=eps, dtype=config.params_dtype)
        self.config = config
        self.weight.sequence_parallel = config.sequence_parallel
