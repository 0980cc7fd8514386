"""SwiGLU that keeps only its input for backward.

megatron's MLP without its fused activation (``bias_activation_fusion``, whose
kernel is ``torch.compile``d: minutes of compiling in CPU tests, and a path that
failed on GPUs without apex) runs ``silu(x_glu) * (x_linear + glu_linear_offset)``
as three autograd ops, which keep ``silu``'s input and output and the sum, a
copy of ``x_linear``: ``2f + 2f`` elements per token beside fc2's input ``f``,
5f in all, where the plan (``kvtrain.plan.memory``) counts 3f.

:class:`SwiGLU` is one autograd node: it keeps fc1's output ``[.., 2f]`` (its
input) and recomputes ``silu`` in backward, so an MLP keeps ``2f + f``. The
values and gradients are the ones of megatron's eager path, bit for bit (the
same ops on the same operands). It fills the activation slot of every layer
spec's MLP (megatron reads that slot under ``use_te_activation_func``, a name
from when only TE's modules went there; ``kvtrain.model.builder`` sets it).

What computes it (``model.swiglu_kernel: auto | triton | torch``, resolved once per
start and recorded with the backend):

* ``auto``: ``triton`` on a GPU where Triton imports, for the ``torch`` and ``te``
  backends (fc1's output is a plain tensor on both), in bf16/fp16/fp32; else
  ``torch`` (``local``, the reference, keeps the torch ops);
* ``triton``: one pass over memory each way (``kvtrain.model.triton_swiglu``; a
  GPU), refused in one line elsewhere;
* ``torch``: the torch ops above, megatron's eager arithmetic.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core.transformer.module import MegatronModule

from . import triton_swiglu
from .kernel_choice import auto_choice, explicit_choice


def choose_swiglu(requested: str, backend: str, cuda: bool,
                  dtype: torch.dtype) -> tuple[str, str]:
    """The SwiGLU kernel for ``model.swiglu_kernel: requested`` on ``backend`` for
    activations of ``dtype``: (name, why). ConfigError when the requested one cannot
    run here."""
    chosen = explicit_choice("model.swiglu_kernel", requested, cuda, triton_swiglu.available())
    if chosen is not None:
        return chosen
    fp64 = "the Triton kernels compute in fp32, not fp64" if dtype == torch.float64 else None
    return auto_choice(cuda, backend, triton_swiglu.available(), "the torch ops", fp64)


class SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * linear`` of ``x = [gate | linear]`` (megatron's chunk order),
    saving ``x`` alone."""

    @staticmethod
    def forward(ctx, x: Tensor, fused: bool = False) -> Tensor:
        ctx.save_for_backward(x)
        ctx.fused = fused
        if fused:  # one Triton pass (model.swiglu_kernel: triton)
            return triton_swiglu.forward(x)
        gate, linear = x.chunk(2, dim=-1)  # [s, b, f] each: views of fc1's output
        return F.silu(gate) * linear

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (x,) = ctx.saved_tensors
        if ctx.fused:
            return triton_swiglu.backward(x, grad), None
        gate, linear = x.chunk(2, dim=-1)
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dgate, dlinear = dx.chunk(2, dim=-1)
        # as autograd differentiates silu(gate) * linear: d linear = grad * silu(gate),
        # d gate = silu'(gate) applied to grad * linear; written straight into dx
        # (the chunk's backward would concatenate them)
        torch.mul(grad, F.silu(gate), out=dlinear)
        torch.ops.aten.silu_backward.grad_input(grad * linear, gate, grad_input=dgate)
        return dx, None


class SwiGLU(MegatronModule):
    """The MLP's activation module (``MLPSubmodules.activation_func``; no parameters)."""

    def __init__(self, config, kernel: str = "torch"):
        super().__init__(config)
        if kernel not in ("triton", "torch"):
            raise ValueError(f"SwiGLU's kernel is triton or torch (choose_swiglu), got {kernel!r}")
        self.fused = kernel == "triton"
        if config.activation_func_clamp_value is not None:
            raise ValueError("kvtrain's SwiGLU has no activation clamp "
                             "(activation_func_clamp_value)")
        if config.glu_linear_offset != 0.0:
            raise ValueError("kvtrain's SwiGLU has no linear offset (glu_linear_offset)")

    def forward(self, x: Tensor) -> Tensor:  # [s, b, 2f] -> [s, b, f]
        return SwiGLUFunction.apply(x, self.fused)


__all__ = ["SwiGLU", "SwiGLUFunction", "choose_swiglu"]
