"""The plan of a run on a cluster: layout checks, batch arithmetic, memory, FLOPs.

``make_plan(cfg, nodes, gpus_per_node, gpu, mfu)`` derives the data-parallel
size from the GPU count, checks that the layout can work and raises
``PlanError`` (one line) when it cannot: the GPU count does not divide into
TP × PP × CP, the global batch does not divide into micro batches × DP, the
config or the assumed backend refuses it (as the trainer would at start), or the
estimated memory of the busiest GPU is above the card. Things that work but cost
speed, or train otherwise than asked (a warmup longer than the run), are
``warnings``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvtrain.config import ConfigError, RunConfig
from kvtrain.config.backend import (BackendChoice, check_document_masks, check_te_mla,
                                    check_te_precision)
from kvtrain.config.checks import setting_warnings
from kvtrain.config.layout import derive_layout

from .flops import GPU, GPUS, StepFlops, step_flops, step_seconds
from .memory import GiB, MemoryEstimate, attention_backend, estimate_memory
from .params import ParamCounts, count_params

WARN_MEMORY_FRACTION = 0.9


class PlanError(ValueError):
    """The layout cannot work; the message is one line."""


@dataclass
class Plan:
    cfg: RunConfig
    gpu: GPU
    nodes: int
    gpus_per_node: int
    mfu: float
    dp: int
    num_microbatches: int
    params: ParamCounts  # whole model (vocabulary padded for this TP)
    memory: MemoryEstimate
    flops: StepFlops
    steps: int
    steps_from: str
    warnings: list[str] = field(default_factory=list)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch_size * self.cfg.train.seq_length

    @property
    def peak(self) -> tuple[float, str]:
        """The card's peak TFLOP/s at this run's precision on the assumed backend."""
        return self.gpu.peak(self.cfg.train.precision, self.memory.attention)

    @property
    def step_seconds(self) -> float:
        return step_seconds(self.flops, self.world, self.peak[0], self.mfu)

    @property
    def total_seconds(self) -> float:
        return self.steps * self.step_seconds

    @property
    def evaluations(self) -> int:
        """Validations the run takes: every train.eval_interval steps, and one at its
        end where no interval falls on the last step (the trainer's wrap-up)."""
        interval = self.cfg.train.eval_interval
        if not interval:
            return 0
        return self.steps // interval + (1 if self.steps % interval else 0)

    @property
    def eval_seconds(self) -> float:
        """Seconds of the validations' forward-only passes at the run's MFU: each reads
        train.eval_iters global batches of the run's validation and of every named
        set (data.valid_sets)."""
        t = self.cfg.train
        batches = self.evaluations * t.eval_iters * (1 + len(self.cfg.data.valid_sets))
        forward = self.flops.sequences * self.flops.per_sequence.forward  # one global batch
        return batches * forward / (self.world * self.peak[0] * 1e12 * self.mfu)

    @property
    def total_tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.gpu.memory_gib * GiB


def make_plan(cfg: RunConfig, nodes: int = 1, gpus_per_node: int = 8, gpu: str = "a100",
              mfu: float = 0.4) -> Plan:
    """Checks ``cfg`` on ``nodes × gpus_per_node`` GPUs of kind ``gpu`` (a key of GPUS)."""
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"--nodes ({nodes}) and --gpus-per-node ({gpus_per_node}) must be >= 1")
    if not 0 < mfu <= 1:
        raise PlanError(f"--mfu must be in (0, 1], got {mfu}")
    if gpu not in GPUS:
        raise PlanError(f"unknown GPU {gpu!r}; one of {', '.join(GPUS)}")
    card = GPUS[gpu]
    m, p, t = cfg.model, cfg.parallel, cfg.train
    _check_config(cfg)  # what no layout can fix (CP > 1), before the layout's arithmetic
    world = nodes * gpus_per_node
    try:  # the trainer's own rule for DP, micro batches and steps (config/layout.py)
        layout = derive_layout(cfg, world, world=f"{world} GPUs ({nodes} nodes x {gpus_per_node})")
        cfg.validate(world_size=world)
    except ConfigError as e:
        raise PlanError(str(e)) from None
    dp, num_microbatches = layout.data_parallel, layout.num_microbatches

    warnings = []
    if p.tensor > gpus_per_node:
        warnings.append(f"TP {p.tensor} spans nodes ({gpus_per_node} GPUs per node): "
                        "tensor-parallel all-reduces would cross the network")
    elif gpus_per_node % p.tensor:
        warnings.append(f"TP {p.tensor} does not divide the {gpus_per_node} GPUs of a node: "
                        "some TP groups span two nodes")
    if p.pipeline > 1 and num_microbatches < p.pipeline:
        warnings.append(f"{num_microbatches} micro batches per step for PP {p.pipeline}: "
                        "the pipeline bubble dominates (want micro batches >= 4 x PP)")
    if t.precision == "fp32":
        fp32, kind = card.peak("fp32", attention_backend(m))
        warnings.append(f"train.precision fp32 on GPU ({kind} matmuls): bf16 is the paper's "
                        f"setting and its peak is {card.peak_tflops / fp32:.0f}x higher")
    if cfg.data.reset_attention_mask and attention_backend(m) == "local":
        warnings.append("data.reset_attention_mask on the local backend: refused at start where "
                        "apex's fused softmax is installed (NVIDIA's container) and 16 < "
                        "train.seq_length <= 4096, since its kernel ignores the mask")

    warnings += setting_warnings(cfg, layout.total_steps)

    memory = estimate_memory(m, p, t, dp, num_microbatches)
    flops = step_flops(m, t.seq_length, t.global_batch_size, p.tensor, p.recompute)
    steps, steps_from = layout.total_steps, layout.steps_from
    plan = Plan(
        cfg=cfg, gpu=card, nodes=nodes, gpus_per_node=gpus_per_node, mfu=mfu, dp=dp,
        num_microbatches=num_microbatches, params=count_params(m, p.tensor), memory=memory,
        flops=flops, steps=steps, steps_from=steps_from, warnings=warnings,
    )
    capacity = card.memory_gib * GiB
    if memory.total > capacity:
        raise PlanError(
            f"estimated {memory.total / GiB:.1f} GiB per GPU (stage {memory.stage}: states "
            f"{memory.states / GiB:.1f}, activations {memory.activations / GiB:.1f}) exceeds the "
            f"{card.memory_gib:.0f} GiB of each {card.name}; {_suggest(plan)}"
        )
    if memory.total > WARN_MEMORY_FRACTION * capacity:
        warnings.append(f"estimated memory is {memory.total / capacity:.0%} of the card: "
                        "little headroom for fragmentation")
    return plan


