"""A checkpoint writer process that dies fails its save in one line, not a hang.

megatron-core 0.16.1 writes a torch_dist checkpoint with one process per write
bucket, forked by the process that saves: the trainer for a synchronous save,
and for an asynchronous one the writer megatron forks per save (which megatron
watches: a writer that dies ends its save with "CheckpointException
ranks:dict_keys([0])"). The saving process then waits until every bucket
process has marked its task done (``count_queue.join()``). A bucket process
that dies first - SIGKILL from the kernel's out-of-memory killer: the writers
hold copies of the state - never marks it: the wait never ends, and a run hung
silently, at its save (synchronous) or at the next save, stop or end
(asynchronous).

A process that died and was not waited for stays a zombie, and Linux keeps its
wait status in ``/proc/PID/stat`` (field 52). ``dead_writer`` reads that for
the processes a save forked:

* asynchronous saves: ``Checkpointer.finalize`` asks every rank for its
  verdict before megatron's finalize (collective), so all ranks stop with the
  same line;
* synchronous saves: the trainer's own thread is the one that waits, so
  ``SyncSaveWatch`` (a thread, during the save) prints the line and ends the
  process (exit 2); the launcher stops the other ranks. The previous
  checkpoint stays ``latest``; the next start removes the incomplete folder.

A bucket that dies before its parent has started the next one leaves no
zombie: multiprocessing waits for the children that ended at every start, so
its exit status is gone. The wait is still told by what is left: the bucket
processes megatron has forked all ended, one at least not waited for
(megatron waits for them only once every part is done), for ``LEFT_WAITING_S``
(``LeftWaiting``).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Iterable, Optional

from data_tools.lifeline import killed_by

POLL_SECONDS = 0.5
# how long every bucket of a save may have ended, none waited for, before the
# save is taken for one waiting for a part that will never come: a healthy parent
# waits for them within milliseconds of the last one's end
LEFT_WAITING_S = 5.0
LOST = ("ended before writing its part, its exit status already taken (the kernel's "
        "out-of-memory killer is the likely cause: see dmesg)")


def children(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux ``/proc``; [] elsewhere). Kernels
    without ``task/*/children`` (CONFIG_PROC_CHILDREN) are scanned instead."""
    if not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
        return _scan_children(pid)
    kids: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    kids += [int(k) for k in f.read().split()]
            except OSError:  # a thread that ended meanwhile
                pass
    except OSError:
        return []
    return kids


def _scan_children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        kids.append(int(entry))
            except (OSError, ValueError, IndexError):
                pass
    return kids


