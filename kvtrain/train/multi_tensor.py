"""megatron's multi-tensor ops without Transformer Engine or apex, and without host syncs.

megatron-core computes the gradient norm and scales gradients for clipping (and
copies main params into model params in some optimizers) with
``multi_tensor_applier`` and the fused kernels of Transformer Engine
(``transformer_engine.pytorch.optimizers``) or apex (``amp_C``). With neither
- the ``torch`` backend on a GPU without them, and every CPU run - it falls
back to ``megatron.core.utils.local_multi_tensor_l2_norm``, which launches a
norm kernel per gradient tensor and then builds ``torch.tensor`` from the list
of their CUDA results: **a device-to-host copy and a stream sync per tensor**,
every step (about 170 for the paper's 28-layer 1.5B model, 225 with KV shift:
every coefficient tensor adds one), plus ``local_multi_tensor_scale``, two kernels
per tensor.

:func:`install` replaces those two fallbacks, where megatron chose them, with
torch's multi-tensor (``foreach``) kernels: one batched norm and one batched
scale, no sync. The values are the same up to the order of summation.
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

FOREACH = "torch foreach (kvtrain)"


def foreach_l2_norm(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                    per_tensor: bool, *args) -> tuple[Tensor, None]:
    """The L2 norm of all of ``tensor_lists[0]`` together, a ``[1]`` fp32 tensor on
    their device (megatron's ``multi_tensor_l2norm`` contract; no per-tensor norms)."""
    tensors = tensor_lists[0]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    # one 0-dim fp32 norm per tensor (low-precision grads accumulate in fp32, as
    # megatron's kernels do), then one norm of them: no op per tensor on the host
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    total = torch.linalg.vector_norm(torch.stack(norms))
    return total.reshape(1), None


def foreach_scale(chunk_size: int, noop_flag: Tensor, tensor_lists: list[list[Tensor]],
                  scale: float) -> None:
    """``dst = src * scale`` for the pairs of ``tensor_lists = [src, dst]``, in place
    when they are the same tensors (clipping scales the gradients themselves)."""
    src, dst = tensor_lists
    if not src:
        return
    if src is dst or all(map(operator.is_, src, dst)):  # no Python frame per tensor
        torch._foreach_mul_(dst, scale)
    elif scale == 1.0:
        torch._foreach_copy_(dst, src)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def _kind(impl) -> str:
    if impl in (foreach_l2_norm, foreach_scale):
        return FOREACH
    module = getattr(impl, "__module__", None) or type(impl).__module__ or ""
    return "transformer_engine" if module.startswith("transformer_engine") else "apex"


def install() -> str:
    """Puts the foreach ops in the place of megatron's local fallbacks (where megatron
    fell back) and says what computes the multi-tensor ops: ``transformer_engine``,
    ``apex`` or :data:`FOREACH`."""
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads, optimizer

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
    return _kind(clip_grads.l2_norm_impl)


__all__ = ["FOREACH", "foreach_l2_norm", "foreach_scale", "install"]
