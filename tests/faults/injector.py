"""Faults for drills: a ``RunHooks`` that the test driver builds from a job's
``faults`` entry and hands to ``train(cfg, run_dir, hooks=...)``.

    {"kill_in_save": 6}        SIGKILL after iteration 6's shards are written,
                               before the checkpoint is marked complete
    {"kill_after_save": 3}     SIGKILL right after the checkpoint of 3 is complete
    {"nonfinite_steps": [3]}   the loss of step 3 becomes NaN
    {"nonfinite_grad_steps": [5]}  the gradients of step 5 become inf (finite loss)
    {"stop_after": 3}          step 3 carries a stop request (like SIGTERM)
    {"kill_at_step": 4}        SIGKILL at the start of step 4 (nothing saved for it)
    {"fail_in_save": [4, 1]}   rank 1 fails (EIO) after iteration 4's shards are
                               written, as a rank whose disk fails while it reads them back
    {"kill_writer_in_save": [4, 0, "bucket"]}  on rank 0, the save of 4 has a process
                               that writes its shards SIGKILLed as it starts, as the OOM
                               killer does: "bucket" (the last write bucket's process,
                               forked by the process that saves), "first_bucket" (the
                               first one's, waited for before the next one starts: its
                               exit status is gone) or "writer" (megatron's
                               asynchronous writer itself)
    {"kill_loader_workers_at": 3}  SIGKILL to this rank's data loader workers (every
                               child process: a run with synchronous saves has no other)
                               at the start of step 3, as the OOM killer does
    {"ctrl_c_twice_at": 5}     at the start of step 5, SIGINT to this process, then
                               another once the first no longer counts as the same
                               press (``signals.SAME_PRESS_S``): a user's second Ctrl-C
    {"read_only_after_save": [2, "/ck"]}  rank 0 mounts /ck over itself read-only
                               right after the checkpoint of 2 is complete (root only;
                               a bind mount: the lock file open in /ck keeps a remount busy)
    {"room_at": [5, "/run/filler"]}  at the start of step 5 the file filling a disk is
                               deleted: the disk has room again
    {"folder_at": [2, "/ck/latest"]}  at the start of step 2 a folder is made there (in
                               the way of a file a save writes; a start refuses one)
"""

from __future__ import annotations

import errno
import os
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Optional

from kvtrain.train.hooks import RunHooks


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


_ORIGINAL_WRITERS: dict = {}
_DYING_BUCKET = [None]  # the index of the bucket that dies: set by the writer, read after the fork


def _writers_die(which: str, on: bool) -> None:
    """Makes the processes megatron forks to write a checkpoint (from now on: ``on``)
    SIGKILL themselves as they start: the asynchronous writer ("writer"), the last
    write bucket's ("bucket": its parent starts no other after it, so it stays a
    zombie until waited for) or the first bucket's, its parent starting the next
    one only once it has waited for it ("first_bucket": multiprocessing waits for
    the ended ones as it starts another, so its exit status is gone). Both are
    megatron's static methods, looked up after the fork."""
    from functools import wraps

    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync as Writer,
    )

    for name in ("write_preloaded_data", "write_preloaded_data_multiproc"):
        original = _ORIGINAL_WRITERS.setdefault(name, getattr(Writer, name))
        setattr(Writer, name, staticmethod(original))
    if not on:
        return
    multiproc = _ORIGINAL_WRITERS["write_preloaded_data_multiproc"]
    bucket = _ORIGINAL_WRITERS["write_preloaded_data"]

    @wraps(multiproc)
    def writer(*args):  # (transform_list, use_msc, rank, write_buckets, results_queue)
        if which == "writer":
            _die()
        assert len(args[3]) > 1 or which == "bucket", "one write bucket: no other to start"
        _DYING_BUCKET[0] = 0 if which == "first_bucket" else len(args[3]) - 1
        with _reaped_before_the_next_start(which == "first_bucket"):
            return multiproc(*args)

    @wraps(bucket)
    def dies(*args, **kwargs):
        if kwargs.get("local_proc_idx") == _DYING_BUCKET[0]:
            _die()
        return bucket(*args, **kwargs)

    setattr(Writer, "write_preloaded_data_multiproc", staticmethod(writer))
    setattr(Writer, "write_preloaded_data", staticmethod(dies))