def ended(pid: int) -> Optional[int]:
    """The wait status of ``pid`` when it is a zombie (died, not yet waited for)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    # fields[0] is field 3 (the state); the exit status is field 52 (Linux >= 3.5)
    if fields[0] != "Z" or len(fields) < 50:
        return None
    return int(fields[49])


def how(status: int) -> Optional[str]:
    """A wait status in words; None for a clean exit."""
    if os.WIFSIGNALED(status):
        return "was " + killed_by(os.WTERMSIG(status))
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else status
    return f"exited with status {code}" if code else None


def dead_writer(writers: Iterable, forked_by: Optional[int] = None,
                since: frozenset = frozenset()) -> Optional[str]:
    """Why this rank's save cannot finish (None: it can): one of ``writers``
    (megatron's writer processes) ended abnormally, or one of the processes
    they forked did; with ``forked_by`` the processes that pid forked since
    (not in ``since``) are the ones looked at."""
    for writer in writers:
        code = writer.exitcode  # polls (waitpid WNOHANG): megatron joins it later
        if code:  # multiprocessing's: -N for signal N
            words = "was " + killed_by(-code) if code < 0 else f"exited with status {code}"
            return f"the checkpoint writer process (pid {writer.pid}) {words}"
        for kid in children(writer.pid):
            words = how(status) if (status := ended(kid)) is not None else None
            if words:
                return (f"a checkpoint writer process (pid {kid}, forked by the writer "
                        f"{writer.pid}) {words}")
    if forked_by is not None:
        for kid in children(forked_by):
            words = how(status) if kid not in since and (status := ended(kid)) is not None \
                else None
            if words:
                return f"a checkpoint writer process (pid {kid}) {words}"
    return None


class LeftWaiting:
    """Tells a save whose bucket died unseen: every process the saving process
    forked for it has ended, one at least still a zombie (not waited for), for
    ``after_s``. megatron waits for the buckets' processes only once each has
    marked its part done, so such a save waits for a part no process writes."""

    def __init__(self, after_s: float = LEFT_WAITING_S):
        self.after_s = after_s
        self._since: dict[int, float] = {}  # saving process -> when all its buckets had ended

    def check(self, buckets: dict[int, Iterable[int]]) -> Optional[int]:
        """The first of the saving processes (``buckets``: each one's bucket
        processes) left waiting; None: none is. Only these are remembered: a pid
        that ended its save may come back as another's."""
        now, stuck = time.monotonic(), None
        self._since = {pid: t for pid, t in self._since.items() if pid in buckets}
        for parent, kids in buckets.items():
            kids = list(kids)
            if not kids or any(ended(kid) is None for kid in kids):
                self._since.pop(parent, None)
            elif now - self._since.setdefault(parent, now) >= self.after_s and stuck is None:
                stuck = parent
        return stuck


_ASYNC_WAITS = LeftWaiting()  # the asynchronous writers', over the checks of a run


class SyncSaveWatch:
    """During a synchronous save: a thread that ends this process with one line
    when a writer process it forked dies (the save would wait for it forever)."""

    def __init__(self, describe, exit_code: int = 2):
        self._describe = describe  # reason -> the line to print (names the checkpoint)
        self._exit_code = exit_code
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def __enter__(self) -> "SyncSaveWatch":
        before = frozenset(children(os.getpid()))
        self._thread = threading.Thread(target=self._watch, args=(before,), daemon=True,
                                        name="kvtrain-save-watch")
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self, before: frozenset) -> None:
        waits = LeftWaiting()
        while not self._done.wait(POLL_SECONDS):
            reason = dead_writer((), forked_by=os.getpid(), since=before)
            forked = set(children(os.getpid())) - before
            if reason is None and waits.check({os.getpid(): forked}) is not None:
                reason = f"a checkpoint writer process {LOST}"
            if reason and not self._done.is_set():
                for kid in forked:
                    try:
                        os.kill(kid, signal.SIGKILL)  # the other writers: they wait on it too
                    except ProcessLookupError:
                        pass
                print(self._describe(reason), file=sys.stderr, flush=True)
                os._exit(self._exit_code)


def _writers(calls) -> list:
    """The writer processes of megatron's async calls (those that have one yet)."""
    return [p for c in calls if (p := getattr(c.async_caller, "process", None)) is not None]


def finalize_async(async_queue, rank: int) -> None:
    """megatron's non-blocking finalize of the saves in flight. A writer that died
    after :func:`check_async_writers` looked and before megatron did fails the save
    with its own line too, not megatron's ``CheckpointException ranks:...``."""
    from torch.distributed.checkpoint.api import CheckpointException

    from .integrity import SaveFailed

    writers = _writers(async_queue.async_calls)
    try:
        async_queue.maybe_finalize_async_calls(blocking=False)
    except CheckpointException as e:
        reason = dead_writer(writers)  # the exit code stays on the process after its join
        if reason is None:
            raise
        raise SaveFailed(f"rank {rank}: {reason}") from e


def check_async_writers(async_queue) -> None:
    """Collective, while asynchronous saves are in flight: when a writer of one of
    them died on any rank, every rank kills its own writers, drops the saves in
    flight and raises ``SaveFailed`` with the ranks' reasons."""
    import torch.distributed as dist

    from .integrity import SaveFailed

    calls = list(async_queue.async_calls)
    writers = _writers(calls)
    reason = dead_writer(writers)
    stuck = _ASYNC_WAITS.check({w.pid: children(w.pid) for w in writers})
    if reason is None and stuck is not None:
        reason = f"a checkpoint writer process (forked by the writer {stuck}) {LOST}"
    reasons = [None] * dist.get_world_size()
    dist.all_gather_object(reasons, reason and f"rank {dist.get_rank()}: {reason}")
    failed = [r for r in reasons if r]
    if not failed:
        return
    for call in calls:
        process = getattr(call.async_caller, "process", None)
        for kid in children(process.pid) if process is not None else ():
            try:
                os.kill(kid, signal.SIGKILL)  # the bucket writers first: they outlive it
            except ProcessLookupError:
                pass
        call.async_caller.close(abort=True)  # kills the writer, if it still runs
    async_queue.async_calls.clear()
    raise SaveFailed("; ".join(failed))


__all__ = ["LEFT_WAITING_S", "LeftWaiting", "SyncSaveWatch", "check_async_writers", "children",
           "dead_writer", "ended", "how"]
