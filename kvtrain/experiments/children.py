"""The training runs a runner starts (a sweep's cells, an experiment's arms, the
demo's two arms) stop with it, each at a step with a checkpoint.

A runner used to stop its runs only on Ctrl-C, with ``terminate`` in a
``finally``, and a terminal's Ctrl-C reached the runs too: they died mid-step,
without a checkpoint. ``kill`` of the runner (SIGTERM: ``scancel``, ``timeout``,
a script) or its death (SIGKILL, the out-of-memory killer) left them training
as orphans, holding their folders' locks against the command that would
continue them. Now:

* each run is a process group of its own, so the signals of the runner's
  terminal reach the runner alone, and the runner passes a stop on as SIGUSR1 to
  the trainers (the run itself, or torchrun's children), the trainer's stop
  request (``kvtrain.train.signals``): it stops after its step in flight, saves
  a checkpoint and exits 0. Not to torchrun, which, signalled, tears its ranks
  down and exits 1 with a traceback (as ``launch/torchrun.sh`` does). A run
  starts with SIGUSR1 ignored, so that one sent before the trainer has set its
  handler (its imports take seconds) is lost, not fatal: it is repeated every
  few seconds until the run ends;
* the runner waits for them (``stop_runs``); a second stop kills them, which
  leaves each its last complete checkpoint (a checkpoint is written aside and
  renamed whole), and a run so killed says so (``ended``), not the
  out-of-memory killer. One stop may arrive twice: ``timeout``, ``scancel`` and a
  terminal's Ctrl-C signal the runner and its process group, a launcher relays
  it. A second stop within ``SAME_PRESS_S`` (the trainer's) of the first is that
  same stop (``_Stops``): it used to kill the runs, some steps after their last
  checkpoint;
* each run asks the kernel for SIGTERM at the runner's death (``start_run``:
  ``PR_SET_PDEATHSIG``), so that the runs of a runner killed outright still save
  and stop: a trainer takes SIGTERM as its stop request, and torchrun passes it
  on to its ranks and gives them ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds to
  save (600 here, as in ``launch/torchrun.sh``; torch's default is 30).

Under torchrun the ranks die with it however it ends (``kvtrain.train.processes``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import weakref
from contextlib import contextmanager
from functools import partial
from typing import Callable, Iterator, Optional

from data_tools.lifeline import (Terminated, ended_by, signal_on_parent_death, signals_held,
                                 stops_raise)
from kvtrain.train.signals import SAME_PRESS_S
from kvtrain.train.writer_watch import children

# Launcher variables of an enclosing torchrun/SLURM job: a run is a job of its own.
LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
STOPS = (KeyboardInterrupt, Terminated)  # what data_tools.lifeline.stops_raise raises
REPEAT_S = 5.0  # a stop request is sent again after this long, until the run ends
KILLED = "killed by the runner after a second stop request"  # ended's words for its kill
_killed: "weakref.WeakSet[subprocess.Popen]" = weakref.WeakSet()  # the runs stop_runs killed


def start_run(command: list[str], env: Optional[dict] = None, **popen) -> subprocess.Popen:
    """``subprocess.Popen(command, env=env, **popen)`` of a run that stops with this
    process, without an enclosing launcher's variables (``LAUNCHER_ENV``). Call it
    from the main thread (the kernel's request follows the thread that forks)
    within ``signals_held``, so that a stop cannot fall between the fork and the
    caller's record of the run."""
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k not in LAUNCHER_ENV}
    env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "600")
    ask = signal_on_parent_death(signal.SIGTERM)

    def prepare() -> None:  # in the child, before exec
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until the trainer sets its handler
        ask()

    # stdin: a process group not in the terminal's foreground that reads it (a login
    # prompt) would be stopped by SIGTTIN, and the runner wait for it forever
    popen.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.Popen(command, env=env, process_group=0, preexec_fn=prepare, **popen)


def _trainers(proc: subprocess.Popen) -> list[int]:
    """The trainer processes of a run: torchrun's children, or the run itself."""
    if "torch.distributed.run" in proc.args:
        return children(proc.pid)
    return [proc.pid]


def _ask_to_stop(runs: list[subprocess.Popen]) -> None:
    for proc in runs:
        for pid in _trainers(proc) if proc.poll() is None else ():
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:  # it ended meanwhile
                pass


def stopped_by(stop: BaseException) -> str:
    """The stop ``stops_raise`` raised, in words."""
    return "SIGTERM" if isinstance(stop, Terminated) else "Ctrl-C"


