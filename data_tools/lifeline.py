"""Dying with the parent, the one helper every child process of kvtrain uses;
and stops (SIGTERM, Ctrl-C) turned into exceptions that wait for a section
that must not be cut in two (``stops_raise``, ``signals_held``).

A process killed with SIGKILL (pre-emption, the OOM killer, ``kill -9`` of a
launcher) cannot clean up after itself: its children - pool workers, the
checkpoint writer's processes, training ranks under a launcher - would go on
as orphans. Linux lets a child ask the kernel for a signal when its parent
dies (``prctl(PR_SET_PDEATHSIG)``). Two caveats, handled by the callers:

* "parent" is the *thread* that forked the child: fork from the main thread
  (or a thread that lives as long as the process);
* the setting is cleared in the children of a fork, so every generation must
  ask again (an initializer, or ``os.register_at_fork``).

A parent that died before the request took effect is caught by comparing
``os.getppid()`` with the pid the parent had. Elsewhere than Linux an optional
thread polls ``os.getppid()``.

Standard library only: processes that import nothing else use it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

PR_SET_PDEATHSIG = 1


def _prctl() -> Optional[Callable[..., int]]:
    """libc's ``prctl``, or None where there is none (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _request_kill_on_parent_death() -> bool:
    """Asks the kernel for SIGKILL when the parent exits; False where unsupported."""
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def signal_on_parent_death(sig: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen`` (called in the parent's main thread):
    the child asks the kernel for ``sig`` when this process dies (the setting
    survives the ``exec``), and exits if it died already. ``prctl`` is looked up
    here, in the parent: between fork and exec a child of a threaded parent must
    not import (the import lock may be held by a thread the fork left behind)."""
    prctl, parent = _prctl(), os.getpid()

    def ask() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return ask


def die_with_parent(parent_pid: Optional[int], poll: bool = False) -> None:
    """Makes this process die when its parent does; exits at once when the parent
    (``parent_pid``, if known) is already gone. ``poll``: where the kernel cannot
    help, a daemon thread checks the parent once a second instead."""
    armed = _request_kill_on_parent_death()
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the request took effect
    if armed or not poll or parent_pid is None:
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def killed_by(sig: int) -> str:
    """A signal that ended a process, in words for its one line."""
    try:
        name = signal.Signals(sig).name
    except ValueError:
        name = f"signal {sig}"
    text = f"killed by {name}"
    if sig == signal.SIGKILL:  # what a user most needs to know about it
        text += " (what the kernel's out-of-memory killer sends: see dmesg)"
    return text


def ended_by(returncode: int) -> str:
    """A child's return code (``subprocess``/``multiprocessing``: -N for signal N)
    in words: "exit 2", or "killed by SIGKILL (...)"."""
    return killed_by(-returncode) if returncode < 0 else f"exit {returncode}"


class Terminated(Exception):
    """SIGTERM arrived (SLURM's scancel or time limit, ``docker stop``, ``kill``)."""


_HOLD = {"depth": 0, "pending": None}  # signals_held: nesting, the exception held back


def _stop(signum, frame):
    stop = Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()
    if _HOLD["depth"]:
        _HOLD["pending"] = _HOLD["pending"] or stop
        return
    raise stop


@contextmanager
def stops_raise() -> Iterator[None]:
    """Within: SIGTERM raises ``Terminated`` and Ctrl-C ``KeyboardInterrupt`` in the
    main thread (not where ``signals_held`` holds them back), so that the work in
    progress is cleaned up instead of the process dying where it stands. A child
    forked within inherits the handlers: it must restore SIGTERM's default."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set a handler
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:  # a background job's ignored Ctrl-C stays so
            signal.signal(sig, _stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def signals_held() -> Iterator[None]:
    """Within: a stop (``stops_raise``) waits, and is raised at the end, so that what
    runs here (a rename of finished files, a cleanup) is not cut in two."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
        if not _HOLD["depth"] and _HOLD["pending"] is not None:
            stop, _HOLD["pending"] = _HOLD["pending"], None
            raise stop


__all__ = ["Terminated", "die_with_parent", "ended_by", "killed_by", "signal_on_parent_death",
           "signals_held", "stops_raise"]
