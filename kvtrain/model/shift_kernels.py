"""The fused KV shift: :func:`kvtrain.model.kv_shift.shift_tokens` as one autograd node.

``y_t = Σ_i c_i · x_{t-i}`` (i = 0..w, per head), with the tokens before the
sequence start and before each document start taken as zero.

Built from ordinary ops (``shift_tokens``), autograd keeps the rolled copies,
the document-masked products and one node per op, and reduces the coefficient
gradient in w+1 separate full-size passes. :class:`FusedShift` instead

* saves only its input ``x`` (the raw K/V: a view of the QKV projection's
  output, never a copy), the coefficients and the ``[s, b]`` document ids, and
  recomputes in backward. Attention that saves its V input (SDPA, flash and TE
  kernels) keeps that output anyway, so the shift adds only the shifted V it
  hands to attention; megatron's local attention copies V for GQA, and there
  the view keeps the QKV output alive (tests/model/test_fused_shift.py);
* accumulates in place (forward and ``dx``): no full-size temporaries beyond
  its output;
* reduces ``dcoef[h, i] = Σ_{t,b,d} dy_t · x_{t-i}`` for all lags in one masked
  reduction over a ``[w+1, s, b, h]`` tensor of per-token products (on the GPU,
  in the same Triton pass that computes ``dx``).

Three kernels compute it (``impl``, from ``model.kv_shift.kernel``; the trainer
resolves ``auto`` once with :func:`choose_kernel` and records the answer):

* ``triton`` - on CUDA tensors with Triton importable (``triton_shift``): one
  program per block of tokens of one (batch, head) pair, fp32 accumulation;
* ``native`` - on the CPU: C++ operators with their autograd node in C++
  (``native_shift``, ``csrc/kv_shift.cpp``; fp32/fp64);
* ``torch`` - the torch ops below, anywhere.

:func:`fused_shift_qkv` shifts K and V in their place in megatron's QKV output and
stands in for its split too (every kernel). All mirror ``shift_tokens``, the
reference that tests compare them with.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import native_shift, triton_shift
from .coefficient_grads import coefficient_gradients, main_grad_params, untracked_params

IMPLS = ("torch", "triton", "native")


def triton_available() -> bool:
    return triton_shift.available()


def choose_kernel(requested: str, cuda: bool, dtype: torch.dtype) -> tuple[str, str]:
    """The kernel for ``model.kv_shift.kernel: requested`` on a run whose K/V are
    ``dtype`` on a GPU (``cuda``) or the CPU: (name, why). ConfigError when the
    requested one cannot run here. Builds the native operators (once) to know."""
    from kvtrain.config import ConfigError

    key = f"model.kv_shift.kernel: {requested}"
    if requested == "torch":
        return "torch", key
    if requested == "auto" and cuda and dtype == torch.float64:
        return "torch", "auto: the Triton kernels accumulate in fp32, not fp64"
    if requested == "triton" or (requested == "auto" and cuda):
        if not cuda:
            raise ConfigError(f"{key} needs a GPU (use auto, native or torch on the CPU)")
        if not triton_available():
            if requested == "auto":
                return "torch", "auto: Triton is not installed"
            raise ConfigError(f"{key}, but Triton is not installed (use torch)")
        return "triton", "auto: GPU" if requested == "auto" else key
    if requested not in ("auto", "native"):
        raise ConfigError(f"model.kv_shift.kernel must be auto, native, torch or triton, "
                          f"got {requested!r}")
    if cuda:
        raise ConfigError(f"{key} is the CPU kernel (use auto, triton or torch on a GPU)")
    if dtype not in native_shift.DTYPES:
        if requested == "auto":
            return "torch", f"auto: the native kernel takes fp32/fp64, not {dtype}"
        raise ConfigError(f"{key} takes fp32/fp64 K/V, not {dtype} (train.precision; "
                          f"use auto or torch)")
    reason = native_shift.unavailable_reason()
    if reason is not None:
        if requested == "auto":
            return "torch", f"auto: native kernel unavailable: {reason}"
        raise ConfigError(f"{key}, but the native kernel is unavailable: {reason}")
    return "native", "auto: CPU" if requested == "auto" else key


def default_impl(x: Tensor) -> str:
    """The kernel ``auto`` takes for ``x``: Triton on a GPU where it imports, the
    native C++ operators on the CPU where they build and take x's dtype, else torch ops."""
    if x.is_cuda:  # fp64: torch ops (the Triton kernels accumulate in fp32)
        return "triton" if triton_available() and x.dtype != torch.float64 else "torch"
    if native_shift.supports(x) and native_shift.unavailable_reason() is None:
        return "native"
    return "torch"


