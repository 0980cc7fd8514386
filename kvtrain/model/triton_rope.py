"""RoPE in one pass over memory (Triton): what ``model.rope_kernel: triton`` (``auto``
on the torch backend on a GPU) rotates queries and keys with. ``rope`` wraps it in
an autograd node and hands it to megatron.

Without Transformer Engine, megatron-core 0.16.1 applies RoPE with torch ops
(``rope_utils._apply_rotary_pos_emb_bshd``): cos and sin of the angles, two
products, a negation, two concatenations and a sum, each a pass over the
tensor: ~12 passes forward and ~10 backward for Q and again for K, every layer
(and ~14 operator calls forward, each a kernel launch). This kernel reads each
row once and writes it once, in either direction.

One program takes one token of one sequence: all its heads. The kernels load the
cos and sin of the token's angles (``freqs [s, 1, 1, r]``, fp32, megatron's layout:
the two halves of r carry the same frequencies) from a table :data:`cos_sin`
computes once per angles tensor, not per program: libdevice's ``cos``/``sin``
(range reduction included) were most of the RoPE kernels' instructions, paid per
value, as Triton's layouts repeat a row's angles in every thread that holds one
of its heads (``benchmarks/kernel_compile.py`` counts them). With ``r < d``
(``rotary_percent``) the last ``d - r`` values pass unchanged.
Non-interleaved rotation (megatron's default) only::

    out[:r/2] = x1·cos(f1) - x2·sin(f1),  out[r/2:r] = x2·cos(f2) + x1·sin(f2)

and the backward, the transposed rotation::

    dx1 = g1·cos(f1) + g2·sin(f2),        dx2 = g2·cos(f2) - g1·sin(f1)

Arithmetic is fp32 and the result is rounded once (megatron's torch ops round
cos/sin and each product to the tensor's dtype first). On the CPU,
``TRITON_INTERPRET=1`` runs the same source (tests/model/test_rope.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_shift import next_pow2, rows

try:  # Triton ships with CUDA builds of PyTorch; the CPU build runs megatron's RoPE.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None


def available() -> bool:
    return triton is not None


def cos_sin(freqs: Tensor) -> Tensor:
    """cos and sin of RoPE's angles ``freqs [s, 1, 1, r]``: fp32 ``[s, 2r]`` (the r
    cosines, then the r sines), computed once per angles tensor and kept on it.

    Megatron's ``RotaryEmbedding.forward`` is an ``lru_cache``: every layer of every
    step gets the same ``freqs`` object (one per model chunk and sequence length), so
    a run computes each table once (full recomputation's detached copies excepted).
    Decoding slices it per step and layer (``freqs[start:end]``): a slice takes its
    rows of the whole tensor's table.
    The table (a slice's: its rows of the whole table) lives as long as its tensor
    (an attribute of it: no cache of ours to size or evict) and is computed again if
    the tensor changes in place (its version counter, which views share). Tensors made under ``torch.inference_mode``
    (megatron's inference engine) keep no version counter: their table is computed
    per call."""
    if freqs.is_inference():
        return _table_of(freqs)
    kept = getattr(freqs, "_kvtrain_cos_sin", None)  # ~0.3 µs a call when kept
    if kept is None or kept[0] != freqs._version:
        whole, first = _rows_of(freqs)
        table = (_table_of(freqs) if whole is freqs
                 else cos_sin(whole)[first:first + freqs.shape[0]])
        kept = (freqs._version, table)
        freqs._kvtrain_cos_sin = kept
    return kept[1]


def _rows_of(freqs: Tensor) -> tuple[Tensor, int]:
    """(the tensor whose table serves ``freqs [s, 1, 1, r]``, ``freqs``' first row in
    it): the tensor ``freqs`` is a run of rows of (megatron's angles are a view of a
    ``[S, r]`` tensor, decoding slices that view), or ``freqs`` itself."""
    whole, r = freqs._base, freqs.shape[-1]
    if (whole is None or whole.dtype != freqs.dtype or freqs.numel() != freqs.shape[0] * r
            or whole.shape[-1] != r or whole.numel() != whole.shape[0] * r  # rows alone
            or whole.stride(0) != freqs.stride(0) or whole.stride(0) <= 0
            or whole.stride(-1) != freqs.stride(-1)):
        return freqs, 0
    first, rest = divmod(freqs.storage_offset() - whole.storage_offset(), whole.stride(0))
    if rest or first < 0 or first + freqs.shape[0] > whole.shape[0]:
        return freqs, 0
    return whole, first


def _table_of(freqs: Tensor) -> Tensor:
    angles = freqs.detach().reshape(freqs.shape[0], freqs.shape[-1]).float()  # [s, r]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)  # [s, 2r]


def rotate(t: Tensor, freqs: Tensor, inverse: bool = False) -> Tensor:
    """``t [s, b, h, d]`` rotated by the angles ``freqs [>= s, 1, 1, r]``, or by the
    transposed rotation (``inverse``, the backward): a new contiguous tensor."""
    t = rows(t)
    s, b, h, d = t.shape
    r = freqs.shape[-1]
    table = cos_sin(freqs)  # [>= s, 2r]
    out = torch.empty((s, b, h, d), dtype=t.dtype, device=t.device)
    half = r // 2
    _rope_kernel[(s, b)](
        t, table, out, *t.stride()[:3], table.stride(0), *out.stride()[:3],
        H=h, HALF=half, D=d, BLOCK_H=next_pow2(h), BLOCK_HALF=next_pow2(half),
        BLOCK_PASS=next_pow2(max(d - r, 1)), INVERSE=inverse,
    )
    return out


if triton is not None:

    @triton.jit
    def cos_sin_halves(p, mask, HALF: tl.constexpr):
        """cos and sin of both halves' angles from :data:`cos_sin`'s table, ``p``
        pointing at the first half's columns of a token's row (fp32)."""
        c1 = tl.load(p, mask=mask, other=0.0)
        c2 = tl.load(p + HALF, mask=mask, other=0.0)
        s1 = tl.load(p + 2 * HALF, mask=mask, other=0.0)
        s2 = tl.load(p + 3 * HALF, mask=mask, other=0.0)
        return c1, s1, c2, s2

    @triton.jit
    def rotate_halves(x1, x2, c1, s1, c2, s2, INVERSE: tl.constexpr):
        """megatron's non-interleaved rotation of the halves ``x1, x2`` by the cos/sin
        of their angles, or its transpose (``INVERSE``: the backward); fp32 in, out."""
        if INVERSE:
            y1 = x1 * c1 + x2 * s2
            y2 = x2 * c2 - x1 * s1
        else:
            y1 = x1 * c1 - x2 * s1
            y2 = x2 * c2 + x1 * s2
        return y1, y2

    @triton.jit
    def _rope_kernel(t_ptr, cs_ptr, o_ptr, st_s, st_b, st_h, sc_s, so_s, so_b, so_h,
                     H: tl.constexpr, HALF: tl.constexpr, D: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_PASS: tl.constexpr, INVERSE: tl.constexpr):
        pos = tl.program_id(0).to(tl.int64)
        seq = tl.program_id(1).to(tl.int64)
        heads = tl.arange(0, BLOCK_H).to(tl.int64)  # h * stride: past 2^31 for [b, h, s, d]
        cols = tl.arange(0, BLOCK_HALF)
        ok_h = heads < H
        ok_c = cols < HALF
        c1, s1, c2, s2 = cos_sin_halves(cs_ptr + pos * sc_s + cols, ok_c, HALF)
        c1, s1, c2, s2 = c1[None, :], s1[None, :], c2[None, :], s2[None, :]
        rows_in = t_ptr + pos * st_s + seq * st_b + heads[:, None] * st_h  # [BLOCK_H, 1]
        rows_out = o_ptr + pos * so_s + seq * so_b + heads[:, None] * so_h
        ok = ok_h[:, None] & ok_c[None, :]
        x1 = tl.load(rows_in + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(rows_in + HALF + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        y1, y2 = rotate_halves(x1, x2, c1, s1, c2, s2, INVERSE)
        tl.store(rows_out + cols[None, :], y1.to(o_ptr.dtype.element_ty), mask=ok)
        tl.store(rows_out + HALF + cols[None, :], y2.to(o_ptr.dtype.element_ty), mask=ok)
        if D > 2 * HALF:  # the values past the rotary dims pass unchanged
            rest = tl.arange(0, BLOCK_PASS)
            ok_p = ok_h[:, None] & (rest < D - 2 * HALF)[None, :]
            p = tl.load(rows_in + 2 * HALF + rest[None, :], mask=ok_p)
            tl.store(rows_out + 2 * HALF + rest[None, :], p, mask=ok_p)
