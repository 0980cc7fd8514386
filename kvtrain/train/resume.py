"""Resuming a run: the first checkpoint of ``integrity.plan_resume`` that is
intact and loads, taken alike on every rank, and the other history set aside.

Every decision is collective: the verification (sizes on every rank, the
checksums split over the ranks) and a failed load are gathered, so all ranks
skip or take the same checkpoint. See ``integrity`` for the choice of
candidates and ``checkpoint`` for what a checkpoint holds.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from kvtrain.config import ConfigError, first_line, on_every_rank

from .checkpoint import Checkpointer, TrainState
from .integrity import (
    CheckpointError, ResumePlan, check_checkpoint, checkpoint_folders, iteration_of,
    set_aside, warn,
)
from .metrics import say


@dataclass
class Resumed:
    """What ``resume`` did: the checkpoint loaded (None: a fresh start), the
    state, its warnings, and whether it passed over anything (a bad ``latest``,
    a damaged checkpoint, another history set aside)."""

    path: Optional[Path] = None
    state: TrainState = field(default_factory=TrainState)
    notes: list[str] = field(default_factory=list)
    fell_back: bool = False

    def add(self, note: str) -> None:
        say(note)
        self.notes.append(note)


def resume(ckpt: Checkpointer, plan: ResumePlan, verify: str = "full",
           load_optimizer: bool = True, load_rng: bool = True) -> Resumed:
    """Loads the first candidate of ``plan`` that verifies and loads, and sets
    aside the checkpoints at or after it that were not loaded (collective).
    No candidate: a fresh start. A candidate that fails is skipped with one
    warning, or, for an explicit ``checkpoint.resume`` path, is an error; when
    every one fails the run stops with one line and nothing deleted."""
    resumed = Resumed(fell_back=bool(plan.warnings))
    for note in plan.warnings:
        resumed.add(note)
    for note in plan.notes:
        resumed.add(f"kvtrain: {note}")
    rejected = []
    for path in plan.candidates:
        problem, warning = _verify(ckpt, path, verify)
        if problem is None:
            # A load that fails half-way may leave some tensors overwritten: the
            # next candidate's load overwrites them all again (model, optimizer,
            # scheduler, RNG states), so nothing of the failed one survives.
            state, problem = _try_load(ckpt, path, load_optimizer, load_rng,
                                       own=not plan.explicit)
        if problem is not None:
            if plan.explicit:  # the ranks agreed on it (_verify, _try_load)
                raise on_every_rank(CheckpointError(f"checkpoint.resume: {problem}"))
            rejected.append(problem.replace(f"{path.parent}{os.sep}", ""))
            resumed.add(warn(f"skipping checkpoint {path.name}: {problem}"))
            continue
        if warning:
            resumed.add(warn(warning))
        if state.extra.get("carried_on"):
            resumed.add(f"kvtrain: {state.extra['carried_on']}")
        if plan.explicit:  # this history's first start: its checkpoints will say so
            state.started_from = str(path.resolve())
        resumed.path, resumed.state = path, state
        resumed.fell_back |= bool(rejected)
        _set_aside_after(ckpt, path, state.iteration, resumed)
        return resumed
    if rejected:
        raise on_every_rank(CheckpointError(
            f"no usable checkpoint in {plan.root}: {'; '.join(rejected)}; nothing was deleted: "
            "repair or remove them, or start in another run folder or checkpoint.dir"))
    return resumed


def _verify(ckpt: Checkpointer, path: Path, level: str) -> tuple[Optional[str], Optional[str]]:
    """(problem, warning) of ``path``, the same on every rank."""
    world = dist.get_world_size()
    check = check_checkpoint(path, level, part=(ckpt.rank, world))
    problems = [None] * world
    dist.all_gather_object(problems, check.problem)
    return next((p for p in problems if p), None), check.warning


def _try_load(ckpt: Checkpointer, path: Path, load_optimizer: bool, load_rng: bool,
              own: bool) -> tuple[Optional[TrainState], Optional[str]]:
    """(state, None), or (None, why) when megatron cannot load ``path`` on some rank."""
    state, error = None, None
    try:
        state = ckpt.load(path, load_optimizer, load_rng, own=own)
    except ConfigError:
        raise  # the checkpoint does not fit the run: an older one would not either
    except (Exception, CheckpointException) as e:  # torch's is a BaseException
        error = f"{path} could not be loaded: {first_line(e)}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    error = next((e for e in errors if e), None)
    return (None, error) if error else (state, None)


def _set_aside_after(ckpt: Checkpointer, loaded: Path, iteration: int, resumed: Resumed) -> None:
    """Rank 0 moves the checkpoints at or after ``iteration`` but ``loaded`` (a
    history that was not loaded) out of reach of keep_last and of new saves."""
    if ckpt.rank == 0:
        newer = [p for p in checkpoint_folders(ckpt.root)
                 if iteration_of(p) >= iteration and p.resolve() != loaded.resolve()]
        target = set_aside(ckpt.root, newer)
        if target is not None:
            resumed.fell_back = True
            resumed.add(warn(f"{', '.join(p.name for p in newer)} (not loaded: another "
                             f"history) set aside into {target}, not deleted"))
    dist.barrier()
