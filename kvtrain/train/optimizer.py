"""AdamW (megatron's distributed optimizer; torch's fused kernel where megatron
falls back to torch's AdamW), the LR schedule, and one guarded optimizer step.

Weight decay: megatron's default param-group rule takes decay off 1-D
parameters (norm weights) and biases. The KV-shift coefficients are 2-D
(``[kv_heads_local, w+1]``) and would be decayed by that rule, pulling α and β
towards zero; they join the no-decay group unless ``model.kv_shift.weight_decay``
is true. The per-group ``wd_mult`` is applied by ``OptimizerParamScheduler.step``
(megatron applies wd_mult only there: without a scheduler every group decays), and a scheduler is
always built here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype

try:  # torch's own rule for fused optimizers (torch >= 2.4; private, so guarded)
    from torch.optim.optimizer import _device_dtype_check_for_fused
except ImportError:  # pragma: no cover - depends on the torch version
    _device_dtype_check_for_fused = None

from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.grad_scaler import DynamicGradScaler
from megatron.core.optimizer.optimizer_config import ParamKey, ParamPredicate
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, ParamGroupOverride

from kvtrain.config.schema import RunConfig
from kvtrain.model.builder import Numerics
from kvtrain.model.kv_shift import is_kv_shift_param

from . import main_grads, shard_copies


def no_weight_decay_overrides(decay_kv_shift: bool) -> dict[ParamKey, ParamGroupOverride]:
    """Param-group overrides: ``wd_mult=0`` for norms (1-D), biases and, unless
    ``decay_kv_shift``, the KV-shift coefficients."""
    predicates = [ParamPredicate(name="one_dim", fn=lambda p: p.dim() == 1)]
    if not decay_kv_shift:
        predicates.append(ParamPredicate(name="kv_shift_coefficients", fn=is_kv_shift_param))
    key = ParamKey(name="*.bias", predicate=tuple(predicates))
    return {key: ParamGroupOverride(wd_mult=0.0)}


def megatron_optimizer_config(cfg: RunConfig, numerics: Numerics) -> MegatronOptimizerConfig:
    o, p = cfg.optimizer, cfg.parallel
    return MegatronOptimizerConfig(
        optimizer="adam",  # with decoupled_weight_decay (default): AdamW
        lr=o.lr,
        min_lr=resolved_min_lr(cfg),
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        bf16=numerics.bf16,
        fp16=numerics.fp16,
        params_dtype=numerics.params_dtype,
        loss_scale=o.loss_scale,
        use_distributed_optimizer=p.distributed_optimizer,
        overlap_param_gather=p.overlap_param_gather,
    )


def build_optimizer(cfg: RunConfig, numerics: Numerics, model_chunks: list) -> tuple[Any, str]:
    """megatron's (distributed) AdamW over the DDP-wrapped ``model_chunks``, and what
    computes its update (:func:`use_fused_adamw`)."""
    optimizer = get_megatron_optimizer(
        megatron_optimizer_config(cfg, numerics),
        model_chunks,
        config_overrides=no_weight_decay_overrides(cfg.model.kv_shift.weight_decay),
    )
    shard_copies.install(optimizer)  # megatron's per-parameter Python loops, batched
    main_grads.install(optimizer)  # and those of the gradient norm and the clipping
    return optimizer, use_fused_adamw(optimizer)


FUSED = "torch fused AdamW (kvtrain)"
FOREACH = "torch foreach AdamW (kvtrain)"


def use_fused_adamw(optimizer) -> str:
    """Puts megatron's fallback (torch's AdamW, without TE or apex) on torch's fused
    kernel; returns what computes the update.

    torch picks its ``foreach`` path by default on a GPU: eight multi-tensor kernels
    over the fp32 main params and moments per step, the ``step`` counters read on the
    host per tensor (kvtrain forced the same path on the CPU, where torch's default
    is a Python loop over parameters). ``fused`` is one kernel, one pass, on the GPU
    and on the CPU (3x faster there at the demo shape, ``docs/performance.md``,
    ``benchmarks/optimizer_step.py``). Where torch's own check
    (``_device_dtype_check_for_fused``, what ``Adam._init_group`` runs) refuses a
    parameter, every group takes the foreach path and the reason is returned.
    TE's and apex's FusedAdam are left as megatron built them. megatron's build
    creates no state (AdamW makes it at the first step, megatron's dummy step and
    ``init_state_fn`` run only for a load); a step that exists already is moved
    where the chosen kernel reads it.
    """
    inners = inner_optimizers(optimizer)
    theirs = [adam_kernel(type(inner)) for inner in inners if not torch_adam(type(inner))]
    if theirs or not inners:
        return ", ".join(dict.fromkeys(theirs)) or adam_kernel(megatron_adam_class())
    why = fused_refusal([group for inner in inners for group in inner.param_groups])
    for inner in inners:
        for group in inner.param_groups:
            group["fused"], group["foreach"] = why is None, why is not None
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if step is not None:
                    inner.state[p]["step"] = adam_step(group, p, float(step), step.dtype)
    return FUSED if why is None else f"{FOREACH}: {why}"


def fused_refusal(groups: list[dict]) -> Optional[str]:
    """Why torch's fused AdamW would refuse these param groups (None: it takes them),
    by torch's own rules: no ``differentiable`` groups (``Adam.__init__``), floating
    point parameters on a device with fused kernels (``_device_dtype_check_for_fused``)."""
    if _device_dtype_check_for_fused is None:
        return "this torch has no fused AdamW check (torch < 2.4)"
    for group in groups:
        if group.get("differentiable"):
            return "`fused` does not support `differentiable`"
        for p in group["params"]:
            try:
                _device_dtype_check_for_fused(p)
            except RuntimeError as e:
                return str(e)
    return None


def adam_step(group: dict, param: Tensor, value: float,
              dtype: Optional[torch.dtype] = None) -> Tensor:
    """A step tensor for ``param`` of ``group`` holding ``value``, where torch's Adam
    keeps it (note [special device hosting for step], ``torch/optim/adam.py``): on the
    parameter's device in fp32 for fused and capturable groups, whose kernels read it
    there (a CPU step fails a fused step on a GPU); a CPU scalar otherwise."""
    if group.get("fused") or group.get("capturable"):
        return torch.tensor(value, dtype=torch.float32, device=param.device)
    return torch.tensor(value, dtype=dtype or _get_scalar_dtype(), device="cpu")


# What a checkpoint's param group owns: its parameters and, for TE's/apex's
# FusedAdam, the update count ("step"); every other key the run built from its config.
CHECKPOINT_GROUP_KEYS = ("params", "step")


@contextmanager
def run_param_groups_kept(optimizer):
    """Keeps the run's param-group values through a checkpoint load: torch's
    ``load_state_dict`` replaces every param group by the checkpoint's, so the
    checkpoint's ``max_lr``/``min_lr`` (what the scheduler reads), ``betas``, ``eps``,
    ``wd_mult``/``lr_mult`` and ``fused``/``foreach`` flags would set this run's
    config aside (a resume with a new lr would go on at the old one, and a checkpoint
    of a foreach run would undo :func:`use_fused_adamw`). The config wins; the
    scheduler's state, loaded after this, then sets ``lr``/``weight_decay`` from them."""
    inners = inner_optimizers(optimizer)
    kept = [[{k: v for k, v in g.items() if k not in CHECKPOINT_GROUP_KEYS}
             for g in inner.param_groups] for inner in inners]
    try:
        yield
    finally:
        for inner, groups in zip(inners, kept):
            for group, own in zip(inner.param_groups, groups):
                group.update(own)


