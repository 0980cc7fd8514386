"""The processes of a rank die with the process that launched them.

``kill -9`` of torchrun (or of its node's job step) used to leave both ranks
training as orphans, with their checkpoint writers, loader workers and
wandb-core, racing the rerun in the same run folder. Now:

* a rank started by a launcher (torchrun, or anything that sets ``WORLD_SIZE``
  / ``LOCAL_RANK``) dies with it (``data_tools.lifeline``). A rank started by
  hand (``kvtrain train`` from a shell) is not tied to its shell, so that
  ``nohup kvtrain train ... &`` outlives the terminal. The launcher is the
  parent the CLI saw first thing (``record_launcher``), before the seconds of
  torch and megatron imports: one killed meanwhile has left the rank with a
  new parent, which ``os.getppid()`` would name. Such a rank exits at once. (A
  parent of pid 1 is no sign of an orphan: a container's entry point, a shell
  or an init, may start the ranks itself.);
* every process a rank forks from its main thread - megatron's asynchronous
  checkpoint writer and that writer's own workers, DataLoader workers - dies
  with the rank (``os.register_at_fork``; the kernel setting is cleared on
  fork, so each generation asks again). A fork from another thread is left
  alone: the kernel would kill the child when *that thread* ends;
* the writer's spawn-context queue manager asks the same in its initializer
  (``writer_queue``), and wandb-core watches the pid it is given (``--pid``).

A rank also takes its imports out of the garbage collector's sight
(``freeze_imports``): see there why.
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import threading

from data_tools.lifeline import die_with_parent

_LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "WORLD_SIZE", "LOCAL_RANK")
_bound = False
_fork_parent: dict[str, int] = {}
_started: dict[str, int] = {}  # this process and its parent when the CLI started


def record_launcher() -> None:
    """Notes this process's parent (the launcher): call it before slow imports."""
    _started.update(pid=os.getpid(), parent=os.getppid())


def _launcher_pid() -> int:
    if _started.get("pid") == os.getpid():  # not a forked child's copy of the record
        return _started["parent"]
    return os.getppid()


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
        parent = _launcher_pid()
        if os.getppid() != parent:
            print(f"kvtrain: this rank's launcher exited before it bound to it (parent pid "
                  f"{parent}, now {os.getppid()}): exiting", file=sys.stderr, flush=True)
            os._exit(1)
        die_with_parent(parent)
    os.register_at_fork(before=_before_fork, after_in_child=_in_child)


def freeze_imports() -> None:
    """Moves every object alive now into the collector's permanent generation, for
    the life of the process: call it after the imports, before the run's objects.

    Why: torch, megatron and dynamo leave ~350k objects (modules, classes,
    functions) that live as long as the process, and every full collection walks
    them all: ~0.25 s a pass on a CPU. megatron's distributed optimizer calls
    ``gc.collect()`` at every checkpoint save and load, and gen-2 passes come
    during training too; frozen, a pass sees only the run's own objects. They are
    unfrozen at exit, so that the interpreter's final collection still frees them
    (Triton's bindings print "leaked" lines for objects alive then). Nothing is
    collected first: what the imports left as garbage is a few objects.
    """
    import torch._dynamo  # noqa: F401 (torch.optim imports it at the first optimizer)

    gc.freeze()
    atexit.register(gc.unfreeze)


__all__ = ["bind_to_launcher", "freeze_imports", "record_launcher"]
