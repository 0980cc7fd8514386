"""Megatron's QKV split, the KV shift (optional) and RoPE of Q and K as one autograd
node on the Triton kernels of ``triton_qkv_rope``.

Today a layer splits the QKV output (or shifts K and V in it: ``QKVShift``), then
megatron rotates Q and K (two RoPE nodes); backward, RoPE's two kernels run, then
the shift node or the split's concatenation. :class:`QKVRoPE` does it in one pass
each way: its backward writes the whole gradient of the QKV output at once.

What the node keeps for the backward: the angles, the document ids, the
coefficients, and ``mixed`` when the coefficients learn (its K and V columns are
the raw K/V: no copy) or when the caller's attention keeps ``value`` (a view of
``mixed``) anyway (``attention_keeps_value``: SDPA and FlexAttention keep what they
are given). Nothing of the size of K or V beyond that. Where it keeps ``mixed``
and ``mixed`` is an intermediate (the QKV projection's output, as in the layer),
the backward writes the gradient over it and returns that memory, vanilla and
shift alike: one QKV-sized request a layer fewer, and both arms hand CUDA's
caching allocator the same requests in the same order. (Vanilla allocating its
gradient after attention's backward freed ``mixed`` while the shift wrote over
``mixed`` was enough for the allocator to pack the two arms' later requests
differently: 1.5 MiB of 220 at the small shape, replayed; ``docs/performance.md``.)
That backward runs once: a second one (``retain_graph``) is refused in one line.

In-place contract: vanilla, ``value`` is a view of ``mixed``'s V columns and
nothing is written in the forward. With coefficients, the shifted V is written over the first d
query columns of every group of ``mixed`` (dead once rotated into ``query``) and
``value`` is that view; K and V columns stay intact. ``mixed`` is consumed: its
query values are gone, so it cannot be fed to the node twice. Its version counter
is bumped, so a node that saved ``mixed`` before (none in megatron's layer: the
QKV projection keeps its input) refuses its backward instead of reading the
overwritten columns.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import triton_qkv_rope
from .coefficient_grads import coefficient_gradients, main_grad_params, untracked_params


def available() -> bool:
    return triton_qkv_rope.available()


def qkv_rope(mixed: Tensor, freqs: Tensor, query_width: int, coef_k: Optional[Tensor] = None,
             coef_v: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
             attention_keeps_value: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(query [s, b, np, d], key [s, b, g, d], value [s, b, g, d]) from megatron's QKV
    output ``mixed [s, b, g, q + 2d]`` (``q = query_width = r_q·d``; a unit stride in
    the last dim), Q and K rotated by ``freqs [>= s, 1, 1, d]`` (fp32 angles, all of
    d rotated); with ``coef_k``/``coef_v`` ``[g, w+1]`` (both) K and V shifted first,
    ``doc_ids [s, b]`` resetting the shift at document starts. ``query`` and ``key``
    are new tensors, ``value`` a view of ``mixed`` (see the module's contract).
    ``attention_keeps_value``: what consumes the outputs keeps ``value`` until just
    before this node's backward, so keeping ``mixed`` costs nothing and its memory
    takes the gradient (without learned coefficients; with them it does anyway)."""
    validate(mixed, freqs, query_width, coef_k, coef_v, doc_ids)
    if not available():
        raise RuntimeError("qkv_rope runs on Triton kernels: the triton package is missing")
    untracked = untracked_params(coef_k, coef_v, mixed) if coef_k is not None else None
    if untracked is not None:  # in a tuple, out of autograd's sight (coefficient_grads)
        return QKVRoPE.apply(mixed, freqs, None, None, doc_ids, query_width, untracked,
                             attention_keeps_value)
    return QKVRoPE.apply(mixed, freqs, coef_k, coef_v, doc_ids, query_width, None,
                         attention_keeps_value)


def validate(mixed: Tensor, freqs: Tensor, query_width: int, coef_k: Optional[Tensor],
             coef_v: Optional[Tensor], doc_ids: Optional[Tensor]) -> None:
    """ValueError, in one line, for inputs the kernels do not take."""
    if mixed.dim() != 4 or mixed.stride(-1) != 1:
        raise ValueError(f"qkv_rope expects mixed [s, b, g, q + 2d] with a unit stride in its "
                         f"last dim, got shape {tuple(mixed.shape)} strides {mixed.stride()}")
    s, b, g, width = mixed.shape
    d = (width - query_width) // 2
    if query_width <= 0 or d <= 0 or query_width + 2 * d != width or query_width % d:
        raise ValueError(f"qkv_rope expects mixed [s, b, g, r_q·d + 2d] with query_width "
                         f"r_q·d, got {tuple(mixed.shape)} and query_width {query_width}")
    if (freqs.dim() != 4 or freqs.shape[0] < s or freqs.shape[1:3] != (1, 1)
            or freqs.shape[3] != d or d % 2):
        raise ValueError(f"qkv_rope rotates all of an even head dim: expected freqs "
                         f"[>= {s}, 1, 1, {d}], got {tuple(freqs.shape)}")
    if freqs.requires_grad:
        raise ValueError("qkv_rope takes fixed angles (freqs without gradient)")
    if (coef_k is None) != (coef_v is None):
        raise ValueError("qkv_rope takes both coefficients (coef_k, coef_v) or neither")
    if coef_k is not None and (coef_k.dim() != 2 or coef_k.shape[0] != g
                               or coef_k.shape != coef_v.shape):
        raise ValueError(f"qkv_rope expects coefficients [g = {g}, w+1] both, got "
                         f"{tuple(coef_k.shape)} and {tuple(coef_v.shape)}")
    if doc_ids is not None and (tuple(doc_ids.shape) != (s, b) or doc_ids.is_floating_point()):
        raise ValueError(f"qkv_rope expects integer doc_ids [{s}, {b}], got "
                         f"{tuple(doc_ids.shape)} {doc_ids.dtype}")