def adam_kernel(cls: type) -> str:
    """What computes the update of an optimizer class megatron built: :data:`FUSED`
    for torch's Adam/AdamW, else its package and name (``transformer_engine FusedAdam``,
    ``apex FusedAdam``)."""
    if torch_adam(cls):
        return FUSED
    return f"{cls.__module__.split('.')[0]} {cls.__name__}"


def torch_adam(cls: type) -> bool:
    """torch's Adam or AdamW (AdamW derives from Adam only since torch 2.7)."""
    return issubclass(cls, (torch.optim.Adam, torch.optim.AdamW))


def megatron_adam_class() -> type:
    """The Adam class megatron-core builds here: TE's or apex's FusedAdam where one
    imports, else torch's AdamW (``USING_PYTORCH_OPTIMIZER``)."""
    from megatron.core import optimizer

    return torch.optim.AdamW if optimizer.USING_PYTORCH_OPTIMIZER else optimizer.Adam


def resolved_min_lr(cfg: RunConfig) -> float:
    o = cfg.optimizer
    if o.min_lr is not None:
        return o.min_lr
    return o.lr if o.lr_schedule == "constant" else 0.1 * o.lr


def build_scheduler(cfg: RunConfig, optimizer, total_steps: int) -> OptimizerParamScheduler:
    """Linear warmup from 0, then constant (the paper), cosine, or warmup-stable-decay.

    The scheduler counts successful optimizer updates; the trainer steps it
    just before each update, so update ``k`` (1-based) runs at ``lr(k)`` and
    warmup reaches the peak at update ``lr_warmup_steps``. Values from the
    config win over those in a checkpoint (only the step count is restored), so
    a resumed run can extend or change its schedule.
    """
    o = cfg.optimizer
    warmup = o.lr_warmup_steps
    decay_steps = lr_horizon(cfg, total_steps)
    style = {"constant": "constant", "cosine": "cosine", "wsd": "WSD"}[o.lr_schedule]
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup > 0 else o.lr,
        max_lr=o.lr,
        min_lr=resolved_min_lr(cfg),
        lr_warmup_steps=warmup,
        lr_decay_steps=decay_steps,
        lr_decay_style=style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=decay_steps,
        wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
        wsd_decay_steps=o.wsd_decay_steps,
        lr_wsd_decay_style=o.wsd_decay_style,
    )


