"""One writer per run folder: ``<run_dir>/.kvtrain.lock``, and per checkpoint
folder: ``<checkpoint.dir>/.kvtrain.lock`` (``checkpoint.dir`` may lie outside
the run folder, on scratch storage, and two runs must not resume, save and
apply keep_last in one folder).

Global rank 0 takes an exclusive ``flock`` on the lock file before any rank
touches the folder and writes its host, pid and start time into it; every
rank learns the verdict through a broadcast, so all of them stop with the
same line when the folder is in use. The kernel drops the lock when the
holder dies, however it dies: a dead holder's lock is taken over without
anyone deleting anything. The lock is held until the process exits (or
``release``); processes forked by the holder (the asynchronous checkpoint
writer) share it, so the folder stays locked while one of them still writes.

A requeued SLURM job may find its own earlier start still holding the lock:
on NFSv4 the server keeps a dead node's locks until that client's lease runs
out (90 s by default), and the old start's processes may still be exiting.
A start whose SLURM job id is the holder's, with a higher restart count, waits
for the lock (``SAME_JOB_WAIT`` seconds at most, saying so) instead of being
refused; any other holder is refused at once.

Limitation: on a shared filesystem ``flock`` is only as coherent as the
filesystem makes it (NFSv4 and Lustre with ``flock`` mounts are; a mount
with ``localflock`` locks per node). The recorded host and pid are what the
refusal reports.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

from kvtrain.config import ConfigError, on_every_rank

LOCK_FILE = ".kvtrain.lock"
# how long a requeued job waits for its own earlier start's lock: NFSv4's
# default lease (90 s) plus the server's grace, with room to spare
SAME_JOB_WAIT = 240.0
_held: dict[str, "RunLock"] = {}  # one lock per folder and process (re-entrant)


class RunLock:
    """The lock of one run folder, held by this process."""

    def __init__(self, path: Path, fd: int, fresh: bool = False):
        self.path, self.fd = path, fd
        self.fresh = fresh  # this process made the run folder (an atomic mkdir)
        self.others: list[RunLock] = []  # released with this one (the checkpoint folder's)

    def hold_too(self, other: Optional["RunLock"]) -> None:
        if other is not None and other is not self:  # the same folder: one lock
            self.others.append(other)

    def release(self) -> None:
        for other in self.others:
            other.release()
        if self.fd >= 0:
            _held.pop(str(self.path), None)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def _slurm_start() -> Optional[tuple[str, int]]:
    """(SLURM job id, restart count) of this process, None outside SLURM."""
    job = os.environ.get("SLURM_JOB_ID")
    try:
        return (job, int(os.environ.get("SLURM_RESTART_COUNT", "0"))) if job else None
    except ValueError:
        return None


def _read_info(fd: int) -> dict:
    try:
        info = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
    except (OSError, ValueError):
        info = {}
    return info if isinstance(info, dict) else {}


def _describe(info: dict) -> str:
    job = f" (SLURM job {info['slurm_job']} restart {info.get('slurm_restart', 0)})" \
        if info.get("slurm_job") else ""
    started = info.get("started")
    since = f", since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(started))}" \
        if isinstance(started, (int, float)) else ""
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{job}{since}"


def _earlier_start_of_this_job(info: dict) -> bool:
    """The holder is this SLURM job before its requeue (a lower restart count)."""
    mine = _slurm_start()
    restart = info.get("slurm_restart")
    return (mine is not None and str(info.get("slurm_job")) == mine[0]
            and isinstance(restart, int) and restart < mine[1])


def try_lock(run_dir: Path) -> tuple[Optional[RunLock], dict]:
    """(the lock, {}) or (None, what the holder recorded: host, pid, start, job)."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir()
        fresh = True
    except FileExistsError:
        fresh = False
    path = (run_dir / LOCK_FILE).resolve()
    if str(path) in _held:
        return _held[str(path)], {}
    if path.is_dir():  # os.open's "Is a directory" named the run folder, not this
        raise IsADirectoryError(errno.EISDIR, f"{path} is a folder, not the run's lock "
                                "file: move it away")
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _read_info(fd) or {"pid": "?"}
        os.close(fd)
        return None, holder
    info = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    if (slurm := _slurm_start()) is not None:
        info["slurm_job"], info["slurm_restart"] = slurm
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    lock = _held[str(path)] = RunLock(path, fd, fresh)
    return lock, {}