class QKVRoPE(torch.autograd.Function):
    """``qkv_rope`` as one node: saves the angles, document ids, coefficients, and
    ``mixed`` for the coefficients' gradient or where attention keeps it alive anyway
    (``value_kept``; then the gradient is written over it). ``untracked``: the coefficients as
    ``(coef_k, coef_v)`` parameters whose gradients it adds into ``main_grad`` outside
    autograd (``coefficient_grads.untracked_params``; ``coef_k``/``coef_v`` None).
    ``value_kept``: :func:`qkv_rope`'s ``attention_keeps_value``."""

    @staticmethod
    def forward(ctx, mixed: Tensor, freqs: Tensor, coef_k: Optional[Tensor],
                coef_v: Optional[Tensor], doc_ids: Optional[Tensor], query_width: int,
                untracked: Optional[tuple[Tensor, Tensor]], value_kept: bool):
        ctx.query_width = query_width
        ctx.set_materialize_grads(False)  # an unused output's gradient: None, not zeros
        ctx.untracked = untracked is not None
        if untracked is not None:
            coef_k, coef_v = untracked
        query, key, value = triton_qkv_rope.forward(mixed, freqs, query_width, coef_k, coef_v,
                                                    doc_ids)
        learns = coef_k is not None and (coef_k.requires_grad or coef_v.requires_grad)
        # mixed kept (for the coefficients, or alive anyway: value_kept) and an
        # intermediate (the QKV projection's output: nobody else's memory): the backward
        # writes its gradient over it
        ctx.in_place = ((learns or value_kept) and mixed.requires_grad
                        and mixed.grad_fn is not None)
        ctx.used = False
        # megatron's DDP parameters (the module's own: nothing to save or version)
        ctx.params = untracked or (main_grad_params(coef_k, coef_v) if learns else None)
        if coef_k is not None:
            # The kernel wrote V̂ over the query columns behind autograd's back: say so
            # before saving mixed (its saved version is then the overwritten one).
            torch.autograd.graph.increment_version(mixed)
        # The raw K/V are mixed's K/V columns (intact): mixed itself, no copy.
        tracked = (coef_k, coef_v) if untracked is None else (None, None)
        ctx.save_for_backward(mixed if learns or ctx.in_place else None, freqs, *tracked,
                              doc_ids if coef_k is not None else None)
        # value is a view of mixed; autograd makes this node its grad_fn all the same,
        # so its gradient comes back here and is written into dmixed.
        return query, key, value

    @staticmethod
    def backward(ctx, dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]):
        if torch.is_grad_enabled():  # the kernels build no graph: its gradient would be lost
            raise RuntimeError("qkv_rope's backward is not differentiable: a gradient of its "
                               "gradient (create_graph=True) is not supported")
        if ctx.used:  # before saved_tensors, whose version check would say less
            raise RuntimeError("qkv_rope's backward ran twice: the first wrote the QKV "
                               "output's gradient over it (retain_graph is not supported "
                               "on this node; use model.rope_kernel: torch)")
        # Otherwise a second backward (retain_graph) gives the first one's results: it
        # reads only K/V columns of mixed (never written) and tensors nothing writes,
        # all saved with their version checked.
        mixed, freqs, coef_k, coef_v, doc_ids = ctx.saved_tensors
        if ctx.untracked:
            coef_k, coef_v = ctx.params
        if dq is None and dk is None and dv is None:
            return None, None, None, None, None, None, None, None
        need_mixed = ctx.needs_input_grad[0]
        need_coef = ctx.untracked or ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        in_place = ctx.in_place and need_mixed
        dmixed, dcoef = triton_qkv_rope.backward(mixed, freqs, ctx.query_width, coef_k,
                                                 coef_v, doc_ids, dq, dk, dv, need_coef,
                                                 in_place=in_place)
        dck = dcv = None
        if dcoef is not None:  # cast, or into main_grad (with placeholders in autograd)
            dck, dcv = coefficient_gradients(dcoef, coef_k.dtype, ctx.params,
                                             in_autograd=not ctx.untracked)
        if in_place:
            ctx.used = True
            # mixed changed under autograd's eyes: a node that saved it or a view of it
            # (attention's V̂, whose backward has run) fails on another backward instead
            # of reading the gradient
            torch.autograd.graph.increment_version(mixed)
            dmixed = mixed.detach()  # the same memory, without mixed's graph
        return (dmixed if need_mixed else None, None, dck if ctx.needs_input_grad[2] else None,
                dcv if ctx.needs_input_grad[3] else None, None, None, None, None)