def fused_shift(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor] = None,
                impl: Optional[str] = None) -> Tensor:
    """The KV shift of ``x`` ``[s, b, h, d]`` with coefficients ``coef`` ``[h, w+1]``.

    Same contract as ``shift_tokens`` (``coef`` are the *effective*
    coefficients; ``doc_ids`` ``[s, b]`` or None). ``impl`` forces ``torch`` or
    ``triton``; by default Triton runs on CUDA tensors when it is importable.
    """
    impl = _checked_impl(x, impl)
    if impl == "native":  # a C++ operator with its own autograd node
        return native_shift.shift(x, coef, doc_ids)
    return FusedShift.apply(x, coef, doc_ids, impl)


def _checked_impl(x: Tensor, impl: Optional[str]) -> str:
    """``impl`` (None or ``auto``: :func:`default_impl`), checked against ``x``."""
    if impl in (None, "auto"):
        return default_impl(x)
    if impl not in IMPLS:
        raise ValueError(f"unknown shift implementation {impl!r}; expected one of {IMPLS}")
    if impl == "triton" and not triton_available():
        raise RuntimeError("the Triton shift needs the triton package")
    if impl == "native" and not native_shift.supports(x):
        return "torch"  # a tensor the native operators do not take (bf16, a GPU tensor)
    return impl  # native: NativeUnavailable with the reason where it cannot be built


class FusedShift(torch.autograd.Function):
    """``y = shift(x, coef, doc_ids)`` saving only ``x`` (for the coefficients'
    gradient: not for fixed coefficients), ``coef`` and ``doc_ids``."""

    @staticmethod
    def forward(ctx, x: Tensor, coef: Tensor, doc_ids: Optional[Tensor], impl: str) -> Tensor:
        ctx.impl = impl
        # The input tensor itself (no copy; often a view that holds the QKV output),
        # and only where the coefficients learn: dx needs the coefficients alone.
        ctx.save_for_backward(x if coef.requires_grad else None, coef, doc_ids)
        if impl == "triton":
            return triton_shift.shift_forward(x, coef, doc_ids)
        return _torch_forward(x, coef, doc_ids)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, coef, doc_ids = ctx.saved_tensors
        need_x, need_coef = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if ctx.impl == "triton":
            dx, dcoef = triton_shift.shift_backward(x, coef, doc_ids, dy)
            dcoef = dcoef.to(coef.dtype) if dcoef is not None else None
        else:
            dx, dcoef = _torch_grads(x, coef, doc_ids, dy, need_x, need_coef)
        return (dx if need_x else None), (dcoef if need_coef else None), None, None


