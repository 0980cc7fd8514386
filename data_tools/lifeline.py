"""Dying with the parent: the one helper every child process of kvtrain uses.

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
from typing import Optional

PR_SET_PDEATHSIG = 1


def _request_kill_on_parent_death() -> bool:
    """Asks the kernel for SIGKILL when the parent exits; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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


__all__ = ["die_with_parent", "ended_by", "killed_by"]
