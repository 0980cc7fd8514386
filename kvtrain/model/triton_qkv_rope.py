"""Q/K/V split, the K/V shift (optional) and RoPE of Q and K, in one Triton pass each
way. ``qkv_rope`` wraps the two launchers in one autograd node.

Why: without it a layer runs the shift node (``triton_shift.qkv_forward``: shifted
K, V and a raw K/V copy), then RoPE of Q and of K (two more kernels); backward,
RoPE's two kernels and then the shift node, or for vanilla attention the split's
concatenation. Here the split, shift and rotation happen where the values are
already in registers.

Layout: megatron's QKV output ``mixed [s, b, g, q + 2d]`` (a unit stride in the
last dim, any others): per KV group g, ``q = r_q·d`` query values (r_q heads), then
K (d), then V (d). ``freqs [>= s, 1, 1, d]`` fp32, megatron's layout (both halves
of d carry the same frequencies; full rotary only); the kernels load the cos and
sin of the angles from ``triton_rope.cos_sin``'s table. One program takes a block of
tokens of one (batch, group): its r_q query heads, K and V. RoPE pairs column c
with c + d/2, so every row is loaded as two ``[BLOCK_T, d/2]`` halves; the shift's
lags are rows of the block or of the one before (same document only). fp32
arithmetic, each result rounded once; int64 offsets; the coefficient gradient is
one fp32 partial per program and lag, summed afterwards (no atomics).

The backward reads, of ``mixed``, only its own block's raw K/V rows: the partial
for lag i is Σ x_t · dx̂_{t+i} over the block's tokens t (the gradient rows ahead,
which it loads for dx anyway), not Σ dx̂_t · x_{t-i}, which would read the rows of
the block before. So the gradient can be written over ``mixed`` (``in_place``,
where the node keeps it: ``qkv_rope``'s module doc), and the node's backward holds
no second buffer of ``mixed``'s size.

Outputs: ``query [s, b, g·r_q, d]`` and ``key [s, b, g, d]`` are new tensors (Q
rotated; K shifted, then rotated). ``value`` is a view of ``mixed``: vanilla, its V
columns (nothing written); shifted, V̂ written in place over the first d query
columns of each group, which are dead once the program has rotated them into
``query``. The K and V columns stay intact: the backward reads the raw K/V there.

Memory traffic per token and KV group, in elements read plus written (q = r_q·d;
"today" is the shift node, or the split's views and its concatenation backward,
plus kvtrain's Triton RoPE of Q and K; the lags' re-reads of neighbouring rows are
counted once, as they hit the cache)::

                   forward today  fused     backward today  fused
    vanilla        2q + 2d        2q + 2d   4q + 6d         2q + 4d
    shift          2q + 6d (+2d)  2q + 4d   4q + 6d (+2d)   2q + 4d (+2d)

(+2d: the raw K/V when the coefficients learn: written forward and read backward
today, only read from ``mixed``'s K/V columns here.) Vanilla forward saves a launch.
Held for the backward with the shift: attention saves V̂, a view of ``mixed``, so
all of ``mixed`` (q + 2d) stays alive, where today the raw copy and V̂ (3d) do:
the same for MHA, (r_q - 1)·d more per token with GQA (and (r_q + 1)·d more with
fixed coefficients, which keep no raw copy today).

On the CPU, ``TRITON_INTERPRET=1`` runs the same source (tests/model/test_qkv_rope.py).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .triton_rope import cos_sin
from .triton_shift import _cdiv, next_pow2, rows

try:  # Triton ships with CUDA builds of PyTorch; the CPU build has no fused node.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def tokens_per_block(d: int, window: int) -> int:
    """Tokens per program: ~1k fp32 values per half-row tile [BLOCK_T, d/2] (a
    program holds ~8 such tiles: two halves of a row, cos and sin of both, the
    shift's accumulators: ~64 registers a thread with 4 warps), fewer as the shift's
    ``window`` grows: the backward holds a gradient tile per lag (head dim 64, fp32,
    window 3: 252 registers and 8 warps per SM on sm_90 at 32 tokens, 120 and 16 at
    16; ``benchmarks/kernel_compile.py``). Untuned on a GPU; the tests shrink it to
    have several blocks on short sequences."""
    return max(16, 2048 // next_pow2(d) // next_pow2(max(window, 1)))


def _setup(s: int, b: int, g: int, d: int, dtype: torch.dtype, coefs, doc_ids,
           stand_in: Tensor):
    """Grid, tokens per block, half-row block, coefficients in ``dtype`` (as
    ``shift_tokens`` rounds them; fp32 accumulation in the kernels), document ids
    and their strides. ``stand_in``: a valid pointer for what is absent, never read."""
    block_t = tokens_per_block(d, coefs[0].shape[1] - 1 if coefs[0] is not None else 0)
    grid = (_cdiv(s, block_t), b, g)
    cs = ([c if c.dtype == dtype and c.is_contiguous() else c.to(dtype).contiguous()
           for c in coefs] if coefs[0] is not None else [stand_in] * 2)  # no aten::to per call
    docs = doc_ids if doc_ids is not None else stand_in
    doc_strides = (doc_ids.stride(0), doc_ids.stride(1)) if doc_ids is not None else (0, 0)
    return grid, block_t, next_pow2(d // 2), cs, docs, doc_strides


def _angles_of(freqs: Tensor, s: int, d: int) -> Tensor:
    """The cos/sin table ``[>= s, 2d]`` of the angles ``freqs [>= s, 1, 1, d]``
    (``triton_rope.cos_sin``); ValueError for other angles."""
    if (freqs.dim() != 4 or freqs.shape[0] < s or freqs.shape[1] != 1 or freqs.shape[2] != 1
            or freqs.shape[3] != d or d % 2):
        raise ValueError(f"the fused QKV RoPE rotates all of an even head dim: expected freqs "
                         f"[>= {s}, 1, 1, {d}], got {tuple(freqs.shape)}")
    return cos_sin(freqs)


def forward(mixed: Tensor, freqs: Tensor, query_width: int, coef_k: Optional[Tensor] = None,
            coef_v: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None
            ) -> tuple[Tensor, Tensor, Tensor]:
    """(query [s, b, np, d], key [s, b, g, d], value [s, b, g, d]) from ``mixed``.

    With coefficients (``[g, w+1]`` both), K and V are shifted and V̂ overwrites the
    first d query columns of every group of ``mixed`` (``value`` is that view)."""
    if mixed.stride(-1) != 1:
        raise ValueError("the fused QKV RoPE needs mixed with a unit stride in its last dim")
    s, b, g, width = mixed.shape
    d = (width - query_width) // 2
    table = _angles_of(freqs, s, d)  # [>= s, 2d]: cos, sin
    r_q = query_width // d
    shift = coef_k is not None
    query = torch.empty((s, b, g * r_q, d), dtype=mixed.dtype, device=mixed.device)
    key = torch.empty((s, b, g, d), dtype=mixed.dtype, device=mixed.device)
    grid, block_t, block_h, (ck, cv), docs, doc_strides = _setup(
        s, b, g, d, mixed.dtype, [coef_k, coef_v], doc_ids, table)
    _fwd_kernel[grid](
        mixed, table, ck, cv, docs, query, key, s, *mixed.stride()[:3], table.stride(0),
        *query.stride()[:3], *key.stride()[:3], *doc_strides,
        R=r_q, W=coef_k.shape[1] - 1 if shift else 0, SHIFT=shift,
        HAS_DOC=shift and doc_ids is not None, BLOCK_T=block_t, BLOCK_H=block_h, HALF=d // 2,
    )
    value = mixed[..., :d] if shift else mixed[..., query_width + d:]
    return query, key, value


def backward(mixed: Optional[Tensor], freqs: Tensor, query_width: int,
             coef_k: Optional[Tensor], coef_v: Optional[Tensor], doc_ids: Optional[Tensor],
             dq: Optional[Tensor], dk: Optional[Tensor], dv: Optional[Tensor],
             need_coef: bool, in_place: bool = False) -> tuple[Tensor, Optional[Tensor]]:
    """(dmixed [s, b, g, q + 2d], dcoef [2, g, w+1] or None) from the outputs' gradients
    (any strides; None: zero, not all three): dcoef is K's and V's coefficient
    gradients, fp32 sums (contiguous halves; the caller casts or accumulates them,
    ``coefficient_grads.coefficient_gradients``). ``mixed`` (its K/V columns: the raw K
    and V) is read only with ``need_coef`` and may be None otherwise. ``in_place``:
    dmixed is written over ``mixed`` and is ``mixed`` (each program reads only its own
    tokens' raw K/V, before it writes their gradient; without ``need_coef`` it reads
    none), so the backward allocates no tensor of mixed's size."""
    if in_place and not (mixed is not None and mixed.stride(-1) == 1):
        raise ValueError("qkv_rope's backward writes in place only over a mixed it is given "
                         "with a unit stride in its last dim")
    ref = next(x for x in (dq, dk, dv) if x is not None)
    s, b = ref.shape[:2]
    d = freqs.shape[-1]
    r_q = query_width // d
    g = dk.shape[2] if dk is not None else dv.shape[2] if dv is not None else dq.shape[2] // r_q
    table = _angles_of(freqs, s, d)  # [>= s, 2d]: cos, sin
    shift = coef_k is not None
    coef = need_coef and shift
    dmixed = mixed if in_place else torch.empty(
        (s, b, g, query_width + 2 * d), dtype=ref.dtype, device=ref.device)
    grid, block_t, block_h, (ck, cv), docs, doc_strides = _setup(
        s, b, g, d, ref.dtype, [coef_k, coef_v], doc_ids, table)
    # absent gradients (and mixed without need_coef): dmixed as a pointer, never read
    dq_, dk_, dv_ = (rows(x) if x is not None else dmixed for x in (dq, dk, dv))
    m = rows(mixed) if coef else dmixed
    n = coef_k.shape[1] if shift else 1
    partial = torch.empty((grid[0], b, 2, g, n) if coef else (1,), dtype=torch.float32,
                          device=ref.device)
    _bwd_kernel[grid](
        m, table, ck, cv, docs, dq_, dk_, dv_, dmixed, partial, s, *m.stride()[:3],
        table.stride(0), *dq_.stride()[:3], *dk_.stride()[:3], *dv_.stride()[:3],
        *dmixed.stride()[:3], *doc_strides,
        R=r_q, W=n - 1, SHIFT=shift, COEF=coef, HAS_DOC=shift and doc_ids is not None,
        HAS_DQ=dq is not None, HAS_DK=dk is not None, HAS_DV=dv is not None,
        BLOCK_T=block_t, BLOCK_H=block_h, HALF=d // 2,
    )
    return dmixed, partial.sum(dim=(0, 1)) if coef else None  # [2, g, w+1]


if triton is not None:
    from .triton_rope import cos_sin_halves as _cos_sin, rotate_halves as _rotate
    from .triton_shift import _block, _same_doc

    @triton.jit
    def _angles(f_ptr, rows, sf_s, cols, ok, HALF: tl.constexpr):
        """cos and sin of both halves' angles at the tokens ``rows`` ([BT, BH] each),
        from the cos/sin table at ``f_ptr``."""
        return _cos_sin(f_ptr + rows[:, None] * sf_s + cols[None, :], ok, HALF)

    @triton.jit
    def _load(ptr, rows, s_s, cols, ok, HALF: tl.constexpr, PRESENT: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
        """The two halves of the rows ``rows`` at ``ptr`` in fp32 (zeros if not PRESENT)."""
        if PRESENT:
            p = ptr + rows[:, None] * s_s + cols[None, :]
            x1 = tl.load(p, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(p + HALF, mask=ok, other=0.0).to(tl.float32)
        else:
            x1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            x2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        return x1, x2

    @triton.jit
    def _store(ptr, rows, s_s, cols, ok, y1, y2, HALF: tl.constexpr):
        p = ptr + rows[:, None] * s_s + cols[None, :]
        tl.store(p, y1.to(ptr.dtype.element_ty), mask=ok)
        tl.store(p + HALF, y2.to(ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _shifted(x_ptr, sx_s, c_ptr, doc_ptr, sd_s, doc_t, t, cols, in_seq, c_ok,
                 W: tl.constexpr, SHIFT: tl.constexpr, HAS_DOC: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr):
        """Both halves of x̂_t = Σ_i c_i · x_{t-i} (same document), or of x_t itself."""
        if SHIFT:
            a1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            a2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
            for i in tl.static_range(W + 1):
                src = t - i
                back = _same_doc(doc_ptr, src, in_seq & (src >= 0), doc_t, sd_s, HAS_DOC)
                x1, x2 = _load(x_ptr, src, sx_s, cols, back[:, None] & c_ok[None, :], HALF,
                               True, BLOCK_T, BLOCK_H)
                c = tl.load(c_ptr + i).to(tl.float32)
                a1 += c * x1
                a2 += c * x2
        else:
            a1, a2 = _load(x_ptr, t, sx_s, cols, in_seq[:, None] & c_ok[None, :], HALF, True,
                           BLOCK_T, BLOCK_H)
        return a1, a2

    @triton.jit
    def _fwd_kernel(m_ptr, f_ptr, ck_ptr, cv_ptr, doc_ptr, q_ptr, k_ptr, S,
                    sm_s, sm_b, sm_g, sf_s, sq_s, sq_b, sq_h, sk_s, sk_b, sk_g, sd_s, sd_b,
                    R: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr,
                    HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    HALF: tl.constexpr):
        """Q heads rotated, K (shifted and) rotated, V̂ in place: one (batch, group)."""
        b, g = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, cols, in_seq, c_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC,
                                                    BLOCK_T, BLOCK_H, HALF)
        ok = in_seq[:, None] & c_ok[None, :]
        c1, s1, c2, s2 = _angles(f_ptr, t, sf_s, cols, ok, HALF)
        row = m_ptr + b * sm_b + g * sm_g
        for j in range(R):  # the group's query heads
            x1, x2 = _load(row + j * 2 * HALF, t, sm_s, cols, ok, HALF, True, BLOCK_T, BLOCK_H)
            y1, y2 = _rotate(x1, x2, c1, s1, c2, s2, False)
            _store(q_ptr + b * sq_b + (g * R + j) * sq_h, t, sq_s, cols, ok, y1, y2, HALF)
        k_row = row + R * 2 * HALF
        k1, k2 = _shifted(k_row, sm_s, ck_ptr + g * (W + 1), docs, sd_s, doc_t, t, cols,
                          in_seq, c_ok, W, SHIFT, HAS_DOC, BLOCK_T, BLOCK_H, HALF)
        k1, k2 = _rotate(k1, k2, c1, s1, c2, s2, False)
        _store(k_ptr + b * sk_b + g * sk_g, t, sk_s, cols, ok, k1, k2, HALF)
        if SHIFT:
            v1, v2 = _shifted(k_row + 2 * HALF, sm_s, cv_ptr + g * (W + 1), docs, sd_s, doc_t,
                              t, cols, in_seq, c_ok, W, SHIFT, HAS_DOC, BLOCK_T, BLOCK_H, HALF)
            # V̂ goes over the first query columns of this program's own tokens. Their
            # values were loaded above, but by whichever threads hold them in the
            # tile's layout: all of them must have loaded before any thread stores.
            # No other program reads these columns (neighbours read only K and V
            # columns of this block's tokens, for their lags), so no race across
            # programs.
            tl.debug_barrier()
            _store(row, t, sm_s, cols, ok, v1, v2, HALF)

    @triton.jit
    def _grad_kv(g_ptr, sg_s, x_ptr, sx_s, out_ptr, so_s, part_ptr, f_ptr, sf_s, c_ptr,
                 doc_ptr, sd_s, doc_t, t, cols, in_seq, c_ok, S, W: tl.constexpr,
                 SHIFT: tl.constexpr, COEF: tl.constexpr, ROTATE: tl.constexpr,
                 PRESENT: tl.constexpr, HAS_DOC: tl.constexpr, BLOCK_T: tl.constexpr,
                 BLOCK_H: tl.constexpr, HALF: tl.constexpr):
        """K's or V's columns of the gradient, dx_t = Σ_i c_i · dx̂_{t+i} (same document),
        where dx̂ is the gradient at ``g_ptr`` rotated back (``ROTATE``, K) or as it is
        (V); with ``COEF`` the coefficients' partial sums part[i] = Σ_block x_t · dx̂_{t+i}
        (= Σ dx̂_t · x_{t-i} over the sequence) of the raw rows x at ``x_ptr``. Only this
        block's own raw rows are read, all before the gradient is stored: ``out_ptr`` may
        be ``x_ptr`` (the gradient written over the raw K/V, in place)."""
        ok = in_seq[:, None] & c_ok[None, :]
        x1, x2 = _load(x_ptr, t, sx_s, cols, ok, HALF, COEF, BLOCK_T, BLOCK_H)
        d1 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        d2 = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
        for i in tl.static_range(W + 1):
            dst = t + i
            ahead = _same_doc(doc_ptr, dst, in_seq & (dst < S), doc_t, sd_s, HAS_DOC)
            lag_ok = ahead[:, None] & c_ok[None, :]
            y1, y2 = _load(g_ptr, dst, sg_s, cols, lag_ok, HALF, PRESENT, BLOCK_T, BLOCK_H)
            if PRESENT:
                if ROTATE:  # by the angles of the token the gradient belongs to
                    c1, s1, c2, s2 = _angles(f_ptr, dst, sf_s, cols, lag_ok, HALF)
                    y1, y2 = _rotate(y1, y2, c1, s1, c2, s2, True)
            if SHIFT:
                c = tl.load(c_ptr + i).to(tl.float32)
                d1 = d1 + c * y1
                d2 = d2 + c * y2
            else:
                d1, d2 = y1, y2
            if COEF:
                tl.store(part_ptr + i, tl.sum(tl.sum(x1 * y1 + x2 * y2, axis=1), axis=0))
        if COEF:
            # The raw rows were loaded by whichever threads hold them in the tile's
            # layout: all of them must have loaded before any thread stores over them.
            tl.debug_barrier()
        _store(out_ptr, t, so_s, cols, ok, d1, d2, HALF)

    @triton.jit
    def _bwd_kernel(m_ptr, f_ptr, ck_ptr, cv_ptr, doc_ptr, dq_ptr, dk_ptr, dv_ptr, dm_ptr,
                    part_ptr, S, sm_s, sm_b, sm_g, sf_s, sq_s, sq_b, sq_h, sk_s, sk_b, sk_g,
                    sv_s, sv_b, sv_g, so_s, so_b, so_g, sd_s, sd_b,
                    R: tl.constexpr, W: tl.constexpr, SHIFT: tl.constexpr, COEF: tl.constexpr,
                    HAS_DOC: tl.constexpr, HAS_DQ: tl.constexpr, HAS_DK: tl.constexpr,
                    HAS_DV: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                    HALF: tl.constexpr):
        """The gradient of mixed for one (batch, group): Q's rotated back, K's rotated
        back and shifted back, V's shifted back; with ``COEF`` the coefficients'
        partial sums, from the raw K/V columns of mixed (this block's rows only: ``dm_ptr``
        may be ``m_ptr``, whose query columns nothing reads)."""
        b, g = tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)
        t, cols, in_seq, c_ok, docs, doc_t = _block(S, sd_s, sd_b, doc_ptr, HAS_DOC,
                                                    BLOCK_T, BLOCK_H, HALF)
        ok = in_seq[:, None] & c_ok[None, :]
        dm = dm_ptr + b * so_b + g * so_g
        c1, s1, c2, s2 = _angles(f_ptr, t, sf_s, cols, ok, HALF)
        for j in range(R):
            y1, y2 = _load(dq_ptr + b * sq_b + (g * R + j) * sq_h, t, sq_s, cols, ok, HALF,
                           HAS_DQ, BLOCK_T, BLOCK_H)
            y1, y2 = _rotate(y1, y2, c1, s1, c2, s2, True)
            _store(dm + j * 2 * HALF, t, so_s, cols, ok, y1, y2, HALF)
        # part [blocks, b, 2, g, w+1]: K's, then V's (their sum: contiguous halves)
        groups = tl.num_programs(2)
        part = part_ptr + ((tl.program_id(0) * tl.num_programs(1) + b) * 2 * groups
                           + g) * (W + 1)
        k_col = R * 2 * HALF
        raw = m_ptr + b * sm_b + g * sm_g + k_col
        _grad_kv(dk_ptr + b * sk_b + g * sk_g, sk_s, raw, sm_s, dm + k_col, so_s, part,
                 f_ptr, sf_s, ck_ptr + g * (W + 1), docs, sd_s, doc_t, t, cols, in_seq, c_ok,
                 S, W, SHIFT, COEF, True, HAS_DK, HAS_DOC, BLOCK_T, BLOCK_H, HALF)
        _grad_kv(dv_ptr + b * sv_b + g * sv_g, sv_s, raw + 2 * HALF, sm_s,
                 dm + k_col + 2 * HALF, so_s, part + groups * (W + 1), f_ptr, sf_s,
                 cv_ptr + g * (W + 1),
                 docs, sd_s, doc_t, t, cols, in_seq, c_ok, S, W, SHIFT, COEF, False, HAS_DV,
                 HAS_DOC, BLOCK_T, BLOCK_H, HALF)
