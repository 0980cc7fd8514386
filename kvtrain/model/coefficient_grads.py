"""What the shift's K+V nodes hand autograd for the coefficients' gradients.

Both nodes that shift K and V in their place in the QKV output (``qkv_rope.QKVRoPE``,
the GPU path's split + shift + RoPE; ``shift_kernels.QKVShift``, the shift alone, as
the ``te`` backend runs it) reduce the two gradients to fp32 sums ``[2, g, w+1]``
(K's, then V's: contiguous halves). Where the coefficients are parameters of
megatron's DDP they add those sums into ``main_grad`` themselves, as megatron's and
TE's GEMMs do with ``gradient_accumulation_fusion``: per layer and micro batch one
multi-tensor add in place of a cast, AccumulateGrad's copy of it and the DDP hook's
two adds, and the gradients reach the fp32 ``main_grad`` without a rounding to the
parameters' dtype on the way (bf16 runs).

Where megatron's DDP does not overlap its gradient reduction (the default), its hook
on a parameter only adds a ``.grad`` into ``main_grad``: nothing waits for it. There
the nodes take the coefficients out of autograd's sight (:func:`untracked_params`,
marked by :func:`untrack_coefficients` once the DDP is built): no AccumulateGrad
node, no placeholder gradient, no hook per coefficient tensor, layer and micro batch;
the backward adds the sums into ``main_grad`` and that is all. With
``overlap_grad_reduce`` the hook also tells the parameter's bucket it is ready, so
the coefficients go through autograd, with megatron's placeholders.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def main_grad_params(coef_k: Tensor, coef_v: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """``(coef_k, coef_v)`` where both are parameters of megatron's DDP that
    learn: a ``main_grad`` of their shape that its hook accumulates into unless the
    parameter says ``grad_added_to_main_grad`` (megatron's contract for kernels that
    accumulate their weight gradient themselves); else None (plain autograd, derived
    coefficients: the gate's softmax, selected heads)."""
    for p in (coef_k, coef_v):
        main = getattr(p, "main_grad", None)
        if not (p.requires_grad and hasattr(p, "grad_added_to_main_grad")
                and main is not None and main.shape == p.shape):
            return None
    return coef_k, coef_v


UNTRACKED = "kv_shift_main_grad_only"
"""The attribute :func:`untrack_coefficients` sets on a coefficient parameter whose
gradient the nodes may add into ``main_grad`` outside autograd."""


def untrack_coefficients(ddp) -> int:
    """Marks the KV-shift coefficients (``param.kv_shift``) of the module of megatron's
    DDP ``ddp`` for the untracked path where nothing waits for their hooks (no
    ``overlap_grad_reduce``), unmarks them otherwise; how many were marked. Called by
    the trainer's setup once the DDP is built."""
    untracked = not ddp.ddp_config.overlap_grad_reduce
    marked = 0
    for param in ddp.module.parameters():
        if getattr(param, "kv_shift", False):
            setattr(param, UNTRACKED, untracked)
            marked += untracked
    return marked


def untracked_params(coef_k: Tensor, coef_v: Tensor,
                     mixed: Tensor) -> Optional[tuple[Tensor, Tensor]]:
    """``(coef_k, coef_v)`` where a node on ``mixed`` may take them outside autograd
    (both :func:`main_grad_params` and marked by :func:`untrack_coefficients`), else
    None. Only while a graph is built through ``mixed``: otherwise no node would run a
    backward to add their gradients (a layer whose other weights are frozen)."""
    if not (torch.is_grad_enabled() and mixed.requires_grad):
        return None
    # the flag first: one attribute read where the path does not apply (no DDP)
    if not (getattr(coef_k, UNTRACKED, False) and getattr(coef_v, UNTRACKED, False)):
        return None
    return main_grad_params(coef_k, coef_v)


def coefficient_gradients(dcoef: Tensor, dtype: torch.dtype,
                          params: Optional[tuple[Tensor, Tensor]], in_autograd: bool = True
                          ) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """The gradients to hand autograd for K's and V's coefficients from their sums
    ``dcoef [2, g, w+1]`` (fp32; the Triton kernels' contiguous, torch ops' a view).

    ``params`` with ``in_autograd`` False (:func:`untracked_params`: the node took them
    outside autograd): the sums go into their ``main_grad`` (one multi-tensor add, in
    fp32), and autograd gets nothing (None, None).

    ``params`` (:func:`main_grad_params`): the sums go into the parameters'
    ``main_grad`` (one multi-tensor add, in fp32), the parameters say so
    (``grad_added_to_main_grad``, which megatron's DDP resets every step) and autograd
    gets megatron's placeholder (an uninitialised tensor; zeros for
    ``zero_out_wgrad``), so that the DDP hook still runs (``overlap_grad_reduce``
    counts on it) but adds nothing. Otherwise the sums in ``dtype``: contiguous halves
    of one tensor, one cast for both (none in fp32), which AccumulateGrad takes as
    they are (views such as ``dcoef[:, 0]`` of a ``[g, 2, w+1]`` sum it copied, each:
    two copy kernels a layer on the lent H200)."""
    if params is not None:
        torch._foreach_add_([p.main_grad for p in params], list(dcoef.unbind(0)))
        if not in_autograd:
            return None, None
        for p in params:
            p.grad_added_to_main_grad = True
        return tuple(torch.zeros_like(p) if getattr(p, "zero_out_wgrad", False)
                     else torch.empty_like(p) for p in params)
    both = dcoef
    if dcoef.dtype != dtype or not dcoef.is_contiguous():  # one copy casts and lays out
        both = torch.empty(dcoef.shape, dtype=dtype, device=dcoef.device).copy_(dcoef)
    return both[0], both[1]


__all__ = ["UNTRACKED", "coefficient_gradients", "main_grad_params", "untrack_coefficients",
           "untracked_params"]
