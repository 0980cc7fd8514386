"""The cross-entropy loss over this rank's vocabulary shard in one pass over the
logits each way (Triton): what ``model.cross_entropy_kernel: triton`` (``auto`` on
the torch backend on a GPU) computes the loss with. ``cross_entropy`` wraps the
two kernels in an autograd node and combines the shards of a TP group.

Why: megatron-core 0.16.1's cross-entropy without Transformer Engine
(``tensor_parallel.vocab_parallel_cross_entropy``) copies the logits to fp32,
subtracts the maximum, exponentiates, sums and divides in place, and keeps that
fp32 softmax for the backward, which subtracts the one-hot, scales, and is cast
back: ~10 passes over a ``[tokens, V/t]`` fp32 tensor and 4 bytes per logit kept
from the forward to the backward (at the paper's 36k vocabulary and 8192 tokens
per micro batch, 1.2 GB). Here:

* the forward reads each row once (an online log-sum-exp: a running maximum and
  a sum of exponentials rescaled to it) and writes per token the shard's
  maximum ``m``, its sum ``Σ exp(x - m)`` and the logit of the target where the
  shard holds it;
* the backward reads each row once and writes ``(softmax - onehot) · dloss`` in
  the logits' dtype, over the logits themselves (they are not needed after).
  The softmax is ``exp(x - m) / sum``, as megatron's: ``x - m`` loses nothing
  where a rounded log-sum-exp (``exp(x - lse)``) would lose ~1e-6 of it.

One program takes one token's row, in blocks of ``BLOCK_V`` columns.
Arithmetic is fp32; row offsets are int64 (tokens x V passes 2^31). On the CPU,
``TRITON_INTERPRET=1`` runs the same source (tests/model/test_cross_entropy.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_shift import next_pow2

try:  # Triton ships with CUDA builds of PyTorch; the CPU build takes megatron's loss.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_BLOCK = 4096  # columns per load: 8-16 KB of a row, several blocks in flight per SM


def available() -> bool:
    return triton is not None


def _block(v: int) -> int:
    return min(MAX_BLOCK, next_pow2(v))


def shard_statistics(logits: Tensor, labels: Tensor,
                     vocab_start: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per row of ``logits [n, v]`` (a unit stride in v; this rank's columns
    ``vocab_start .. vocab_start + v``): the shard's maximum ``m``, its ``Σ exp(x -
    m)``, and the logit of ``labels [n]`` where the shard holds it (0 elsewhere).
    fp32 ``[n]`` each."""
    n, v = logits.shape
    top = torch.empty(n, dtype=torch.float32, device=logits.device)
    sums, target = torch.empty_like(top), torch.empty_like(top)
    if n:
        _ce_fwd_kernel[(n,)](logits, labels, top, sums, target, logits.stride(0), v,
                             vocab_start, BLOCK_V=_block(v))
    return top, sums, target


def gradient_in_place(logits: Tensor, labels: Tensor, top: Tensor, scale: Tensor,
                      dloss: Tensor, vocab_start: int) -> Tensor:
    """Overwrites ``logits [n, v]`` with the loss's gradient ``(exp(x - top) · scale
    - onehot(labels)) · dloss`` per row (``top``: the whole vocabulary's maximum,
    ``scale``: 1 / its ``Σ exp(x - top)``, ``dloss``: fp32 ``[n]``); returns it."""
    n, v = logits.shape
    if n:
        _ce_bwd_kernel[(n,)](logits, labels, top, scale, dloss, logits.stride(0), v,
                             vocab_start, BLOCK_V=_block(v))
    return logits


if triton is not None:

    @triton.jit
    def _ce_fwd_kernel(x_ptr, label_ptr, top_ptr, sum_ptr, target_ptr, sx, V, vocab_start,
                       BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * sx
        cols = tl.arange(0, BLOCK_V)
        # fp32 scalars from the start: a loop-carried value must keep its type, and a
        # Python float would be a constexpr on the first trip (the interpreter does
        # not check this; a GPU compile does)
        none = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        m = tl.max(none, axis=0)
        acc = tl.sum(tl.zeros((BLOCK_V,), tl.float32), axis=0)
        for start in range(0, V, BLOCK_V):
            x = tl.load(base + start + cols, mask=start + cols < V,
                        other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # while every value so far is -inf, exponents are taken from 0: no -inf - -inf
            ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - ref) + tl.sum(tl.exp(x - ref), axis=0)
            m = m_new
        tl.store(top_ptr + row, m)
        tl.store(sum_ptr + row, acc)
        local = tl.load(label_ptr + row) - vocab_start
        inside = (local >= 0) & (local < V)
        hit = tl.load(base + tl.where(inside, local, 0)).to(tl.float32)
        tl.store(target_ptr + row, tl.where(inside, hit, 0.0))

    @triton.jit
    def _ce_bwd_kernel(x_ptr, label_ptr, top_ptr, inv_ptr, dloss_ptr, sx, V, vocab_start,
                       BLOCK_V: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * sx
        cols = tl.arange(0, BLOCK_V)
        m = tl.load(top_ptr + row)
        inv = tl.load(inv_ptr + row)
        scale = tl.load(dloss_ptr + row)
        local = tl.load(label_ptr + row) - vocab_start  # outside [0, V): no one-hot here
        for start in range(0, V, BLOCK_V):
            ok = start + cols < V
            x = tl.load(base + start + cols, mask=ok, other=0.0).to(tl.float32)
            g = tl.exp(x - m) * inv - tl.where(start + cols == local, 1.0, 0.0)
            tl.store(base + start + cols, (g * scale).to(x_ptr.dtype.element_ty), mask=ok)
