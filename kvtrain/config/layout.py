"""The derived layout of a run: one pure function of (config, world size).

Everything a run derives from its config and its process count lives here, so
that ``RunConfig.validate``, the trainer (``kvtrain/train/setup.py``) and the
planner (``kvtrain/plan``) can never disagree: the data-parallel size, the
micro batches per step, the total steps, the padded vocabulary and the number
of KV-shift coefficients per KV head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .loader import ConfigError

if TYPE_CHECKING:
    from .schema import KVShiftConfig, ModelConfig, RunConfig


@dataclass(frozen=True)
class Layout:
    world_size: int
    tensor: int
    pipeline: int
    context: int
    data_parallel: int
    num_microbatches: int  # per optimizer step and data-parallel rank
    total_steps: int
    steps_from: str  # the key that set total_steps: train.max_steps | train.train_tokens
    padded_vocab_size: int
    shift_coefficients: int  # learnable KV-shift scalars per KV head (0: vanilla)

    @property
    def model_parallel(self) -> int:
        return self.tensor * self.pipeline * self.context


def coefficients_per_tensor(ks: "KVShiftConfig") -> int:
    """Scalars per KV head for one shifted tensor: w+1 (free, clamp), w (gate)."""
    return ks.window if ks.mode == "gate" else ks.window + 1


def shift_coefficients(model: "ModelConfig") -> int:
    """Learnable KV-shift scalars per KV head (4 for the paper's K and V, window 1)."""
    if model.attention != "kv_shift" or model.kv_shift.fixed:
        return 0
    return coefficients_per_tensor(model.kv_shift) * len(model.kv_shift.shift)


def padded_vocab_size(model: "ModelConfig", tensor_parallel: int = 1) -> int:
    """The vocabulary padded to a multiple of ``make_vocab_size_divisible_by * TP``
    (megatron's rule: every TP rank holds an equal, aligned slice)."""
    multiple = model.make_vocab_size_divisible_by * tensor_parallel
    return -(-model.vocab_size // multiple) * multiple


def total_steps(cfg: "RunConfig", iteration: int = 0,
                consumed_tokens: int = 0) -> tuple[int, str]:
    """Optimizer steps of the run and the key that set them: ``max_steps``, or the
    steps that cover ``train_tokens``, whichever comes first. A resumed run passes
    its checkpoint's ``iteration`` and the tokens it consumed, as counted step by
    step (steps before may have had another global batch or sequence length:
    ``train.loop.count_tokens_from``); the steps left are of the current ones."""
    t = cfg.train
    by_tokens = None
    if t.train_tokens:
        left = max(t.train_tokens - consumed_tokens, 0)
        by_tokens = iteration + math.ceil(left / (t.global_batch_size * t.seq_length))
    if by_tokens is not None and (t.max_steps is None or by_tokens <= t.max_steps):
        return by_tokens, "train.train_tokens"
    if t.max_steps is None:
        raise ConfigError("set train.max_steps or train.train_tokens")
    return t.max_steps, "train.max_steps"


def derive_layout(cfg: "RunConfig", world_size: int, world: str = "") -> Layout:
    """The layout of ``cfg`` on ``world_size`` processes; one ``ConfigError`` line
    when it cannot work. ``world`` describes the processes in messages (the
    planner says "16 GPUs (2 nodes x 8)"; default "world size N")."""
    p, t = cfg.parallel, cfg.train
    verb = "do" if world else "does"
    world = world or f"world size {world_size}"
    model_parallel = p.tensor * p.pipeline * p.context
    if world_size < 1 or world_size % model_parallel:
        raise ConfigError(f"{world} {verb} not divide into TP {p.tensor} x PP {p.pipeline} x "
                          f"CP {p.context} = {model_parallel} (parallel.tensor x pipeline x "
                          f"context)")
    dp = world_size // model_parallel
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(
            f"{world} gives DP {dp}: train.global_batch_size {t.global_batch_size} is not a "
            f"multiple of train.micro_batch_size {t.micro_batch_size} x DP {dp}")
    microbatches = t.global_batch_size // (t.micro_batch_size * dp)
    if p.virtual_pipeline is not None and microbatches % p.pipeline:
        raise ConfigError(
            f"the interleaved schedule needs the micro batches per step ({microbatches} = "
            f"train.global_batch_size / (train.micro_batch_size x DP {dp})) to be a "
            f"multiple of parallel.pipeline ({p.pipeline})")
    steps, steps_from = total_steps(cfg)
    return Layout(world_size=world_size, tensor=p.tensor, pipeline=p.pipeline, context=p.context,
                  data_parallel=dp, num_microbatches=microbatches, total_steps=steps,
                  steps_from=steps_from, padded_vocab_size=padded_vocab_size(cfg.model, p.tensor),
                  shift_coefficients=shift_coefficients(cfg.model))


__all__ = ["Layout", "coefficients_per_tensor", "derive_layout", "padded_vocab_size",
           "shift_coefficients", "total_steps"]