def lock_or_wait_for_own_job(run_dir: Path, what: str,
                             wait: float = SAME_JOB_WAIT) -> tuple[Optional[RunLock], dict]:
    """``try_lock``; while the holder is this job's earlier start (a requeue that
    found its predecessor's lock not yet dropped), try again for ``wait`` seconds."""
    deadline = time.monotonic() + wait
    lock, holder = try_lock(run_dir)
    if lock is None and _earlier_start_of_this_job(holder):
        print(f"kvtrain: {what} {Path(run_dir).resolve()} is still locked by this job's "
              f"earlier start, {_describe(holder)}: waiting up to {wait:.0f} s for the "
              "lock to be dropped", flush=True)
        while lock is None and _earlier_start_of_this_job(holder) \
                and time.monotonic() < deadline:
            time.sleep(min(2.0, max(deadline - time.monotonic(), 0.0)))
            lock, holder = try_lock(run_dir)
        if lock is None and _earlier_start_of_this_job(holder):
            holder = dict(holder, waited=wait)
    return lock, holder


def hold_run_folder(run_dir: Path, what: str = "run folder",
                    wait: float = SAME_JOB_WAIT) -> Optional[RunLock]:
    """Rank 0 locks ``run_dir`` (``what``: the run folder, or the checkpoint folder);
    every rank raises the same ``ConfigError`` when another process holds it or the
    folder cannot be written (collective when a process group exists). A requeued
    SLURM job waits up to ``wait`` seconds for its own earlier start's lock."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    lock, verdict, folder = None, [""], Path(run_dir).resolve()
    if not distributed or dist.get_rank() == 0:
        try:
            lock, holder = lock_or_wait_for_own_job(Path(run_dir), what, wait)
        except OSError as e:  # read-only, no permission: one line, before anything starts
            lock, holder = None, {}
            verdict[0] = f"{what} {folder} cannot be written: {e.strerror or e}"
        if lock is None and holder:
            waited = (f"; this job's earlier start did not drop it within {holder['waited']:.0f}"
                      " s" if "waited" in holder else "")
            verdict[0] = (f"{what} {folder} is in use by kvtrain {_describe(holder)} (lock "
                          f"{folder / LOCK_FILE}){waited}; one run writes to a folder at a "
                          "time")
    if distributed:
        dist.broadcast_object_list(verdict, src=0)
    if verdict[0]:
        raise on_every_rank(ConfigError(verdict[0]))
    return lock


# what a start writes into its run folder before the first step
START_FILES = (LOCK_FILE, "config.yaml")
START_FOLDERS = ("data_cache", "checkpoints")


@contextmanager
def removed_on_bad_input(run_dir: Path, lock: Optional[RunLock]) -> Iterator[None]:
    """A start refused for bad input (a ``ConfigError``: a missing shard, a bad
    tokenizer, a checkpoint that does not fit) leaves no new folder behind: when
    this process made ``run_dir`` (``lock.fresh``), the lock holder removes what
    the start wrote there (``START_FILES``, ``START_FOLDERS``), then the folder if
    that emptied it, and only then lets the lock go; so does a checkpoint folder
    outside it that the start made (its lock file). Anything else in them, and
    every folder that existed before, stays."""
    try:
        yield
    except ConfigError:
        if lock is not None:
            if lock.fresh:
                _remove_emptied(run_dir, START_FILES, START_FOLDERS)
            for other in lock.others:  # checkpoint.dir elsewhere (scratch storage)
                if other.fresh:
                    _remove_emptied(other.path.parent, (LOCK_FILE,), ())
            lock.release()
        raise


def _remove_emptied(folder: Path, files: tuple, folders: tuple) -> None:
    """Removes ``files`` and ``folders`` from ``folder``, then ``folder`` if that emptied it."""
    for name in folders:
        shutil.rmtree(folder / name, ignore_errors=True)
    for name in files:
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # not empty: something else is there, and it stays
        pass


__all__ = ["LOCK_FILE", "SAME_JOB_WAIT", "RunLock", "hold_run_folder", "lock_or_wait_for_own_job",
           "removed_on_bad_input", "try_lock"]