def fused_shift_qkv(mixed: Tensor, coef_k: Tensor, coef_v: Tensor,
                    doc_ids: Optional[Tensor] = None, query_width: int = 0,
                    impl: Optional[str] = None) -> tuple[Tensor, Tensor, Tensor]:
    """Q as it is, K and V shifted, straight from megatron's QKV output: one autograd node.

    ``mixed`` is the QKV projection's output ``[s, b, g, q + 2d]`` (per KV group:
    its ``q = query_width`` query values, then K and V of ``d`` each); ``coef_k``
    and ``coef_v`` are ``[g, w+1]``. Returns ``query [s, b, g, q]`` (a view of
    ``mixed``) and the shifted ``key``, ``value`` ``[s, b, g, d]``.

    The node takes the place of the split of ``mixed`` too, so its backward
    writes the gradients of Q, K and V straight into one gradient of ``mixed``:
    compared with splitting and shifting K and V one by one, a third of the
    nodes, no gradient stack and no concatenation.

    Memory: it keeps a copy of the raw K and V (written in the forward's pass),
    not ``mixed``. Vanilla attention keeps V, a view that holds all of ``mixed``;
    here attention keeps the shifted V instead, so ``mixed`` is freed once Q and
    K are rotated, and the shifted K and V are tensors of their own (K's is
    freed after RoPE). What the layer keeps is then vanilla's with MHA and less
    with GQA (tests/model/test_fused_shift.py). ``impl``: ``native``, ``torch``
    or ``triton`` (None/``auto``: :func:`default_impl`).
    """
    s, b, g, width = mixed.shape
    d = (width - query_width) // 2
    if (query_width < 0 or query_width + 2 * d != width
            or coef_k.shape != coef_v.shape or coef_k.shape[0] != g):
        raise ValueError(f"expected mixed [s, b, g, q + 2d] with q = {query_width} and "
                         f"coefficients [g, n], got {tuple(mixed.shape)}, "
                         f"{tuple(coef_k.shape)} and {tuple(coef_v.shape)}")
    impl = _checked_impl(mixed, impl)
    if impl == "native":  # a C++ operator with its own autograd node
        return native_shift.shift_qkv(mixed, coef_k, coef_v, doc_ids, query_width)
    untracked = untracked_params(coef_k, coef_v, mixed)
    if untracked is not None:  # in a tuple, out of autograd's sight (coefficient_grads)
        return QKVShift.apply(mixed, None, None, doc_ids, query_width, impl, untracked)
    return QKVShift.apply(mixed, coef_k, coef_v, doc_ids, query_width, impl, None)


class QKVShift(torch.autograd.Function):
    """``fused_shift_qkv`` on torch ops or the Triton kernels (the native operator is
    its C++ twin): saves a copy of the raw K/V, the coefficients and ``doc_ids``.
    ``untracked``: the coefficients as ``(coef_k, coef_v)`` parameters whose gradients
    it adds into ``main_grad`` outside autograd (``coefficient_grads.untracked_params``;
    ``coef_k``/``coef_v`` None)."""

    @staticmethod
    def forward(ctx, mixed: Tensor, coef_k: Optional[Tensor], coef_v: Optional[Tensor],
                doc_ids: Optional[Tensor], query_width: int, impl: str = "torch",
                untracked: Optional[tuple[Tensor, Tensor]] = None):
        ctx.query_width, ctx.impl = query_width, impl
        ctx.set_materialize_grads(False)  # an unused output's gradient: None, not zeros
        ctx.untracked = untracked is not None
        if untracked is not None:
            coef_k, coef_v = untracked
        # The raw copy serves the coefficients' gradient alone: none for fixed ones.
        keep_raw = coef_k.requires_grad or coef_v.requires_grad
        s, b, g, width = mixed.shape
        ctx.kv_shape = (s, b, g, 2, (width - query_width) // 2)
        if impl == "triton":
            key, value, raw = triton_shift.qkv_forward(mixed, coef_k, coef_v, doc_ids,
                                                       query_width, keep_raw)
        else:
            kv = _kv_block(mixed, query_width)
            raw = kv.clone(memory_format=torch.contiguous_format) if keep_raw else None
            key = _torch_forward(kv[..., 0, :], coef_k, doc_ids)
            value = _torch_forward(kv[..., 1, :], coef_v, doc_ids)
        tracked = (coef_k, coef_v) if untracked is None else (None, None)
        ctx.save_for_backward(raw, *tracked, doc_ids)
        # megatron's DDP parameters (the module's own: nothing to save or version)
        ctx.params = untracked or (main_grad_params(coef_k, coef_v) if keep_raw else None)
        # The query is handed on as a view of the input (autograd makes this node its
        # grad_fn, so its gradient comes back here and is written into dmixed).
        return mixed[..., :query_width], key, value

    @staticmethod
    def backward(ctx, dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor]):
        raw, coef_k, coef_v, doc_ids = ctx.saved_tensors
        if ctx.untracked:
            coef_k, coef_v = ctx.params
        if dq is None and dk is None and dv is None:
            return None, None, None, None, None, None, None
        need_mixed = ctx.needs_input_grad[0]
        need_coef = ctx.untracked or ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if dk is None or dv is None:  # K or V unused downstream: its gradient is zero
            ref = dk if dk is not None else dv if dv is not None else dq
            zeros = ref.new_zeros(ctx.kv_shape[:3] + ctx.kv_shape[4:])  # [s, b, g, d]
            dk, dv = (g if g is not None else zeros for g in (dk, dv))
        if ctx.impl == "triton":
            dmixed, dcoef = triton_shift.qkv_backward(raw, ctx.kv_shape, coef_k, coef_v,
                                                      doc_ids, ctx.query_width, dq, dk, dv)
        else:
            dmixed, dcoef = _torch_qkv_grads(raw, ctx.kv_shape, coef_k, coef_v, doc_ids,
                                             ctx.query_width, (dq, dk, dv), need_mixed,
                                             need_coef)
        dck = dcv = None
        if need_coef:  # [2, g, n] sums: cast, or into main_grad (placeholders in autograd)
            dck, dcv = coefficient_gradients(dcoef, coef_k.dtype, ctx.params,
                                             in_autograd=not ctx.untracked)
        return (dmixed if need_mixed else None, dck, dcv, None, None, None, None)


