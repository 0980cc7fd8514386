"""SwiGLU in one pass over memory each way (Triton): what ``model.swiglu_kernel:
triton`` (``auto`` on the ``torch`` and ``te`` backends on a GPU) computes the
MLP's activation with. ``kvtrain.model.swiglu`` wraps the two kernels in its
autograd node.

Why: on torch ops (``SwiGLUFunction``'s eager path, megatron's own without its
compiled fusion) the forward is ``silu(gate)`` and a product, the backward
``silu(gate)`` again, two products and ``silu_backward``: with ``f`` the width of
one half of fc1's output ``[tokens, 2f]``, 5f elements read and written forward
and 11f backward per token. At the paper's 1.5B shape (f = 5504, 8192 tokens per
micro batch, bf16) one f-wide tensor is 90 MB: ~1.4 GB of memory traffic per
layer and step, against 3f forward (read gate and linear, write the product)
and 5f backward (read the gradient, gate and linear, write both halves of the
input's gradient) here: ~0.7 GB less (an estimate from the code, not a
measurement: ``benchmarks/swiglu.py`` times both on a GPU).

The arithmetic is fp32 and each result is rounded once (torch's ops round
``silu(gate)`` and each product to the tensor's dtype first)::

    out = silu(g) · l,   dl = dout · silu(g),
    dg = dout · l · σ(g) · (1 + g · (1 - σ(g)))

One program takes ``BLOCK`` columns of one token's row (the two halves are
``[gate | linear]``, megatron's chunk order; a unit stride in the columns). On
the CPU, ``TRITON_INTERPRET=1`` runs the same source (tests/model/test_swiglu.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .triton_shift import next_pow2

try:  # Triton ships with CUDA builds of PyTorch; the CPU build runs torch's ops.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

MAX_BLOCK = 1024  # columns per program: 2 KB of each half in bf16, 16 bytes a thread


def available() -> bool:
    return triton is not None


def _launch(f: int, n: int) -> tuple[tuple[int, int], int]:
    block = min(MAX_BLOCK, next_pow2(f))
    return (n, triton.cdiv(f, block)), block


def _rows(x: Tensor) -> Tensor:
    """``x [..., c]`` as rows ``[n, c]`` with a unit stride in the columns (a view
    where it can be one: fc1's output and fc2's input gradient are contiguous)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def forward(x: Tensor) -> Tensor:
    """``silu(gate) · linear`` of ``x [..., 2f] = [gate | linear]``: ``[..., f]``."""
    two_f = x.shape[-1]
    if two_f % 2:
        raise ValueError(f"SwiGLU's input has an even last dim [gate | linear], got {two_f}")
    f = two_f // 2
    rows = _rows(x)
    out = torch.empty((rows.shape[0], f), dtype=x.dtype, device=x.device)
    if out.numel():
        grid, block = _launch(f, rows.shape[0])
        _swiglu_fwd_kernel[grid](rows, out, rows.stride(0), out.stride(0), f, BLOCK=block)
    return out.view(*x.shape[:-1], f)


def backward(x: Tensor, grad: Tensor) -> Tensor:
    """The gradient ``[..., 2f]`` of ``x [..., 2f]`` from the output's ``grad [..., f]``."""
    f = x.shape[-1] // 2
    if grad.shape != (*x.shape[:-1], f):
        raise ValueError(f"expected a gradient {(*x.shape[:-1], f)} for SwiGLU's input "
                         f"{tuple(x.shape)}, got {tuple(grad.shape)}")
    rows, grads = _rows(x), _rows(grad)
    dx = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if dx.numel():
        grid, block = _launch(f, rows.shape[0])
        _swiglu_bwd_kernel[grid](rows, grads, dx, rows.stride(0), grads.stride(0),
                                 dx.stride(0), f, BLOCK=block)
    return dx.view(x.shape)


if triton is not None:

    @triton.jit
    def _swiglu_fwd_kernel(x_ptr, out_ptr, x_row, out_row, f, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)  # rows x 2f passes 2^31
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        x = x_ptr + row * x_row
        gate = tl.load(x + cols, mask=mask, other=0.0).to(tl.float32)
        linear = tl.load(x + f + cols, mask=mask, other=0.0).to(tl.float32)
        out = gate * tl.sigmoid(gate) * linear
        tl.store(out_ptr + row * out_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _swiglu_bwd_kernel(x_ptr, grad_ptr, dx_ptr, x_row, grad_row, dx_row, f,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < f
        x = x_ptr + row * x_row
        gate = tl.load(x + cols, mask=mask, other=0.0).to(tl.float32)
        linear = tl.load(x + f + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + row * grad_row + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        dlinear = grad * gate * sig
        dgate = grad * linear * sig * (1.0 + gate * (1.0 - sig))
        dx = dx_ptr + row * dx_row
        kind = dx_ptr.dtype.element_ty
        tl.store(dx + cols, dgate.to(kind), mask=mask)
        tl.store(dx + f + cols, dlinear.to(kind), mask=mask)
