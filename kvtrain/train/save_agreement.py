"""Every rank stops together, with the same reason, when a save fails on one of them.

Finishing a checkpoint takes rank-local work (each rank checksums the shards it
wrote) and rank-0 work (the marker, the rename, ``latest``), each followed by a
collective. A rank that raised on its own would leave the others waiting in that
collective until the launcher tears the group down (NCCL: until its timeout) or,
over gloo, failing with "Connection closed by peer", while the reason stays in
one rank's log. Here the failing step's outcome is exchanged instead: every rank
raises :class:`SaveFailed` naming the failing ranks and their OS errors, and the
checkpointer turns it into the one line a user sees.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, TypeVar

import torch.distributed as dist

from .integrity import SaveFailed, save_failure_reason

T = TypeVar("T")


def _why(rank: int, error: BaseException, root: Path) -> str:
    return f"rank {rank}: {save_failure_reason(error, root)}"


def gather_or_fail(fn: Callable[[], T], root: Path) -> list[T]:
    """``fn()`` on every rank, gathered in rank order (collective); when it raised on
    any rank, every rank raises :class:`SaveFailed` with all their reasons."""
    rank = dist.get_rank()
    try:
        value, error = fn(), None
    except Exception as e:  # an OSError reading back the shards, say
        value, error = None, _why(rank, e, root)
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (value, error))
    errors = [err for _, err in parts if err]
    if errors:
        raise SaveFailed("; ".join(errors))
    return [v for v, _ in parts]


def on_rank0_or_fail(fn: Callable[[], None], root: Path) -> None:
    """``fn()`` on rank 0 (collective: every rank calls this); when it raised, every
    rank raises :class:`SaveFailed` with its reason."""
    error = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as e:  # a full disk writing the marker or latest, say
            error = _why(0, e, root)
    box = [error]
    dist.broadcast_object_list(box, src=0)
    if box[0]:
        raise SaveFailed(box[0])


__all__ = ["SaveFailed", "gather_or_fail", "on_rank0_or_fail"]