def _kv_block(mixed: Tensor, query_width: int) -> Tensor:
    """K and V of ``mixed [s, b, g, q + 2d]`` as a ``[s, b, g, 2, d]`` view."""
    s, b, g, width = mixed.shape
    return mixed[..., query_width:].view(s, b, g, 2, (width - query_width) // 2)


def _torch_qkv_grads(kv: Optional[Tensor], kv_shape: tuple, coef_k: Tensor, coef_v: Tensor,
                     doc_ids: Optional[Tensor], query_width: int, grads, need_mixed: bool,
                     need_coef: bool):
    """``QKVShift.backward`` on torch ops, from the raw K/V ``kv [s, b, g, 2, d]``
    (None where the coefficients need no gradient) and the gradients of Q (or None),
    K and V: (dmixed or None, dcoef [2, g, n] or None: K's and V's coefficient
    gradients, summed in fp32 (fp64 for fp64))."""
    dq, dk, dv = grads
    s, b, g, _, d = kv_shape
    dy = torch.stack([dk, dv], -2)  # [s, b, g, 2, d]
    coef = torch.stack([coef_k, coef_v], dim=1)  # [g, 2, n]
    dmixed = dcoef = None
    if need_mixed:  # [s, b, g, q + 2d]: the query's gradient, then dx in place
        dmixed = dy.new_empty((s, b, g, query_width + 2 * d))
        if dq is None:
            dmixed[..., :query_width].zero_()
        else:
            dmixed[..., :query_width].copy_(dq)
        _torch_input_grad(coef, doc_ids, dy, out=_kv_block(dmixed, query_width))
    if need_coef:  # [g, 2, n] -> [2, g, n], a view (laid out where it is cast)
        dcoef = _torch_coef_grad(kv, doc_ids, dy, coef.shape[-1] - 1).transpose(0, 1)
    return dmixed, dcoef


def _torch_grads(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor], dy: Tensor,
                 need_x: bool, need_coef: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(dx, dcoef) of the torch path, each only when needed."""
    dx = _torch_input_grad(coef, doc_ids, dy) if need_x else None
    dcoef = None
    if need_coef:
        dcoef = _torch_coef_grad(x, doc_ids, dy, coef.shape[-1] - 1).to(coef.dtype)
    return dx, dcoef


# ----------------------------------------------------------------------------- torch path
# The torch functions take ``x [s, b, *heads, d]`` with ``coef [*heads, w+1]``: one
# head dim (``[s, b, h, d]``), or two for K and V stacked (``[s, b, g, 2, d]``).
def _lags(s: int, coef: Tensor) -> range:
    """Lags 1..w that reach a token inside a length-``s`` sequence."""
    return range(1, min(coef.shape[-1] - 1, s - 1) + 1)


def _lag_scale(c: Tensor, i: int, doc_ids: Optional[Tensor], rows: slice,
               ref_rows: slice) -> Tensor:
    """``c[..., i]`` as a broadcastable factor, zero where the two rows' documents differ."""
    scale = c[..., i, None]  # [*heads, 1]
    if doc_ids is None:
        return scale
    same = (doc_ids[rows] == doc_ids[ref_rows]).to(c.dtype)  # [s-i, b]
    return same.view(*same.shape, *[1] * scale.dim()) * scale  # [s-i, b, *heads, 1]


def _torch_forward(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor]) -> Tensor:
    c = coef.to(x.dtype)
    out = x * c[..., 0, None]  # [s, b, *heads, d]
    for i in _lags(x.shape[0], coef):
        # y_t += c_i · x_{t-i} for t >= i, in place (no rolled or padded copy).
        out[i:].addcmul_(x[:-i], _lag_scale(c, i, doc_ids, slice(i, None), slice(None, -i)))
    return out


