"""GPT layer specs: vanilla or KV-shift attention, local or Transformer Engine backend.

The backend is chosen automatically: Transformer Engine when it imports and a
GPU is present, otherwise megatron's local modules (with kvtrain's SP-capable
RMSNorm), which is what runs on the CPU. The attention variant is a table
lookup: each entry turns the backend's vanilla layer spec into the variant's.
"""

from __future__ import annotations

import copy
import functools
from typing import Callable, Literal, Optional

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from .kv_shift import KVShiftOptions, kv_shift_layer_spec
from .norm import RMSNorm

Backend = Literal["auto", "local", "te"]


@functools.lru_cache(maxsize=None)
def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # ImportError, or a broken install (missing CUDA libs)
        return False
    return True


def resolve_backend(backend: Backend = "auto") -> str:
    if backend == "auto":
        return "te" if transformer_engine_available() else "local"
    if backend == "te" and not transformer_engine_available():
        raise RuntimeError("backend 'te' requested but Transformer Engine is not importable")
    return backend


def vanilla_layer_spec(backend: Backend = "auto") -> ModuleSpec:
    """The Llama-style GPT layer spec (RMSNorm, SwiGLU MLP) for ``backend``."""
    if resolve_backend(backend) == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    return spec


# attention name -> builder(vanilla spec, options) -> spec
ATTENTION_VARIANTS: dict[str, Callable[[ModuleSpec, Optional[KVShiftOptions]], ModuleSpec]] = {
    "vanilla": lambda base, options: base,
    "kv_shift": lambda base, options: kv_shift_layer_spec(base, options or KVShiftOptions()),
}


def layer_spec(attention: str = "vanilla", options: Optional[KVShiftOptions] = None,
               backend: Backend = "auto") -> ModuleSpec:
    """The GPT layer spec of ``attention`` (vanilla | kv_shift) on ``backend``."""
    if attention not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown attention {attention!r}; one of {sorted(ATTENTION_VARIANTS)}")
    return ATTENTION_VARIANTS[attention](vanilla_layer_spec(backend), options)


def block_spec(layer: ModuleSpec, config, vp_stage: Optional[int] = None,
               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder block for one pipeline stage.

    With the local backend the final norm must be kvtrain's RMSNorm too (the
    default would be megatron's WrappedTorchNorm, which refuses SP), so the block
    is spelled out; TE layer specs carry SP-capable norms already.
    """
    if layer.submodules.input_layernorm is not RMSNorm:
        return layer
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)
