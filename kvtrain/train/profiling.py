"""Traces of chosen training steps: where a step's time and memory go on the user's own
hardware and backend (Transformer Engine, NCCL, a cluster's file system: the paths no
CPU test times).

``profile.start_step`` .. ``start_step + num_steps - 1`` run under ``torch.profiler`` on
each rank of ``profile.ranks`` (the step before them too, untraced: the profiler's
warm-up, where this start runs it). Each traced rank writes into
``<profile dir>/iter_AAAAAAA-BBBBBBB/`` (the iterations it traced):

- ``rankRRRRR.trace.json.gz``: the trace, for ui.perfetto.dev or chrome://tracing; each
  step inside a ``kvtrain iteration N`` range;
- ``rankRRRRR.ops.txt``: the profiler's operator table, by self device time on a GPU,
  self CPU time on the CPU;
- ``rankRRRRR.memory.pickle`` (``profile.memory_history``, GPU): the caching allocator's
  snapshot with its history over the traced steps, for pytorch.org/memory_viz.

Each file is written under a temporary name and renamed whole. A stop inside the window
(a signal, the time limit, an error) writes what was traced so far. The window is in
iteration numbers: a start resumed past it traces nothing and says so; one resumed
inside it traces the rest. Rank 0 prints where the traces go and records an event in
metrics.jsonl; the steps traced are slower (the log's step times show it).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from kvtrain.config import ConfigError, ProfileConfig, make_folder, profile_folder

from .metrics import MetricsLogger, say

OPS_ROWS = 60  # the operator table's rows: the costly ones
MEMORY_ENTRIES = 200_000  # allocator events kept (megatron's --record-memory-history: 100k)


@dataclass(frozen=True)
class Window:
    """The iterations this start traces (``first``..``last``) and whether the one
    before them runs under the profiler untraced (``warmup``: 0 or 1)."""

    first: int
    last: int
    warmup: int

    @property
    def name(self) -> str:
        return f"iter_{self.first:07d}-{self.last:07d}"

    def text(self) -> str:
        return f"iteration {self.first}" if self.first == self.last else \
            f"iterations {self.first}-{self.last}"


def window_of(cfg: ProfileConfig, begin: int, total_steps: int) -> tuple[Optional[Window], str]:
    """The window of this start, whose first iteration is ``begin``, in a run of
    ``total_steps``; and the line that says what is traced (or why nothing is)."""
    asked_last = cfg.start_step + cfg.num_steps - 1
    asked = Window(cfg.start_step, asked_last, 0).text()
    first, last = max(cfg.start_step, begin), min(asked_last, total_steps)
    if first > last:
        return None, (f"{asked} ran before this start (resumed at iteration {begin - 1}): "
                      "not traced")
    window = Window(first, last, 1 if first > begin else 0)
    before = f"{cfg.start_step}" + (f"-{first - 1}" if first - 1 > cfg.start_step else "")
    cut = [] if first == cfg.start_step else [f"{before} ran before this start"]
    cut += [] if last == asked_last else [f"the run ends at {total_steps}"]
    return window, f"tracing {window.text()}" + (f" ({'; '.join(cut)})" if cut else "")


def check_profile_start(cfg: ProfileConfig, device: str, total_steps: int, run_dir: Path,
                        rank: int) -> None:
    """What the config alone cannot say: a window after the run's last step, a CUDA
    history on a run without a GPU, a traces' folder that cannot be made (on a traced
    rank). One ``ConfigError`` line, before any work."""
    if cfg.start_step is None:
        return
    if cfg.start_step > total_steps:
        raise ConfigError(f"profile.start_step ({cfg.start_step}) is after the run's last "
                          f"step ({total_steps}): nothing would be traced")
    if cfg.memory_history and device != "cuda":
        raise ConfigError(f"profile.memory_history records the CUDA caching allocator: this "
                          f"run is on the {device} (set it false)")
    if rank in cfg.ranks:
        make_folder(profile_folder(cfg.dir, run_dir), "profile.dir")


class StepProfiler:
    """Runs the steps of a window under ``torch.profiler`` on a traced rank
    (:meth:`step` around each step), writes their files when the window ends or at
    :meth:`close`. On other ranks, and outside the window, :meth:`step` does nothing."""

    def __init__(self, cfg: ProfileConfig, window: Optional[Window], folder: Path, rank: int,
                 device: str, metrics: Optional[MetricsLogger] = None):
        self.cfg, self.window, self.rank, self.device = cfg, window, rank, device
        self.folder = folder / window.name if window else folder
        self.metrics = metrics  # rank 0's: the event at the window's end
        self.traced = window is not None and rank in cfg.ranks
        self._profiler = None
        self._history = False
        self._ran: Optional[tuple[int, int]] = None  # the window's iterations run so far

    @classmethod
    def for_start(cls, cfg: ProfileConfig, run_dir: Path, rank: int, device: str,
                  begin: int, total_steps: int,
                  metrics: Optional[MetricsLogger] = None) -> "StepProfiler":
        """The profiler of a start whose first iteration is ``begin``; rank 0 says what
        it traces. The traces' folder is made by the traced ranks (one line if it
        cannot be)."""
        if cfg.start_step is None:
            return cls(cfg, None, Path(run_dir), rank, device)
        window, line = window_of(cfg, begin, total_steps)
        root = profile_folder(cfg.dir, run_dir)
        profiler = cls(cfg, window, root, rank, device, metrics)
        ranks = ", ".join(map(str, cfg.ranks))
        say(f"kvtrain: profile: {line}" + (f" on rank(s) {ranks} into {profiler.folder}"
                                            if window else ""))
        if profiler.traced:  # under the folder check_profile_start made
            make_folder(profiler.folder, "profile.dir")
        return profiler

    @contextlib.contextmanager
    def step(self, iteration: int) -> Iterator[None]:
        """Around training step ``iteration``."""
        w = self.window
        if w is None or not w.first - w.warmup <= iteration <= w.last:
            yield
            return
        if self.traced and self._profiler is None:
            self._start()
        if iteration == w.first:
            if self.traced and self.cfg.memory_history:
                torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
                self._history = True
        label = f"kvtrain iteration {iteration}"
        with torch.profiler.record_function(label) if self.traced else contextlib.nullcontext():
            yield
        if self.traced:
            self._profiler.step()
        if iteration >= w.first:
            self._ran = (w.first, iteration)
        if iteration == w.last:
            self.close()

    def _start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU]
        if self.device == "cuda":
            activities.append(ProfilerActivity.CUDA)
        w = self.window
        self._profiler = profile(
            activities=activities, record_shapes=self.cfg.record_shapes,
            with_stack=self.cfg.with_stack, on_trace_ready=self._write_trace,
            schedule=schedule(wait=0, warmup=w.warmup, active=w.last - w.first + 1, repeat=1))
        self._profiler.start()

    def close(self) -> None:
        """Ends the window (at its last step, or at a stop inside it): the traced ranks
        write what they traced; rank 0 says where and records it. Idempotent."""
        profiler, self._profiler = self._profiler, None
        if profiler is not None:
            profiler.stop()  # inside the window: its trace, of the steps so far, is ready
        if self._history:
            self._history = False
            self._write(f"rank{self.rank:05d}.memory.pickle",
                        lambda tmp: torch.cuda.memory._dump_snapshot(tmp))
            torch.cuda.memory._record_memory_history(enabled=None)
        ran, self._ran = self._ran, None
        if ran and self.rank == 0 and self.metrics is not None:
            message = f"profile: {Window(*ran, 0).text()} traced into {self.folder}"
            self.metrics.write({"kind": "event", "iteration": ran[1], "message": message},
                               echo=False)
            say(f"kvtrain: {message}")

    def _write_trace(self, profiler) -> None:
        """The trace and the operator table (torch.profiler's ``on_trace_ready``)."""
        self._write(f"rank{self.rank:05d}.trace.json.gz", profiler.export_chrome_trace)
        sort = "self_device_time_total" if self.device == "cuda" else "self_cpu_time_total"
        # (torch's own parse of the events can fail: with_stack at a stop inside the
        # window, torch 2.13's UnicodeDecodeError; the table is then left out)
        self._write(f"rank{self.rank:05d}.ops.txt", lambda tmp: Path(tmp).write_text(
            profiler.key_averages().table(sort_by=sort, row_limit=OPS_ROWS) + "\n"))

    def _write(self, name: str, write) -> None:
        """``write(tmp)`` then a rename to ``name``: a reader never sees half a file; a
        failure (a full disk, the profiler's own) is a warning, the training goes on."""
        path = self.folder / name
        tmp = path.with_name(f".{name}.tmp{os.getpid()}{path.suffix}")  # (.gz: gzipped)
        try:
            write(str(tmp))
            os.replace(tmp, path)
        except Exception as e:  # noqa: BLE001 - an auxiliary file: never the run's end
            print(f"kvtrain: warning: rank {self.rank}: cannot write the profile's {path}: "
                  f"{e if isinstance(e, OSError) else f'{type(e).__name__}: {e}'}", flush=True)
            tmp.unlink(missing_ok=True)


__all__ = ["StepProfiler", "Window", "check_profile_start", "window_of"]
