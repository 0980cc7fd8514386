"""GPT layer specs: vanilla or KV-shift attention on the te, torch or local backend.

``model.backend`` picks the backend: ``te`` (Transformer Engine), ``torch``
(megatron's local linears with kvtrain's SP-capable RMSNorm and PyTorch's fused
attention, ``kvtrain.model.attention.TorchAttention``), ``local`` (the same
linears and norms with megatron's s x s ``DotProductAttention``: the reference)
or ``auto`` (``te`` on a GPU with TE, else ``torch``). :func:`backend_choice` probes this machine (a GPU, TE's
import, apex's fused softmax) once and returns a ``BackendChoice`` saying which
and why (``kvtrain.config.backend.decide_backend``); the trainer prints and
records it. The attention variant is a table lookup: each entry turns the
backend's vanilla layer spec into the variant's.
"""

from __future__ import annotations

import copy
import functools
import importlib
import importlib.util
from typing import Callable, Literal, Optional

import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)

from kvtrain.config import first_line
from kvtrain.config.backend import TE_NOT_INSTALLED, BackendChoice, decide_backend

from .attention import LocalDotProductAttention, TorchAttention
from .kv_shift import KVShiftOptions, kv_shift_layer_spec
from .mla import mla_layer_spec
from .norm import RMSNorm
from .rope_attention import FusedRoPESelfAttention
from .swiglu import SwiGLU

Backend = Literal["auto", "local", "te", "torch"]

# the core attention of the backends built on megatron's local modules
CORE_ATTENTION = {"local": LocalDotProductAttention, "torch": TorchAttention}


# megatron's fused softmax kernels come compiled with apex (NVIDIA's container), not
# with megatron-core; FusedScaleMaskSoftmax imports them at the first fp16/bf16
# forward of the local spec and fails there when they are missing.
_SOFTMAX_KERNELS = ("scaled_masked_softmax_cuda", "scaled_upper_triang_masked_softmax_cuda",
                    "scaled_softmax_cuda")


def fused_softmax_available() -> bool:
    """Whether megatron's fused masked-softmax kernels can be used (GPU + apex's build)."""
    return torch.cuda.is_available() and all(
        importlib.util.find_spec(name) is not None for name in _SOFTMAX_KERNELS)


def describe_import_failure(error: BaseException) -> str:
    """``TE_NOT_INSTALLED`` when the exception says Transformer Engine is absent,
    else ``"<Type>: <first line>"`` (a broken install: missing CUDA libraries, ABI)."""
    if isinstance(error, ModuleNotFoundError) and error.name == "transformer_engine":
        return TE_NOT_INSTALLED
    return first_line(error)


@functools.lru_cache(maxsize=None)
def te_import_error() -> Optional[str]:
    """None when ``transformer_engine.pytorch`` imports; else why not (see above)."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception as e:  # ImportError, or a broken install (OSError from missing libs)
        return describe_import_failure(e)
    return None


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports and a CUDA device is present."""
    return torch.cuda.is_available() and te_import_error() is None


def backend_choice(requested: Backend = "auto") -> BackendChoice:
    """Resolves ``model.backend`` on this machine (ConfigError when ``te`` cannot be used)."""
    cuda = torch.cuda.is_available()
    # TE is imported only where it could be used: on a GPU, for auto or te
    te_error = te_import_error() if cuda and requested != "local" else None
    return decide_backend(requested, cuda=cuda, te_error=te_error,
                          fused_softmax=fused_softmax_available())


def resolve_backend(backend: Backend = "auto") -> str:
    """The backend name (``te`` | ``torch`` | ``local``) ``backend`` resolves to here."""
    return backend_choice(backend).name


def vanilla_layer_spec(backend: Backend = "auto", mla: bool = False,
                       swiglu: str = "torch") -> ModuleSpec:
    """The Llama-style GPT layer spec (RMSNorm, SwiGLU MLP on the ``swiglu`` kernel)
    for ``backend``; with ``mla``, multi-latent attention (``kvtrain.model.mla``).

    ``torch`` and ``local`` share every module but the core attention, which
    has no parameters: their state dicts (and checkpoints) are the same.
    """
    name = resolve_backend(backend)
    if mla:
        return with_swiglu(mla_layer_spec(name, CORE_ATTENTION.get(name)), swiglu)
    if name == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        return with_swiglu(get_gpt_layer_with_transformer_engine_spec(qk_layernorm=False),
                           swiglu)
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    spec.submodules.input_layernorm = RMSNorm
    spec.submodules.pre_mlp_layernorm = RMSNorm
    spec.submodules.self_attention.module = FusedRoPESelfAttention  # RoPE in the split
    spec.submodules.self_attention.submodules.core_attention = CORE_ATTENTION[name]
    return with_swiglu(spec, swiglu)


def with_swiglu(spec: ModuleSpec, kernel: str = "torch") -> ModuleSpec:
    """``spec`` with kvtrain's SwiGLU on ``kernel`` (``swiglu.choose_swiglu``) in its
    MLP's activation slot (the builder's config has megatron run that slot:
    ``use_te_activation_func``)."""
    mlp = spec.submodules.mlp.submodules
    if not hasattr(mlp, "activation_func"):  # e.g. TE's fused MLP: no slot to fill
        raise ValueError(f"the MLP of this layer spec has no activation slot: {mlp}")
    mlp.activation_func = ModuleSpec(module=SwiGLU, params={"kernel": kernel})
    return spec


# attention name -> builder(vanilla spec, options) -> spec
ATTENTION_VARIANTS: dict[str, Callable[[ModuleSpec, Optional[KVShiftOptions]], ModuleSpec]] = {
    "vanilla": lambda base, options: base,
    "kv_shift": lambda base, options: kv_shift_layer_spec(base, options or KVShiftOptions()),
}


def layer_spec(attention: str = "vanilla", options: Optional[KVShiftOptions] = None,
               backend: Backend = "auto", mla: bool = False, swiglu: str = "torch") -> ModuleSpec:
    """The GPT layer spec of ``attention`` (vanilla | kv_shift) on ``backend``, with
    multi-latent attention when ``mla``, its SwiGLU on the ``swiglu`` kernel."""
    if attention not in ATTENTION_VARIANTS:
        raise ValueError(f"unknown attention {attention!r}; one of {sorted(ATTENTION_VARIANTS)}")
    return ATTENTION_VARIANTS[attention](vanilla_layer_spec(backend, mla, swiglu), options)


def block_spec(layer: ModuleSpec, config, vp_stage: Optional[int] = None,
               pp_rank: Optional[int] = None) -> TransformerBlockSubmodules | ModuleSpec:
    """The decoder block for one pipeline stage.

    With the torch and local backends the final norm must be kvtrain's RMSNorm too (the
    default would be megatron's WrappedTorchNorm, which refuses SP), so the block
    is spelled out; TE layer specs carry SP-capable norms already.
    """
    if layer.submodules.input_layernorm is not RMSNorm:
        return layer
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=RMSNorm)
