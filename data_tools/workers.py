"""The tokenizer worker processes of ``preprocess``: work items encoded in
input order, at most ``4 * workers`` in flight.

``multiprocessing.Pool`` replaces a worker that dies (the kernel's out-of-memory
killer, a crash in the tokenizer) and loses the task it held: ``imap`` then
waits for that result forever, and a preprocess run hung without a word.
``ProcessPoolExecutor`` fails the work in flight instead (``BrokenProcessPool``);
``WorkersFailed`` turns that, and a ``MemoryError`` (a memory limit set with
``ulimit -v``), into one line naming the input in flight and how the worker
ended.

The main thread reads the inputs between results: it keeps the window full,
so the workers never wait for it, and bounds memory whatever the corpus size
(about ``chunk size * 4 * workers`` plus their tokens).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, Iterable, Iterator, Optional

from data_tools.encoder import ChunkEncoder, encode_item, init_worker
from data_tools.lifeline import killed_by
from data_tools.units import human


class WorkersFailed(Exception):
    """A worker died or ran out of memory; the message says while encoding what."""


def where(item) -> Optional[tuple[str, int, int]]:
    """(file, first line or document, bytes) of a work item; None for a shard's end."""
    payload = getattr(item, "payload", None)
    if payload is None:
        return None
    size = len(payload) if isinstance(payload, bytes) else \
        sum(len(v) for v in payload if isinstance(v, (str, bytes)))
    return item.path, item.first_line, size


def _named(place: tuple[str, int, int]) -> str:
    path, line, size = place
    return f"{path}:{line} ({human(size, 'B', 1, ' ')})"


def _in_flight(places: list) -> str:
    """The work in flight, and its largest unit: a very long line is the usual
    cause of a worker running out of memory."""
    places = [p for p in places if p is not None]
    if not places:
        return "between shards"
    text = _named(places[0])
    if len(places) > 1:
        text += f" and {len(places) - 1} more work unit(s) in flight"
        largest = max(places, key=lambda p: p[2])
        if largest[2] > places[0][2]:
            text += f", the largest {largest[0]}:{largest[1]} of {human(largest[2], 'B', 1, ' ')}"
    return text


def _how_it_ended(processes: list) -> str:
    """How the workers ended: the executor terminates the others (SIGTERM) once one died."""
    codes = [p.exitcode for p in processes if p.exitcode not in (None, 0, -signal.SIGTERM)]
    if not codes:
        return "a tokenizer worker process died"
    code = codes[0]
    if code < 0:
        return f"a tokenizer worker process was {killed_by(-code)}"
    return f"a tokenizer worker process exited with status {code}"


def encode_inline(items: Iterable, encoder: Callable) -> Iterator:
    """``encoder`` over ``items`` in this process (``--workers 0``)."""
    for item in items:
        try:
            yield encoder(item)
        except MemoryError:
            raise WorkersFailed(f"out of memory (MemoryError) while encoding "
                                f"{_in_flight([where(item)])}") from None


class EncoderPool:
    """``workers`` processes running ``function`` (after ``initializer(*initargs)``)."""

    def __init__(self, workers: int, initargs: tuple, function: Callable = encode_item,
                 initializer: Callable = init_worker) -> None:
        ctx = multiprocessing.get_context()
        # Workers are children of this process, except under forkserver: the
        # initializer's last argument is the parent they must die with.
        parent = None if ctx.get_start_method() == "forkserver" else os.getpid()
        self._executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=initializer,
                                             initargs=(*initargs, parent))
        self._function, self._workers, self._limit = function, workers, 4 * workers
        self._processes: dict = {}  # pid -> Process, as the executor started them

    def map(self, items: Iterable) -> Iterator:
        """Results of ``items`` in their order; ``WorkersFailed`` when a worker dies."""
        pending: deque = deque()  # (where, future), oldest first
        items = iter(items)
        more = True
        while True:
            while more and len(pending) < self._limit:
                item = next(items, _END)
                if item is _END:
                    more = False
                    break
                pending.append((where(item), self._executor.submit(self._function, item)))
                if len(self._processes) < self._workers:  # started at the first submits
                    self._processes.update(getattr(self._executor, "_processes", None) or {})
            if not pending:
                return
            try:
                result = pending[0][1].result()
            except BrokenProcessPool:
                self._executor.shutdown(wait=True)  # the workers are gone: exit codes are in
                raise WorkersFailed(f"{_how_it_ended(list(self._processes.values()))} "
                                    f"while encoding {_in_flight([p for p, _ in pending])}"
                                    ) from None
            except MemoryError:
                raise WorkersFailed(f"a tokenizer worker ran out of memory (MemoryError) "
                                    f"while encoding {_in_flight([pending[0][0]])}") from None
            pending.popleft()
            yield result

    def close(self) -> None:
        """After the last result: the workers exit."""
        self._executor.shutdown(wait=True)

    def terminate(self) -> None:
        """On an error or Ctrl-C: the work queued is dropped and the workers stop now,
        not after the item each is encoding."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        for process in self._processes.values():
            if process.exitcode is None:
                process.terminate()


_END = object()


def encode_in_order(items: Iterable, workers: int, model_path: str, dtype, json_key: str,
                    keep: int) -> tuple[Iterator, Optional[EncoderPool]]:
    """Encoded chunks of ``items`` in order, and the pool to close or terminate
    (None when ``workers`` is 0: everything runs in this process)."""
    if workers <= 0:
        return encode_inline(items, ChunkEncoder(model_path, dtype, json_key, keep)), None
    pool = EncoderPool(workers, (model_path, dtype, json_key, keep))
    return pool.map(items), pool


__all__ = ["EncoderPool", "WorkersFailed", "encode_in_order", "encode_inline", "where"]
