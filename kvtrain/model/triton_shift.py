"""The KV shift's Triton kernels: what ``model.kv_shift.kernel: triton`` (``auto`` on
a GPU) computes it with. ``shift_kernels`` wraps them in autograd nodes.

Two pairs of kernels, each one pass over memory forward and one backward:

* ``shift_*``: one tensor ``x [s, b, h, d]`` (any strides, a unit stride in d);
* ``qkv_*``: K and V in their place in megatron's QKV output
  ``mixed [s, b, g, q + 2d]``. The forward writes the shifted K and V (tensors
  of their own) and a copy of the raw K/V for the backward, in the same pass;
  the backward writes the whole gradient of ``mixed`` (the query's copied in,
  K's and V's run backwards through the shift), so the split's concatenation
  is replaced, not added to.

One program takes a block of tokens of one (batch, head): the shift's lags are
rows of that block or of the one before, so every load is a row of ``d``
contiguous values. Accumulation is in fp32; the coefficient gradient is one
fp32 partial per program and lag, summed afterwards (no atomics: the result
does not depend on the schedule). Offsets are int64 (a ``[b, s]``-strided
gradient's batch stride times b passes 2^31 at long sequences).

On the CPU, ``TRITON_INTERPRET=1`` runs the same source
(tests/model/test_triton_interpreter.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of PyTorch; the CPU build runs the torch path.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` in plain Python: Triton's is a ``ConstexprFunction``,
    ~1.4 µs a call on the host, paid per launch by a step that cannot hide it."""
    return 1 << max(n - 1, 0).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def rows(t: Tensor) -> Tensor:
    """``t`` with a unit stride in d (the kernels index s, b, h by stride, d by 1)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(s: int, b: int, h: int, d: int, x: Tensor, coefs: list[Tensor],
            doc_ids: Optional[Tensor]):
    """Grid, block sizes, coefficients (in x's dtype) and document ids of the kernels."""
    block_d = next_pow2(d)
    # ~4k fp32 accumulators per program, fewer tokens as the window grows: the
    # backward holds a tile per lag (window 2, head dim 128: 183 registers and 8
    # warps per SM on sm_90 with one size for all, 87 and 20 now; window 1 as before)
    window = coefs[0].shape[1] - 1
    block_t = max(16, 4096 // block_d // next_pow2(max(window, 1)))
    grid = (_cdiv(s, block_t), b, h)
    # In x's dtype, as shift_tokens rounds them; the kernels load them as they are
    # and accumulate in fp32 (no cast kernel per call when they already are: a
    # launch costs more than the shift of a small layer).
    cs = [c.to(x.dtype).contiguous() for c in coefs]  # [h, w+1] each
    docs = doc_ids if doc_ids is not None else cs[0]  # a valid pointer, never read
    doc_strides = (doc_ids.stride(0), doc_ids.stride(1)) if doc_ids is not None else (0, 0)
    return grid, block_t, block_d, cs, docs, doc_strides


# ----------------------------------------------------------------------------- one tensor
def shift_forward(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor]) -> Tensor:
    x = rows(x)
    s, b, h, d = x.shape
    y = torch.empty((s, b, h, d), dtype=x.dtype, device=x.device)
    grid, block_t, block_d, (c,), docs, doc_strides = _launch(s, b, h, d, x, [coef], doc_ids)
    _shift_fwd_kernel[grid](
        x, c, docs, y, s, *x.stride()[:3], *y.stride()[:3], *doc_strides,
        W=coef.shape[1] - 1, HAS_DOC=doc_ids is not None, BLOCK_T=block_t, BLOCK_D=block_d,
        D=d,
    )
    return y


def shift_backward(x: Optional[Tensor], coef: Tensor, doc_ids: Optional[Tensor],
                   dy: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(dx, dcoef in fp32); without ``x`` (fixed coefficients) dx alone: (dx, None)."""
    dy = rows(dy)
    coef_grad = x is not None
    x = rows(x) if coef_grad else dy  # without x: a valid pointer, never read
    s, b, h, d = dy.shape
    n = coef.shape[1]
    dx = torch.empty((s, b, h, d), dtype=dy.dtype, device=dy.device)
    grid, block_t, block_d, (c,), docs, doc_strides = _launch(s, b, h, d, dy, [coef], doc_ids)
    partial = torch.empty((grid[0], b, h, n) if coef_grad else (1,), dtype=torch.float32,
                          device=dy.device)
    _shift_bwd_kernel[grid](
        x, dy, c, docs, dx, partial, s,
        *x.stride()[:3], *dy.stride()[:3], *dx.stride()[:3], *doc_strides,
        W=n - 1, HAS_DOC=doc_ids is not None, COEF=coef_grad, BLOCK_T=block_t,
        BLOCK_D=block_d, D=d,
    )
    return dx, partial.sum(dim=(0, 1)) if coef_grad else None  # [h, w+1]


# ----------------------------------------------------------------------------- K, V in mixed
def qkv_forward(mixed: Tensor, coef_k: Tensor, coef_v: Tensor, doc_ids: Optional[Tensor],
                query_width: int, keep_raw: bool = True
                ) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """(key, value [s, b, g, d], raw K/V [s, b, g, 2, d] or None without ``keep_raw``)
    from ``mixed [s, b, g, q + 2d]``."""
    mixed = rows(mixed)
    s, b, g, width = mixed.shape
    d = (width - query_width) // 2
    key, value = (torch.empty((s, b, g, d), dtype=mixed.dtype, device=mixed.device)
                  for _ in range(2))
    raw = torch.empty((s, b, g, 2, d), dtype=mixed.dtype, device=mixed.device) \
        if keep_raw else None
    raw_arg = raw if keep_raw else key.unsqueeze(3)  # a valid pointer, never written
    grid, block_t, block_d, (ck, cv), docs, doc_strides = _launch(
        s, b, g, d, mixed, [coef_k, coef_v], doc_ids)
    _qkv_shift_fwd_kernel[grid](
        mixed, ck, cv, docs, key, value, raw_arg, s, query_width,
        *mixed.stride()[:3], *key.stride()[:3], *raw_arg.stride()[:4], *doc_strides,
        W=coef_k.shape[1] - 1, HAS_DOC=doc_ids is not None, SAVE_RAW=keep_raw,
        BLOCK_T=block_t, BLOCK_D=block_d, D=d,
    )
    return key, value, raw


def qkv_backward(raw: Optional[Tensor], kv_shape: tuple, coef_k: Tensor, coef_v: Tensor,
                 doc_ids: Optional[Tensor], query_width: int, dq: Optional[Tensor], dk: Tensor,
                 dv: Tensor) -> tuple[Tensor, Optional[Tensor]]:
    """(dmixed [s, b, g, q + 2d], dcoef [2, g, w+1] or None) from the raw K/V
    ``[s, b, g, 2, d]`` (``kv_shape``; None: no coefficient gradients) and the gradients
    of Q (None: zero), K and V. dcoef: K's and V's coefficient gradients, fp32 sums in
    contiguous halves (``coefficient_grads.coefficient_gradients`` hands them on)."""
    dk, dv = rows(dk), rows(dv)
    s, b, g, _, d = kv_shape
    n = coef_k.shape[1]
    dmixed = torch.empty((s, b, g, query_width + 2 * d), dtype=dk.dtype, device=dk.device)
    grid, block_t, block_d, (ck, cv), docs, doc_strides = _launch(
        s, b, g, d, dk, [coef_k, coef_v], doc_ids)
    dq = rows(dq) if dq is not None else None
    q_arg = dq if dq is not None else dmixed  # a valid pointer, never read
    raw_arg = raw if raw is not None else dk.unsqueeze(3)  # never read without raw
    partial = torch.empty((grid[0], b, 2, g, n) if raw is not None else (1,),
                          dtype=torch.float32, device=dk.device)
    _qkv_shift_bwd_kernel[grid](
        raw_arg, dk, dv, q_arg, ck, cv, docs, dmixed, partial, s, query_width,
        *raw_arg.stride()[:4], *dk.stride()[:3], *dv.stride()[:3], *q_arg.stride()[:3],
        *dmixed.stride()[:3], *doc_strides,
        W=n - 1, HAS_DOC=doc_ids is not None, HAS_DQ=dq is not None, COEF=raw is not None,
        BLOCK_T=block_t, BLOCK_D=block_d, D=d,
    )
    return dmixed, partial.sum(dim=(0, 1)) if raw is not None else None  # [2, g, w+1]


if triton is not None:

    @triton.jit
    def _same_doc(doc_ptr, rows, ok, doc_t, sd_s, HAS_DOC: tl.constexpr):
        """``ok``, where the token ``rows`` is in the document ``doc_t`` too
        (``doc_ptr`` points at this batch row's ids)."""
        if HAS_DOC:
            ok = ok & (tl.load(doc_ptr + rows * sd_s, mask=ok, other=0) == doc_t)
        return ok

    @triton.jit
    def _fwd_rows(x_ptr, sx_s, c_ptr, y_ptr, sy_s, raw_ptr, sr_s, doc_ptr, sd_s, doc_t,
                  t, dd, in_seq, d_ok, W: tl.constexpr, HAS_DOC: tl.constexpr,
                  SAVE_RAW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """y_t = Σ_i c_i · x_{t-i} for a block of tokens of one (batch, head), whose
        rows start at x_ptr / y_ptr (raw_ptr: where x's own rows are copied)."""
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for i in tl.static_range(W + 1):
            src = t - i
            ok = _same_doc(doc_ptr, src, in_seq & (src >= 0), doc_t, sd_s, HAS_DOC)
            xv = tl.load(x_ptr + src[:, None] * sx_s + dd[None, :],
                         mask=ok[:, None] & d_ok[None, :], other=0.0)
            if SAVE_RAW:
                if i == 0:  # the block's own rows
                    tl.store(raw_ptr + t[:, None] * sr_s + dd[None, :], xv,
                             mask=in_seq[:, None] & d_ok[None, :])
            acc += tl.load(c_ptr + i).to(tl.float32) * xv.to(tl.float32)
        tl.store(y_ptr + t[:, None] * sy_s + dd[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=in_seq[:, None] & d_ok[None, :])

    @triton.jit
    def _bwd_rows(x_ptr, sx_s, g_ptr, sg_s, c_ptr, dx_ptr, so_s, part_ptr, doc_ptr, sd_s,
                  doc_t, t, dd, in_seq, d_ok, S, W: tl.constexpr, HAS_DOC: tl.constexpr,
                  COEF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        """dx_t = Σ_i c_i · dy_{t+i} into dx_ptr's rows; with ``COEF`` the partial
        dcoef_i = Σ_block dy_t · x_{t-i} into part_ptr[i]."""
        rows_ok = in_seq[:, None] & d_ok[None, :]
        g_t = tl.load(g_ptr + t[:, None] * sg_s + dd[None, :], mask=rows_ok,
                      other=0.0).to(tl.float32)
        dx = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for i in tl.static_range(W + 1):
            # dx: the token i steps ahead, if it is in the same document.
            dst = t + i
            ahead = _same_doc(doc_ptr, dst, in_seq & (dst < S), doc_t, sd_s, HAS_DOC)
            g = tl.load(g_ptr + dst[:, None] * sg_s + dd[None, :],
                        mask=ahead[:, None] & d_ok[None, :], other=0.0)
            dx += tl.load(c_ptr + i).to(tl.float32) * g.to(tl.float32)
            if COEF:  # dcoef: the token i steps back, if it is in the same document.
                src = t - i
                back = _same_doc(doc_ptr, src, in_seq & (src >= 0), doc_t, sd_s, HAS_DOC)
                xv = tl.load(x_ptr + src[:, None] * sx_s + dd[None, :],
                             mask=back[:, None] & d_ok[None, :], other=0.0)
                tl.store(part_ptr + i,
                         tl.sum(tl.sum(g_t * xv.to(tl.float32), axis=1), axis=0))
        tl.store(dx_ptr + t[:, None] * so_s + dd[None, :], dx.to(dx_ptr.dtype.element_ty),
                 mask=rows_ok)

    @triton.jit
    def _block(S, sd_s, sd_b, doc_ptr, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr,
               BLOCK_D: tl.constexpr, D: tl.constexpr):
        """This program's tokens, d offsets, their masks, and the batch row's ids."""
        t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)  # [BT]
        dd = tl.arange(0, BLOCK_D)
        in_seq = t < S
        docs = doc_ptr + tl.program_id(1).to(tl.int64) * sd_b
        doc_t = t  # unused without documents
        if HAS_DOC:
            doc_t = tl.load(docs + t * sd_s, mask=in_seq, other=0)
        return t, dd, in_seq, dd < D, docs, doc_t

    @triton.jit
    def _shift_fwd_kernel(x_ptr, c_ptr, doc_ptr, y_ptr, S, sx_s, sx_b, sx_h, sy_s, sy_b, sy_h,
                          sd_s, sd_b, W: tl.constexpr, HAS_DOC: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
        b, h = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, dd, in_seq, d_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC, BLOCK_T,
                                                  BLOCK_D, D)
        _fwd_rows(x_ptr + b * sx_b + h * sx_h, sx_s, c_ptr + h * (W + 1),
                  y_ptr + b * sy_b + h * sy_h, sy_s, y_ptr, 0, docs, sd_s, doc_t,
                  t, dd, in_seq, d_ok, W, HAS_DOC, False, BLOCK_T, BLOCK_D)

    @triton.jit
    def _shift_bwd_kernel(x_ptr, dy_ptr, c_ptr, doc_ptr, dx_ptr, part_ptr, S,
                          sx_s, sx_b, sx_h, sg_s, sg_b, sg_h, so_s, so_b, so_h, sd_s, sd_b,
                          W: tl.constexpr, HAS_DOC: tl.constexpr, COEF: tl.constexpr,
                          BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
        b, h = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, dd, in_seq, d_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC, BLOCK_T,
                                                  BLOCK_D, D)
        # part [blocks, b, h, w+1]
        part = part_ptr + ((tl.program_id(0) * tl.num_programs(1) + b)
                           * tl.num_programs(2) + h) * (W + 1)
        _bwd_rows(x_ptr + b * sx_b + h * sx_h, sx_s, dy_ptr + b * sg_b + h * sg_h, sg_s,
                  c_ptr + h * (W + 1), dx_ptr + b * so_b + h * so_h, so_s, part, docs, sd_s,
                  doc_t, t, dd, in_seq, d_ok, S, W, HAS_DOC, COEF, BLOCK_T, BLOCK_D)

    @triton.jit
    def _qkv_shift_fwd_kernel(m_ptr, ck_ptr, cv_ptr, doc_ptr, k_ptr, v_ptr, raw_ptr, S, Q,
                        sm_s, sm_b, sm_g, so_s, so_b, so_g, sr_s, sr_b, sr_g, sr_m, sd_s, sd_b,
                        W: tl.constexpr, HAS_DOC: tl.constexpr, SAVE_RAW: tl.constexpr,
                        BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, D: tl.constexpr):
        """K and V of one (batch, group) from their columns of mixed [s, b, g, q | d | d]."""
        b, g = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, dd, in_seq, d_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC, BLOCK_T,
                                                  BLOCK_D, D)
        rows = m_ptr + b * sm_b + g * sm_g + Q  # K's columns; V's follow
        out = b * so_b + g * so_g
        raw = raw_ptr + b * sr_b + g * sr_g
        _fwd_rows(rows, sm_s, ck_ptr + g * (W + 1), k_ptr + out, so_s, raw, sr_s, docs, sd_s,
                  doc_t, t, dd, in_seq, d_ok, W, HAS_DOC, SAVE_RAW, BLOCK_T, BLOCK_D)
        _fwd_rows(rows + D, sm_s, cv_ptr + g * (W + 1), v_ptr + out, so_s, raw + sr_m, sr_s,
                  docs, sd_s, doc_t, t, dd, in_seq, d_ok, W, HAS_DOC, SAVE_RAW, BLOCK_T,
                  BLOCK_D)

    @triton.jit
    def _qkv_shift_bwd_kernel(raw_ptr, dk_ptr, dv_ptr, dq_ptr, ck_ptr, cv_ptr, doc_ptr, dm_ptr,
                        part_ptr, S, Q, sr_s, sr_b, sr_g, sr_m, sk_s, sk_b, sk_g,
                        sv_s, sv_b, sv_g, sq_s, sq_b, sq_g, sm_s, sm_b, sm_g, sd_s, sd_b,
                        W: tl.constexpr, HAS_DOC: tl.constexpr, HAS_DQ: tl.constexpr,
                        COEF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                        D: tl.constexpr):
        """The gradient of mixed for one (batch, group): Q's copied, K's and V's shifted
        back; with ``COEF`` the coefficients' partial sums (from the raw K/V)."""
        b, g = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, dd, in_seq, d_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC, BLOCK_T,
                                                  BLOCK_D, D)
        dm = dm_ptr + b * sm_b + g * sm_g
        for j in range(0, Q, BLOCK_D):  # the query's columns, BLOCK_D at a time
            cols = j + dd
            ok = in_seq[:, None] & (cols < Q)[None, :]
            if HAS_DQ:
                dq = tl.load(dq_ptr + b * sq_b + g * sq_g + t[:, None] * sq_s + cols[None, :],
                             mask=ok, other=0.0)
            else:
                dq = tl.zeros((BLOCK_T, BLOCK_D), dtype=dm_ptr.dtype.element_ty)
            tl.store(dm + t[:, None] * sm_s + cols[None, :], dq, mask=ok)
        # part [blocks, b, 2, g, w+1]: K's, then V's (their sum: contiguous halves)
        groups = tl.num_programs(2)
        part = part_ptr + ((tl.program_id(0) * tl.num_programs(1) + b) * 2 * groups
                           + g) * (W + 1)
        raw = raw_ptr + b * sr_b + g * sr_g
        _bwd_rows(raw, sr_s, dk_ptr + b * sk_b + g * sk_g, sk_s, ck_ptr + g * (W + 1),
                  dm + Q, sm_s, part, docs, sd_s, doc_t, t, dd, in_seq, d_ok, S, W, HAS_DOC,
                  COEF, BLOCK_T, BLOCK_D)
        _bwd_rows(raw + sr_m, sr_s, dv_ptr + b * sv_b + g * sv_g, sv_s, cv_ptr + g * (W + 1),
                  dm + Q + D, sm_s, part + groups * (W + 1), docs, sd_s, doc_t, t, dd, in_seq,
                  d_ok, S, W, HAS_DOC, COEF, BLOCK_T, BLOCK_D)