@contextmanager
def _reaped_before_the_next_start(on: bool):
    """Inside: a forked process starts only once the first one started has ended
    and been waited for (``join``), as a slow start after a quick death would."""
    from multiprocessing.context import ForkProcess

    original, started = ForkProcess.start, []

    def start(self):
        if started:
            started[0].join()
        original(self)
        started.append(self)

    if on:
        ForkProcess.start = start
    try:
        yield
    finally:
        ForkProcess.start = original


class Faults(RunHooks):
    def __init__(self, kill_in_save: Optional[int] = None, kill_after_save: Optional[int] = None,
                 nonfinite_steps: Iterable[int] = (), stop_after: Optional[int] = None,
                 kill_at_step: Optional[int] = None, nonfinite_grad_steps: Iterable[int] = (),
                 fail_in_save: Optional[tuple[int, int]] = None,
                 read_only_after_save: Optional[tuple[int, str]] = None,
                 kill_writer_in_save: Optional[tuple[int, int, str]] = None,
                 kill_loader_workers_at: Optional[int] = None,
                 ctrl_c_twice_at: Optional[int] = None,
                 room_at: Optional[tuple[int, str]] = None,
                 folder_at: Optional[tuple[int, str]] = None):
        self.kill_in_save = kill_in_save
        self.kill_after_save = kill_after_save
        self.nonfinite_steps = frozenset(nonfinite_steps)
        self.stop_after = stop_after
        self.kill_at_step = kill_at_step
        self.nonfinite_grad_steps = frozenset(nonfinite_grad_steps)
        self.fail_in_save = tuple(fail_in_save) if fail_in_save else None
        self.read_only_after_save = tuple(read_only_after_save or (None, None))
        self.kill_writer_in_save = tuple(kill_writer_in_save or (None, None, None))
        self.kill_loader_workers_at = kill_loader_workers_at
        self.ctrl_c_twice_at = ctrl_c_twice_at
        self.room_at = tuple(room_at or (None, None))  # (step, a file filling a disk)
        self.folder_at = tuple(folder_at or (None, None))  # (step, a folder in the way)

    def loss(self, iteration, loss_sum):
        if iteration in self.nonfinite_steps:
            return loss_sum * float("nan")
        return loss_sum

    def gradients(self, iteration, model):
        if iteration not in self.nonfinite_grad_steps:
            return
        for chunk in model:
            for param in chunk.parameters():
                grad = getattr(param, "main_grad", None)
                grad = param.grad if grad is None else grad
                if grad is not None:
                    grad.view(-1)[0] = float("inf")

    def stop_requested(self, iteration: int) -> bool:
        if iteration == self.kill_at_step:
            _die()
        if iteration == self.kill_loader_workers_at:
            import time

            import psutil

            workers = psutil.Process().children()
            assert workers, "no data loader worker to kill"
            for worker in workers:
                worker.kill()
            time.sleep(1.0)  # torch learns of it from SIGCHLD, in the step that follows
        if iteration == self.ctrl_c_twice_at:
            import time

            from kvtrain.train.signals import SAME_PRESS_S

            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(SAME_PRESS_S + 0.2)
            os.kill(os.getpid(), signal.SIGINT)  # raises KeyboardInterrupt here
        if iteration == self.room_at[0]:
            os.unlink(self.room_at[1])  # the disk has room again, from this step on
        if iteration == self.folder_at[0]:
            os.makedirs(self.folder_at[1], exist_ok=True)  # every rank: the same folder
        at, rank, which = self.kill_writer_in_save
        if at is not None and iteration in (at, at + 1):
            import torch.distributed as dist

            if dist.get_rank() == rank:
                _writers_die(which, iteration == at)  # the save at the end of step ``at``
        return iteration == self.stop_after

    def shards_written(self, work: Path, iteration: int) -> None:
        if iteration == self.kill_in_save:
            _die()
        if self.fail_in_save is not None and self.fail_in_save[0] == iteration:
            import torch.distributed as dist

            if dist.get_rank() == self.fail_in_save[1]:
                raise OSError(errno.EIO, "Input/output error", str(work))

    def checkpoint_saved(self, path: Path, iteration: int) -> None:
        if iteration == self.kill_after_save:
            _die()
        at, mount = self.read_only_after_save
        if iteration == at:
            import subprocess

            import torch.distributed as dist

            if dist.get_rank() == 0:  # before the collectives that lead to the next save
                subprocess.run(["mount", "--bind", mount, mount], check=True)
                subprocess.run(["mount", "-o", "remount,bind,ro", mount], check=True)