def ended(proc: subprocess.Popen) -> str:
    """How a run ended, in words: ``KILLED`` for one ``stop_runs`` killed, else
    ``data_tools.lifeline.ended_by`` ("exit 1", "killed by SIGKILL (...)")."""
    return KILLED if proc in _killed else ended_by(proc.returncode)


class _Stops:
    """A runner's stops (SIGTERM, Ctrl-C) from the first on: each raises as
    ``stops_raise`` makes it (held within ``signals_held``), save one within
    ``SAME_PRESS_S`` of the first, which is that first one delivered twice."""

    def __init__(self, first: Optional[float] = None):
        self.first = first  # when the first came (time.monotonic())

    def handle(self, raise_stop, signum, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
        elif now - self.first < SAME_PRESS_S:
            return  # the same stop again: the process's and its group's, or a relay's
        raise_stop(signum, frame)

    @contextmanager
    def raising(self) -> Iterator[None]:
        """``stops_raise``, its stops let through ``handle``."""
        with stops_raise():
            if threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT):
                    handler = signal.getsignal(sig)
                    if callable(handler):  # stops_raise's (not an ignored Ctrl-C)
                        signal.signal(sig, partial(self.handle, handler))
            yield


def stop_runs(runs: dict[str, subprocess.Popen], why: Optional[str],
              stops: Optional[_Stops] = None) -> list[str]:
    """Asks every run still going to stop (SIGUSR1 to its trainers, every
    ``REPEAT_S`` seconds) and waits for them; a second stop (Ctrl-C, SIGTERM)
    kills them, one within ``SAME_PRESS_S`` of the first excepted (``_Stops``).
    ``why``: the stop, in words, for the line said first (None: said nothing, as
    for a runner's own error, after which any stop kills). ``stops``: the
    caller's, which saw the first stop (None, or one that did not see it: it came
    now). The names of the runs it stopped."""
    stops = stops or _Stops()
    if why is not None and stops.first is None:
        stops.first = time.monotonic()
    going = {name: p for name, p in runs.items() if p.poll() is None}
    if not going:
        return []
    if why is not None:
        print(f"kvtrain: {why}: stopping {', '.join(going)} at their next step (a second "
              f"Ctrl-C or SIGTERM kills them)", flush=True)
    try:
        with stops.raising():
            while any(proc.poll() is None for proc in going.values()):
                _ask_to_stop(list(going.values()))
                until = time.monotonic() + REPEAT_S
                for proc in going.values():
                    try:
                        proc.wait(timeout=max(0.0, until - time.monotonic()))
                    except subprocess.TimeoutExpired:
                        pass
    except STOPS:
        for proc in going.values():
            if proc.poll() is None:
                proc.kill()
                _killed.add(proc)
        for proc in going.values():
            proc.wait()
        print(f"kvtrain: killed {', '.join(going)}: each keeps its last complete checkpoint",
              flush=True)
    return list(going)


def run_all(names: list[str], start: Callable[[str], subprocess.Popen],
            finish: Callable[[str, subprocess.Popen], None], workers: int,
            stopped_line: Callable[[list[str]], str]) -> None:
    """Runs ``start(name)`` (a ``start_run``) for each of ``names``, ``workers`` at a
    time, and ``finish(name, proc)`` as each ends, both whole (a stop waits for
    them). Stopped (Ctrl-C, SIGTERM), it stops the runs still going (``stop_runs``),
    finishes them, says ``stopped_line(their names)`` and raises the stop; on its
    own error it stops them too, silently. From the first stop to the end its
    handler stays (``_Stops``): a copy of that stop, which may come as it is being
    acted on, is no second one."""
    pending, running = list(names), {}
    stops = _Stops()
    with stops.raising():
        try:
            while pending or running:
                while pending and len(running) < max(1, workers):
                    name = pending.pop(0)
                    with signals_held():
                        running[name] = start(name)
                for name, proc in list(running.items()):
                    if proc.poll() is not None:
                        with signals_held():
                            del running[name]
                            finish(name, proc)
                time.sleep(0.2)
        except BaseException as e:  # a stop, or this process's own error: no orphan trains on
            stopping = isinstance(e, STOPS)
            stopped = stop_runs(running, stopped_by(e) if stopping else None, stops)
            with signals_held():  # whole: a later stop waits for the records of the runs
                for name, proc in running.items():
                    finish(name, proc)
                if stopping and stopped:
                    print(stopped_line(stopped), flush=True)
            raise