def _check_config(cfg: RunConfig) -> None:
    """The config's own checks, and the backend refusals for the assumed backend."""
    try:
        cfg.validate()
        assumed = attention_backend(cfg.model)
        why = "model.backend auto, planned as te" if cfg.model.backend == "auto" else \
            f"model.backend {cfg.model.backend}"
        # the GPU-side answer: unknown apex kernels count as absent (a warning says so)
        choice = BackendChoice(assumed, cfg.model.backend, why, False)
        check_document_masks(cfg, choice, half=cfg.train.precision != "fp32")
        check_te_precision(cfg, choice, half=cfg.train.precision != "fp32")
        check_te_mla(cfg, choice)
    except ConfigError as e:
        raise PlanError(str(e)) from None


def _suggest(plan: Plan) -> str:
    capacity = plan.gpu.memory_gib * GiB
    p = plan.cfg.parallel
    alt = plan.memory.alternatives
    if p.recompute != "full" and alt.get("recompute full", math.inf) <= capacity:
        return f"parallel.recompute=full would need {alt['recompute full'] / GiB:.1f} GiB"
    if not p.distributed_optimizer and alt.get("distributed optimizer on", math.inf) <= capacity:
        return (f"parallel.distributed_optimizer=true would need "
                f"{alt['distributed optimizer on'] / GiB:.1f} GiB")
    return ("raise parallel.tensor (with sequence_parallel) or parallel.pipeline, "
            "or lower train.micro_batch_size")