def lr_horizon(cfg: RunConfig, total_steps: int) -> int:
    """The steps over which the LR decays: ``optimizer.lr_decay_steps``, else the run's."""
    o = cfg.optimizer
    return max(o.lr_decay_steps or total_steps, o.lr_warmup_steps + 1)


def set_horizon(scheduler: OptimizerParamScheduler, cfg: RunConfig, total_steps: int) -> None:
    """Moves the schedule's end to ``total_steps`` (a resumed run whose length
    changed with its global batch: ``setup.fit_token_budget``)."""
    scheduler.lr_decay_steps = scheduler.wd_incr_steps = lr_horizon(cfg, total_steps)


def schedule_moved(scheduler: OptimizerParamScheduler, saved: Optional[dict]) -> Optional[str]:
    """What a resume changed in a decaying LR schedule's end (``saved``: the
    checkpoint's scheduler state), or None: the run's horizon replaces the
    checkpoint's without a word in megatron (``override_opt_param_scheduler``), so
    a cosine run of 10 steps extended to 20 jumped from 2e-4 back to 1.5e-3."""
    old = (saved or {}).get("lr_decay_steps")
    if scheduler.lr_decay_style == "constant" or not isinstance(old, int) \
            or old == scheduler.lr_decay_steps:
        return None
    new, step = scheduler.lr_decay_steps, scheduler.num_steps + 1  # the next update's
    group = next(g for g in scheduler.optimizer.param_groups if g.get("default_config", True))
    rates = []
    for horizon in (new, old):
        scheduler.lr_decay_steps, scheduler.num_steps = horizon, step
        rates.append(scheduler.get_lr(group))
    scheduler.lr_decay_steps, scheduler.num_steps = new, step - 1
    return (f"the {scheduler.lr_decay_style} learning-rate schedule now decays until update "
            f"{new}, the checkpoint's until {old} (the run's length changed): the next "
            f"update's learning rate is {rates[0]:.3g}, where the checkpoint's schedule gave "
            f"{rates[1]:.3g}; optimizer.lr_decay_steps: {old} keeps its schedule")


def current_lr(optimizer) -> float:
    """The LR of the default param groups (all groups share one schedule here)."""
    for group in optimizer.param_groups:
        if group.get("default_config", True):
            return float(group["lr"])
    return float(optimizer.param_groups[0]["lr"]) if optimizer.param_groups else 0.0


@dataclass
class StepOutcome:
    """What happened to one optimizer step."""

    updated: bool
    grad_norm: Optional[float]
    # None: the update was applied. "overflow": fp16 loss-scale overflow (the
    # dynamic scaler backs off; normal while it calibrates). "nonfinite": the
    # loss or the gradient norm was inf/NaN (a constant loss scale's overflow
    # too: it never backs off): the update was dropped.
    skipped: Optional[str] = None


