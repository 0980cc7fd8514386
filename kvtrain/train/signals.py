"""Stopping at a step boundary that every rank agrees on.

SIGTERM (SLURM's pre-emption/time-limit warning, ``kill``) and SIGUSR1
(``sbatch --signal=USR1@...``) only set a flag here. Once per step the trainer
sums the flags of all ranks in an all-reduce it already does (see
``loop.train_step``), so a signal delivered to a single rank, or to different
ranks at slightly different times, still makes every rank stop after the
same step, save one consistent checkpoint and exit 0. ``exit_duration_minutes``
is folded into the same all-reduce (clocks of ranks may disagree by a step).

Ctrl-C (SIGINT) is a stop request too, said in one line: a researcher who
stops an interactive run loses nothing. A second Ctrl-C quits at once, without
that checkpoint (``KeyboardInterrupt``). One press may arrive twice (the
terminal's SIGINT to its process group and a launcher's relay of it): a second
SIGINT within ``SAME_PRESS_S`` of the first is that same press. torchrun starts
its workers in sessions of their own, out of the terminal's reach: its relay
(``launch/torchrun.sh``'s) is what they get.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

STOP_SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), getattr(signal, "SIGUSR1", None))
                     if s is not None)
SAME_PRESS_S = 1.0  # a second SIGINT sooner than this is the first one, relayed
INTERRUPT_LINE = ("kvtrain: Ctrl-C: stopping after this step with a checkpoint; Ctrl-C "
                  "again quits at once, without one\n")


class StopRequests:
    """Flags set by signal handlers and by the wall-clock limit (local to a rank)."""

    def __init__(self, exit_duration_minutes: Optional[float] = None,
                 start_time: Optional[float] = None, announce: bool = True):
        self.start_time = time.monotonic() if start_time is None else start_time
        self.limit_s = exit_duration_minutes * 60.0 if exit_duration_minutes else None
        self.received: Optional[str] = None
        self.announce = announce  # say the Ctrl-C line (one rank of a node says it)
        self._interrupted_at: Optional[float] = None
        self._previous: dict[int, object] = {}

    def install(self) -> "StopRequests":
        handlers = {sig: self._handle for sig in STOP_SIGNALS}
        handlers[signal.SIGINT] = self._interrupt
        for sig, handler in handlers.items():
            try:
                self._previous[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread (e.g. some test harnesses)
                pass
        return self

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 (signal API)
        # Only a flag: the step in flight finishes, then all ranks stop together.
        self.received = self.received or signal.Signals(signum).name

    def _interrupt(self, signum, frame) -> None:  # noqa: ARG002 (signal API)
        now = time.monotonic()
        if self._interrupted_at is None:
            self._interrupted_at = now
            self._handle(signum, frame)
            if self.announce:  # os.write: print() may be mid-write in this thread
                os.write(2, INTERRUPT_LINE.encode())
        elif now - self._interrupted_at >= SAME_PRESS_S:
            raise KeyboardInterrupt

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
