"""The tokenizer worker processes of ``preprocess``: work items encoded in
input order, at most ``4 * workers`` in flight.

A worker can die at any moment (the kernel's out-of-memory killer, a crash in
the tokenizer), and the run must then end with one line, not hang:

* ``multiprocessing.Pool`` replaces a dead worker and loses its task: ``imap``
  waited for that result forever.
* ``ProcessPoolExecutor`` shares one result pipe and its lock among all
  workers. A worker killed while writing its result left a message cut short
  (the executor's reader waited for the rest forever) and the lock held (the
  other workers waited forever): CI saw that hang.

So each worker here has channels of its own: a task queue it alone reads, and a
result pipe whose only write end is in the worker. A worker that dies, in
whatever state, ends its pipe (EOF) and fires its sentinel, which the main
process waits on beside the result it needs next. ``WorkersFailed`` says how
the worker ended and which input was in flight; a ``MemoryError`` (a limit set
with ``ulimit -v``) is reported the same way.

The main thread reads the inputs between results: it keeps the window full, so
the workers never wait for it, and bounds memory whatever the corpus size
(about ``chunk size * 4 * workers`` plus their tokens).
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from multiprocessing.connection import wait
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
    """How the workers ended: the one that died, not the others (still running, or
    ended by SIGTERM)."""
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


def _serve(tasks, results, function: Callable, initializer: Callable, initargs: tuple) -> None:
    """A worker's loop: ``function`` over its tasks until the ``None`` that ends them."""
    # terminate() ends a worker (the main process's handler, inherited through
    # fork, would only raise in here); Ctrl-C goes to the whole process group, and
    # the main process alone handles it (terminating the pool): no tracebacks here.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        initializer(*initargs)
        failed = None
    except Exception as e:  # every task answers with it: the main process raises it
        failed = e
    while (item := tasks.get()) is not None:
        try:
            if failed is not None:
                raise failed
            message = ("ok", function(item))
        except MemoryError:
            message = ("memory", None)
        except Exception as e:
            message = ("error", e)
        results.send(message)


class _Worker:
    """One worker process and its own two channels."""

    def __init__(self, ctx, function: Callable, initializer: Callable, initargs: tuple):
        self.tasks = ctx.Queue()  # put() hands the item to a feeder thread: never blocks
        self.tasks.cancel_join_thread()  # a dead worker's queued tasks are not waited for
        self.results, writer = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, daemon=True, name="tokenizer-worker",
                                   args=(self.tasks, writer, function, initializer, initargs))
        self.process.start()
        writer.close()  # the worker's copy is the only one left: its death is EOF here
        self.in_flight = 0

    def receive(self, others: list) -> Optional[tuple]:
        """This worker's next message; None when it, or any of ``others``, died."""
        ready = wait([self.results] + [w.process.sentinel for w in others])
        if self.results not in ready:
            return None
        try:
            message = self.results.recv()
        except (EOFError, OSError):  # died, maybe halfway through the message
            self.process.join(timeout=10)  # its exit code, for the line
            return None
        self.in_flight -= 1
        return message

    def close(self) -> None:
        self.tasks.close()
        self.results.close()


class EncoderPool:
    """``workers`` processes running ``function`` (after ``initializer(*initargs)``)."""

    def __init__(self, workers: int, initargs: tuple, function: Callable = encode_item,
                 initializer: Callable = init_worker) -> None:
        ctx = multiprocessing.get_context()
        # Workers are children of this process, except under forkserver: the
        # initializer's last argument is the parent they must die with.
        parent = None if ctx.get_start_method() == "forkserver" else os.getpid()
        self._workers = [_Worker(ctx, function, initializer, (*initargs, parent))
                         for _ in range(workers)]
        self._limit = 4 * workers

    @property
    def _processes(self) -> dict:
        """pid -> Process of the workers."""
        return {w.process.pid: w.process for w in self._workers}

    def map(self, items: Iterable) -> Iterator:
        """Results of ``items`` in their order; ``WorkersFailed`` when a worker dies."""
        pending: deque = deque()  # (where, worker), oldest first
        items = iter(items)
        more = True
        while True:
            while more and len(pending) < self._limit:
                item = next(items, _END)
                if item is _END:
                    more = False
                    break
                worker = min(self._workers, key=lambda w: w.in_flight)
                worker.tasks.put(item)
                worker.in_flight += 1
                pending.append((where(item), worker))
            if not pending:
                return
            message = pending[0][1].receive(self._workers)
            if message is None:
                raise WorkersFailed(f"{self._how_they_ended()} "
                                    f"while encoding {_in_flight([p for p, _ in pending])}")
            kind, value = message
            if kind == "memory":
                raise WorkersFailed(f"a tokenizer worker ran out of memory (MemoryError) "
                                    f"while encoding {_in_flight([pending[0][0]])}")
            if kind == "error":
                raise value
            pending.popleft()
            yield value

    def _how_they_ended(self) -> str:
        # A dead process's pipes and sentinel close a moment before its exit
        # code can be read: wait for the code of each one whose sentinel fired.
        for process in self._processes.values():
            if wait([process.sentinel], timeout=0):
                process.join(timeout=10)
        return _how_it_ended(list(self._processes.values()))

    def close(self) -> None:
        """After the last result: the workers exit."""
        for worker in self._workers:
            worker.tasks.put(None)
        for worker in self._workers:
            worker.process.join()
            worker.close()

    def terminate(self) -> None:
        """On an error or Ctrl-C: the work queued is dropped and the workers stop now,
        not after the item each is encoding."""
        for worker in self._workers:
            if worker.process.exitcode is None:
                worker.process.terminate()
        for worker in self._workers:
            worker.process.join(timeout=10)
            if worker.process.exitcode is None:  # SIGTERM blocked: not ours to wait on
                worker.process.kill()
                worker.process.join()
            worker.close()


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