def _torch_input_grad(coef: Tensor, doc_ids: Optional[Tensor], dy: Tensor,
                      out: Optional[Tensor] = None) -> Tensor:
    """``dx_t = Σ_i c_i · dy_{t+i}`` (same document): the shift run backwards (into
    ``out`` when given)."""
    c = coef.to(dy.dtype)
    dx = torch.mul(dy, c[..., 0, None], out=out) if out is not None else dy * c[..., 0, None]
    for i in _lags(dy.shape[0], coef):
        dx[:-i].addcmul_(dy[i:], _lag_scale(c, i, doc_ids, slice(i, None), slice(None, -i)))
    return dx


def _torch_coef_grad(x: Tensor, doc_ids: Optional[Tensor], dy: Tensor, window: int) -> Tensor:
    """``dcoef[..., i] = Σ_{t,b,d} dy_t · x_{t-i}`` over same-document pairs, ``[*heads, w+1]``.

    Without documents, one product and one reduction per lag. With documents,
    per lag one contraction over d gives ``[s-i, b, *heads]`` products (1/d of
    the activation; zero-padded to ``[s, b, *heads]``), then the lags are
    reduced over tokens and batch, masked by document, in one reduction.
    Accumulates in fp32 (fp64 for fp64 inputs).
    """
    s = x.shape[0]
    lags = range(min(window, s - 1) + 1)
    acc = torch.promote_types(x.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
    if doc_ids is None:
        over = (0, 1, x.dim() - 1)  # tokens, batch, d
        # (An einsum here is as fast in fp32 but ~40x slower in bf16 on the CPU.)
        sums = [(dy[i:] * x[: s - i]).sum(dim=over, dtype=acc) for i in lags]
        sums += [sums[0].new_zeros(sums[0].shape)] * (window + 1 - len(sums))  # w >= s
        return torch.stack(sums, dim=-1)  # [*heads, w+1]
    prods = x.new_zeros((window + 1, *x.shape[:-1]), dtype=acc)  # [w+1, s, b, *heads]
    for i in lags:
        prods[i, i:] = (dy[i:] * x[: s - i]).sum(dim=-1, dtype=acc)
    same = x.new_zeros((window + 1, *doc_ids.shape), dtype=acc)  # [w+1, s, b]
    for i in lags:
        same[i, i:] = (doc_ids[i:] == doc_ids[: s - i]).to(acc)
    heads = x.shape[2:-1]
    flat = torch.einsum("itbh,itb->hi", prods.reshape(window + 1, *doc_ids.shape, -1), same)
    return flat.reshape(*heads, window + 1)
