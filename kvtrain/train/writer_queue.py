"""The results queue of megatron's torch_dist checkpoint writer.

megatron 0.16.1 (``dist_checkpointing/strategies/filesystem_async.py``) makes
the queue through which the writer reports its results with
``multiprocessing.get_context("spawn").Manager().Queue()`` on the first save,
synchronous saves included. That costs, and risks, more than it needs to:

* spawn re-imports the main module in the manager process: an entry script
  without an ``if __name__ == "__main__":`` guard runs the training again in
  that child and the save hangs (a spawn-context trap);
* the manager unpickles the write results, so it imports torch: the first
  save of every process waits seconds for that import;
* nothing stops the manager process when its parent is SIGKILLed (pre-emption,
  the OOM killer): it lingers.

A synchronous save puts and gets its results in the training process itself,
so ``results_queue(async_save=False)`` is a plain in-process queue: no extra
process at all. Asynchronous saves (the writer runs in a forked process) do
need a cross-process queue: the manager is then started with ``__main__``
hidden (so the child imports nothing of ours), asks the kernel for SIGKILL
when its parent dies (``data_tools.lifeline``: Linux ``PR_SET_PDEATHSIG``, a
polling thread elsewhere),
ignores the stop signals (SIGTERM, SIGUSR1, SIGINT: the trainer's, see ``signals``)
and imports torch's checkpoint classes in the background right away.

Only the standard library is imported at module level: this module is what
the manager process unpickles as its initializer.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager

_MANAGER = None  # keeps the manager (and its process) alive with this process


def _init_manager(parent_pid: int) -> None:
    """Initializer of the manager process: die with ``parent_pid``, and import what
    unpickling the write results needs before the first save arrives."""
    from data_tools.lifeline import die_with_parent  # standard library only

    die_with_parent(parent_pid, poll=True)
    # SLURM sends SIGTERM/SIGUSR1 to every process of the job, a terminal's Ctrl-C
    # SIGINT to its process group; they ask the trainer to save and stop, and that
    # save's results come through this process.
    for name in ("SIGTERM", "SIGUSR1", "SIGINT"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_IGN)

    def warm() -> None:
        try:
            import torch.distributed.checkpoint.filesystem  # noqa: F401
        except Exception:  # noqa: BLE001 - only a head start
            pass

    threading.Thread(target=warm, daemon=True, name="kvtrain-import-warmup").start()


@contextmanager
def main_module_hidden():
    """Makes ``multiprocessing`` spawn skip re-importing ``__main__``."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved = {k: main.__dict__[k] for k in ("__file__", "__spec__") if k in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)


def results_queue(async_save: bool):
    """A queue for megatron's writer results: in-process for synchronous saves; for
    asynchronous ones a proxy served by a (once started) spawn-context manager."""
    global _MANAGER
    if not async_save:
        import queue

        return queue.Queue()
    if _MANAGER is None:
        import multiprocessing
        from multiprocessing.managers import SyncManager

        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        with main_module_hidden():
            manager.start(initializer=_init_manager, initargs=(os.getpid(),))
        _MANAGER = manager
    return _MANAGER.Queue()