def _dynamic_loss_scale(optimizer) -> bool:
    """fp16's loss scale adapts (megatron's ``DynamicGradScaler``): a constant one
    (``optimizer.loss_scale``) overflows again every step, a non-finite gradient."""
    return any(isinstance(getattr(opt, "grad_scaler", None), DynamicGradScaler)
               for opt in getattr(optimizer, "chained_optimizers", [optimizer]))


@torch.no_grad()
def guarded_step(optimizer, scheduler: OptimizerParamScheduler, loss_is_finite: bool) -> StepOutcome:
    """megatron's ``ChainedOptimizer.step`` with a finite check before the update.

    For fp32/bf16 there is no grad scaler, so megatron would apply an update
    with NaN gradients; here the gradient norm (already reduced over every
    rank, hence the same on all of them) and the globally reduced loss decide,
    and a non-finite step leaves weights, optimizer state and the schedule
    untouched. The gradients are zeroed at the start of the next step.
    """
    found_inf = optimizer.prepare_grads()  # model grads -> main grads; fp16: unscale + inf check
    if found_inf:  # an overflow only a dynamic loss scale recovers from (it backs off)
        recovers = loss_is_finite and _dynamic_loss_scale(optimizer)
        return StepOutcome(False, None, "overflow" if recovers else "nonfinite")
    grad_norm = float(optimizer.get_grad_norm())
    if not (loss_is_finite and math.isfinite(grad_norm)):
        return StepOutcome(False, grad_norm, "nonfinite")
    scheduler.step(increment=1)  # sets this update's lr and weight decay per group
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        if getattr(opt, "is_stub_optimizer", False) or opt.config.clip_grad <= 0:
            continue
        main_grads.clip(opt, opt.config.clip_grad, grad_norm)
    updated = optimizer.step_with_ready_grads()
    return StepOutcome(bool(updated), grad_norm, None)


def inner_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside megatron's wrappers (for state surgery)."""
    out = []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if inner is not None:
            out.append(inner)
    return out


def fresh_adam_state(optimizer) -> None:
    """torch's AdamW state where no update has made it yet: zero moments at step 0, as
    its first update creates them (lazily). Every step so far was skipped (fp16's loss
    scale backing off from 2**32 skips tens; NaN losses), yet a checkpoint is due:
    megatron's distributed optimizer asserts one step count in the state it saves and
    finds none. With this state saved, the resumed run is the one that went on."""
    for inner in inner_optimizers(optimizer):
        if len(inner.state) > 0 or not isinstance(inner, torch.optim.Adam):
            continue  # TE's/apex's FusedAdam keep their step in the groups
        for group in inner.param_groups:
            for p in group["params"]:
                moments = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group.get("amsgrad")
                                                       else [])
                inner.state[p] = {"step": adam_step(group, p, 0.0), **{
                    k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in moments}}


def zero_steps_restored(loaded) -> None:
    """A loaded optimizer state dict whose AdamW has made no update yet (saved with
    :func:`fresh_adam_state`): megatron's non-distributed optimizers save the common
    step only ``if step:`` (not 0), and torch's ``load_state_dict`` then fails on the
    states without one (``KeyError: 'step'``). Gives them the 0 back, in place."""
    if not isinstance(loaded, dict):
        return
    state = loaded.get("state")
    if isinstance(state, dict) and "param_groups" in loaded and "common_step" not in state:
        per_param = [v for v in state.values() if isinstance(v, dict)]
        if per_param and all("step" not in v and "exp_avg" in v for v in per_param):
            state["common_step"] = torch.tensor(0.0)  # megatron's restore copies it per param
    for value in loaded.values():
        zero_steps_restored(value)


def adam_steps(optimizer) -> list[float]:
    """The per-parameter AdamW step counts (tests: all equal the update count)."""
    steps = []
    for inner in inner_optimizers(optimizer):
        for state in inner.state.values():
            if "step" in state:
                step = state["step"]
                steps.append(float(step.item() if torch.is_tensor(step) else step))
    return steps
