"""The points of a run where a caller may observe or steer it.

``train(cfg, run_dir, hooks=...)`` calls these at fixed points; the default
``RunHooks`` does nothing, and it is what ``kvtrain train`` uses. Fault drills
(tests/faults) pass a subclass that kills the process inside a save, makes a
step's loss non-finite or asks for a stop at a chosen step: faults enter a run
through an object the caller builds, never through switches that production
code reads from the environment.
"""

from __future__ import annotations

from pathlib import Path

import torch


class RunHooks:
    """No-op hooks: every method may be overridden, each is called on every rank."""

    def loss(self, iteration: int, loss_sum: torch.Tensor) -> torch.Tensor:
        """The summed loss of one micro batch of training step ``iteration``
        (1-based), before the backward pass; returns what the step uses."""
        return loss_sum

    def gradients(self, iteration: int, model: list) -> None:
        """The model chunks of training step ``iteration`` after the backward pass
        and the gradient reduction, before the update; may alter the gradients
        (``param.main_grad``), e.g. to make them non-finite with a finite loss."""

    def stop_requested(self, iteration: int) -> bool:
        """Whether step ``iteration`` carries a stop request, as if a SIGTERM had
        arrived during it (the run then saves and exits 0 like on a signal)."""
        return False

    def shards_written(self, work: Path, iteration: int) -> None:
        """Every rank's shards of ``iteration`` are on disk in ``work``; the
        checkpoint is not yet marked complete and ``latest`` has not moved."""

    def checkpoint_saved(self, path: Path, iteration: int) -> None:
        """The checkpoint of ``iteration`` is complete and ``latest`` names it."""


__all__ = ["RunHooks"]
