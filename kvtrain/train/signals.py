"""Stopping at a step boundary that every rank agrees on.

SIGTERM (SLURM's pre-emption/time-limit warning, ``kill``) and SIGUSR1
(``sbatch --signal=USR1@...``) only set a flag here. Once per step the trainer
sums the flags of all ranks in an all-reduce it already does (see
``loop.train_step``), so a signal delivered to a single rank, or to different
ranks at slightly different times, still makes every rank stop after the
same step, save one consistent checkpoint and exit 0. ``exit_duration_minutes``
is folded into the same all-reduce (clocks of ranks may disagree by a step).
"""

from __future__ import annotations

import signal
import time
from typing import Optional

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None))
                     if s is not None)


class StopRequests:
    """Flags set by signal handlers and by the wall-clock limit (local to a rank)."""

    def __init__(self, exit_duration_minutes: Optional[float] = None,
                 start_time: Optional[float] = None):
        self.start_time = time.monotonic() if start_time is None else start_time
        self.limit_s = exit_duration_minutes * 60.0 if exit_duration_minutes else None
        self.received: Optional[str] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequests":
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test harnesses)
                pass
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal API)
        # Only a flag: the step in flight finishes, then all ranks stop together.
        self.received = signal.Signals(signum).name

    @property
    def signal_flag(self) -> float:
        return 1.0 if self.received else 0.0

    @property
    def time_flag(self) -> float:
        if self.limit_s is None:
            return 0.0
        return 1.0 if time.monotonic() - self.start_time >= self.limit_s else 0.0

    def __enter__(self) -> "StopRequests":
        return self.install()

    def __exit__(self, *exc) -> bool:
        self.restore()
        return False
