"""Which code applies RoPE to queries and keys (``model.rope_kernel``), and the
fused one kvtrain brings.

megatron's attention calls ``rope_utils.apply_rotary_pos_emb``; with
``apply_rope_fusion`` that calls ``rope_utils.fused_apply_rotary_pos_emb``
(``..._thd`` for packed THD sequences), Transformer Engine's kernels where TE is
installed and None without it. Without TE, kvtrain fills the first slot with
:func:`fused_rope` (one Triton pass each way, ``kvtrain.model.triton_rope``);
the runs that chose a fused kernel set ``apply_rope_fusion``, and megatron keeps
to its own torch ops wherever the fused kernel does not apply (``mscale != 1``,
mRoPE). MLA never takes one (``choose_rope``).

Choices (``auto | triton | torch``), resolved once per start and recorded with
the backend:

* ``auto``: ``triton`` for the ``torch`` backend on a GPU where Triton imports;
  ``transformer_engine`` (TE's fused kernels, as Megatron-LM's default) for the
  ``te`` backend where this TE has them: megatron's torch ops otherwise cost ~12
  passes over Q and K forward, and a loop over the documents of packed THD
  sequences; else ``torch`` (``local``, the reference, keeps megatron's ops);
* ``triton``: the fused kernel (a GPU, not MLA), refused in one line elsewhere
  (with TE installed its slot holds TE's kernel, which then runs wherever the
  ``torch`` backend's QKV split does not rotate: said so);
* ``torch``: megatron's torch ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import triton_rope
from .kernel_choice import explicit_choice


def choose_rope(requested: str, backend: str, cuda: bool, mla: bool) -> tuple[str, str]:
    """The RoPE kernel for ``model.rope_kernel: requested`` on ``backend``: (name, why).
    ConfigError when the requested one cannot run here."""
    from kvtrain.config import ConfigError

    if requested == "triton" and cuda and mla:
        raise ConfigError("model.rope_kernel: triton: multi-latent attention applies its own "
                          "RoPE (use auto or torch with model.mla)")
    chosen = explicit_choice("model.rope_kernel", requested, cuda, triton_rope.available())
    if chosen is not None:
        return chosen
    if not cuda:
        return "torch", "auto: no GPU"
    if mla:
        return "torch", "auto: multi-latent attention"
    if backend == "te":
        return "transformer_engine", "auto: Transformer Engine's fused RoPE"
    if backend != "torch":
        return "torch", f"auto: the {backend} backend keeps megatron's RoPE"
    if not triton_rope.available():
        return "torch", "auto: Triton is not installed"
    return "triton", "auto: GPU"


def choose_for(model, backend: str, cuda: bool, requested: str = "auto") -> tuple[str, str]:
    """:func:`choose_rope` for ``model`` (a ``ModelConfig``): ``none`` where it has no
    rotary position embedding, MLA's own RoPE for MLA."""
    if model.position_embedding != "rope":
        return "none", f"model.position_embedding: {model.position_embedding}"
    return choose_rope(requested, backend, cuda, mla=model.mla is not None)


def resolve(model, backend: str, cuda: bool, requested: str = "auto",
            in_split: bool = False) -> tuple[str, str]:
    """:func:`choose_for`, then what megatron's fused-RoPE slots hold in this process:
    ``triton`` where TE's kernel holds the slot is TE's (``transformer_engine``) unless
    the layers rotate inside their QKV split (``in_split``: the torch backend's node,
    ``kvtrain.model.rope_attention``, does not go through the slot), and TE's where
    this TE has none is megatron's ops. (name, why), for the run's record and
    :func:`fuses`."""
    kernel, why = choose_for(model, backend, cuda, requested)
    if kernel == "triton" and install() != "triton":
        if in_split:
            return "triton", why + "; Transformer Engine's kernel holds megatron's " \
                                   "fused-RoPE slot, for decoding"
        return "transformer_engine", why + "; megatron's fused-RoPE slot holds Transformer " \
                                           "Engine's kernel"
    if kernel == "transformer_engine" and not te_kernels_present():
        return "torch", "auto: this Transformer Engine has no fused RoPE"
    return kernel, why


def fuses(kernel: str) -> bool:
    """Whether RoPE ``kernel`` (a :func:`choose_rope` name) sets ``apply_rope_fusion``."""
    return kernel in ("triton", "transformer_engine")


def te_kernels_present() -> bool:
    """Whether megatron's fused-RoPE slots hold Transformer Engine's kernels (both:
    sequences and packed THD ones), not kvtrain's or nothing."""
    from megatron.core.models.common.embeddings import rope_utils

    held = (rope_utils.fused_apply_rotary_pos_emb, rope_utils.fused_apply_rotary_pos_emb_thd)
    return all(k is not None and k is not fused_rope for k in held)


def install() -> str:
    """Fills megatron's fused-RoPE slot with :func:`fused_rope` where TE left it empty
    (before a ``TransformerConfig`` with ``apply_rope_fusion`` is made: it checks
    the slot), and says what the slot holds: ``triton`` (kvtrain's), or
    ``transformer_engine`` where TE's kernel was there and stays."""
    from megatron.core.models.common.embeddings import rope_utils

    if rope_utils.fused_apply_rotary_pos_emb is None:
        rope_utils.fused_apply_rotary_pos_emb = fused_rope
    return "triton" if rope_utils.fused_apply_rotary_pos_emb is fused_rope else "transformer_engine"


def fused_rope(t: Tensor, freqs: Tensor, interleaved: bool = False) -> Tensor:
    """megatron's ``fused_apply_rotary_pos_emb`` contract (TE's): ``t [s, b, h, d]``
    rotated by the angles ``freqs [s', 1, 1, r]`` of its positions (``s' >= s``: the
    first s rows; ``r <= d``, even); a new tensor."""
    if interleaved:
        raise ValueError("kvtrain's fused RoPE rotates halves, not interleaved pairs "
                         "(rotary_interleaved: use model.rope_kernel: torch)")
    s, _, _, d = t.shape
    r = freqs.shape[-1]
    if (freqs.dim() != 4 or freqs.shape[0] < s or freqs.shape[1] != 1
            or freqs.shape[2] != 1 or r % 2 or r > d):
        raise ValueError(f"fused RoPE expects freqs [>= s, 1, 1, r] with r even and <= d for "
                         f"t {tuple(t.shape)}, got {tuple(freqs.shape)}")
    if freqs.requires_grad:
        raise ValueError("fused RoPE takes fixed angles (freqs without gradient)")
    return FusedRoPE.apply(t, freqs)


class FusedRoPE(torch.autograd.Function):
    """``y = rope(t, freqs)``; saves only the angles (the backward is the transposed
    rotation of the gradient)."""

    @staticmethod
    def forward(ctx, t: Tensor, freqs: Tensor) -> Tensor:
        freqs = _angles(freqs)
        ctx.save_for_backward(freqs)
        return triton_rope.rotate(t, freqs)

    @staticmethod
    def backward(ctx, dy: Tensor):
        (freqs,) = ctx.saved_tensors
        return triton_rope.rotate(dy, freqs, inverse=True), None


def _angles(freqs: Tensor) -> Tensor:
    """fp32 angles with a unit stride in r (megatron's are already)."""
    freqs = freqs.float()
    return freqs if freqs.stride(-1) == 1 else freqs.contiguous()
