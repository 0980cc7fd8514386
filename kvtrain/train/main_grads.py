"""The main gradients the optimizer step reads for the norm and the clipping, without
megatron's per-parameter Python.

Every step megatron's optimizer filters its parameters for the gradient norm in
Python (``get_main_grads_for_grad_norm``: per parameter whether it has a gradient,
is shared - a tied embedding's copy - or a tensor-parallel duplicate; four calls and
their context managers each), and ``clip_grad_by_total_norm_fp32`` walks them again
(per gradient an assert on its type, a DTensor check and a ``detach``), whether it
clips or not. That is host work per parameter *tensor*, which a launch-bound GPU
step pays as the CPU does, and every extra tensor - each layer's two KV-shift
coefficient tensors - pays again (``benchmarks/host_work.py``: ~24 Python calls and
a ``detach`` per tensor and step).

Which parameters are shared or duplicates does not change during a run, so
:func:`install` works the filter out once per optimizer (again if its parameter
lists change) and a step reads each parameter's ``.grad`` in one list comprehension:
megatron may hand a main parameter a new gradient tensor any step. The norm is
``get_grad_norm_fp32``'s L2 path (the multi-tensor norm, its square summed over the
group, the root) over the same tensors in the same order, less its per-gradient
DTensor checks, and the clipping megatron's multi-tensor scale with megatron's
coefficient: the values are megatron's bit for bit. It applies where the gradients
are plain ``.grad`` tensors (no FSDP's DTensors, no precision-aware optimizer's
``decoupled_grad``) and the norm is megatron's own; any other optimizer keeps
megatron's code.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


class MainGrads:
    """The parameters of one megatron optimizer whose gradients the step reads."""

    def __init__(self, opt) -> None:
        self.opt = opt
        self._key: Optional[tuple] = None
        self._all: list[Tensor] = []  # every parameter: what clipping scales
        self._norm: list[Tensor] = []  # not shared, not a TP duplicate: what the norm sums

    def _params(self) -> tuple[list[Tensor], list[Tensor]]:
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
        from megatron.core.transformer.module import param_is_not_shared

        groups = self.opt.optimizer.param_groups
        # a load_state_dict keeps the lists; a new list or length is worked out again
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key != self._key:
            tp_group = getattr(self.opt, "tp_group", None)
            self._all = [p for g in groups for p in g["params"]]
            self._norm = [p for p in self._all if param_is_not_shared(p)
                          and param_is_not_tensor_parallel_duplicate(p, tp_group)]
            self._key = key
        return self._all, self._norm

    def for_norm(self) -> list[Tensor]:
        """megatron's ``get_main_grads_for_grad_norm``: the same tensors, same order."""
        return [p.grad for p in self._params()[1] if p.grad is not None]

    def norm(self) -> float:
        """megatron's ``get_grad_norm``: ``get_grad_norm_fp32`` (L2) of :meth:`for_norm`,
        reduced over the optimizer's group for gradient statistics, without its
        per-gradient DTensor checks (no DTensors here: :func:`applies`)."""
        from megatron.core.optimizer import clip_grads

        grads = self.for_norm()
        if grads:
            noop = torch.zeros(1, dtype=torch.int, device=grads[0].device)
            grad_norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, noop,
                                                           [grads], False)
        else:
            grad_norm = torch.zeros(1, dtype=torch.float, device=_device())
        total = grad_norm ** 2.0  # summed over the group as squares, as megatron does
        torch.distributed.all_reduce(total, op=torch.distributed.ReduceOp.SUM,
                                     group=self.opt.get_grad_stats_parallel_group())
        return total.item() ** 0.5

    def clip(self, max_norm: float, total_norm: float) -> None:
        """megatron's ``clip_grad_by_total_norm_fp32``: every gradient scaled in place
        by ``max_norm / (total_norm + 1e-6)`` where that is below 1."""
        from megatron.core.optimizer import clip_grads

        if not clips(max_norm, total_norm):
            return
        clip_coeff = max_norm / (total_norm + 1.0e-6)
        grads = [p.grad for p in self._params()[0] if p.grad is not None]
        if grads:
            noop = torch.zeros(1, dtype=torch.int, device=grads[0].device)
            clip_grads.multi_tensor_applier(clip_grads.multi_tensor_scale_impl, noop,
                                            [grads, grads], clip_coeff)


def clips(max_norm: float, total_norm: float) -> bool:
    """Whether megatron's clipping by ``max_norm`` scales gradients of ``total_norm``
    (a pass over every gradient: ``clip_grad_by_total_norm_fp32``'s rule)."""
    return max_norm > 0 and max_norm / (total_norm + 1.0e-6) < 1.0


def _device() -> torch.device:
    """Where megatron puts a rank's empty norm (its ``device='cuda'``; the CPU here)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def applies(opt) -> bool:
    """Whether ``opt`` (one of megatron's optimizers, not a chain) has plain gradients
    and megatron's own norm (not a subclass's)."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    if getattr(opt, "is_stub_optimizer", False) or not hasattr(opt, "optimizer"):
        return False
    kind = type(opt)
    if (kind.get_grad_norm is not MegatronOptimizer.get_grad_norm
            or kind.get_main_grads_for_grad_norm
            is not MegatronOptimizer.get_main_grads_for_grad_norm):
        return False
    if not hasattr(opt.optimizer, "param_groups"):
        return False
    if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
        return False
    return not any(getattr(p, "__fsdp_param__", False)
                   for g in opt.optimizer.param_groups for p in g["params"])


def install(optimizer) -> int:
    """Puts :class:`MainGrads` in the place of megatron's filter for the norm and its
    norm in every optimizer of ``optimizer`` (chained or single) where it
    :func:`applies`; how many."""
    plain = [opt for opt in getattr(optimizer, "chained_optimizers", [optimizer])
             if applies(opt)]
    for opt in plain:
        grads = MainGrads(opt)
        opt.get_main_grads_for_grad_norm, opt.get_grad_norm = grads.for_norm, grads.norm
    return len(plain)


def installed(opt) -> Optional[MainGrads]:
    """``opt``'s :class:`MainGrads` where :func:`install` put it (held by the optimizer
    through its methods alone: a registry beside it would keep every run alive)."""
    grads = getattr(opt.get_grad_norm, "__self__", None)
    return grads if isinstance(grads, MainGrads) else None


def clip(opt, max_norm: float, total_norm: float) -> None:
    """Clips ``opt``'s gradients by the total norm: :meth:`MainGrads.clip` where
    installed, megatron's ``clip_grad_by_total_norm_fp32`` otherwise."""
    grads = installed(opt)
    if grads is not None:
        grads.clip(max_norm, total_norm)
        return
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    params = opt.get_parameters()
    if params:
        clip_grad_by_total_norm_fp32(
            params, max_norm=max_norm, total_norm=total_norm,
            use_decoupled_grad=opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


__all__ = ["MainGrads", "applies", "clip", "clips", "install", "installed"]
