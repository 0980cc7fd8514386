"""The processes of a rank die with the process that launched them.

``kill -9`` of torchrun (or of its node's job step) used to leave both ranks
training as orphans, with their checkpoint writers, loader workers and
wandb-core, racing the rerun in the same run folder. Now:

* a rank started by a launcher (torchrun, or anything that sets ``WORLD_SIZE``
  / ``LOCAL_RANK``) dies with it (``data_tools.lifeline``). A rank started by
  hand (``kvtrain train`` from a shell) is not tied to its shell, so that
  ``nohup kvtrain train ... &`` outlives the terminal;
* every process a rank forks from its main thread - megatron's asynchronous
  checkpoint writer and that writer's own workers, DataLoader workers - dies
  with the rank (``os.register_at_fork``; the kernel setting is cleared on
  fork, so each generation asks again). A fork from another thread is left
  alone: the kernel would kill the child when *that thread* ends;
* the writer's spawn-context queue manager asks the same in its initializer
  (``writer_queue``), and wandb-core watches the pid it is given (``--pid``).
"""

from __future__ import annotations

import os
import threading

from data_tools.lifeline import die_with_parent

_LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_RANK")
_bound = False
_fork_parent: dict[str, int] = {}


def _before_fork() -> None:
    main = threading.current_thread() is threading.main_thread()
    _fork_parent["pid"] = os.getpid() if main else 0


def _in_child() -> None:
    parent = _fork_parent.get("pid", 0)
    if parent:
        die_with_parent(parent)


def bind_to_launcher() -> None:
    """Ties this rank to its launcher and its future children to this rank
    (idempotent; call it first thing in a rank)."""
    global _bound
    if _bound:
        return
    _bound = True
    if any(name in os.environ for name in _LAUNCHER_VARIABLES):
        die_with_parent(os.getppid())
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)


__all__ = ["bind_to_launcher"]
