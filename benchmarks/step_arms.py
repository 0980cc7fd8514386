"""One arm of ``benchmarks/step.py``: a run built with the trainer's setup and
stepped with the trainer's ``train_step``, timing each step and splitting it into
its phases; and the peak memory it adds to its process (``step.py``'s docstring
says what is counted on a GPU and on the CPU). Shared by ``peak_memory.py`` and
``host_work.py``, which build arms of their own."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvtrain.config import RunConfig  # noqa: E402


# ----------------------------------------------------------------------------- memory
def _proc_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{field_name}:\s+(\d+)", f.read()).group(1))


class PeakMemory:
    """The peak memory an arm adds to this process, in bytes (module docstring)."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.base = 0
        self.base_requested = 0

    def start(self) -> None:
        """Resets the peak to the present."""
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            self.base_requested = torch.cuda.memory_stats().get("requested_bytes.all.current", 0)
            return
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap back to the system
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        self.base = _proc_kib("VmRSS") * 1024

    def peak(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _proc_kib("VmHWM") * 1024 - self.base

    def requested(self) -> Optional[int]:
        """The peak of the bytes asked for since :meth:`start` (a GPU; None on the CPU,
        or where this torch's allocator keeps no such count)."""
        if not self.cuda:
            return None
        peak = torch.cuda.memory_stats().get("requested_bytes.all.peak")
        return None if peak is None else peak - self.base_requested


# ----------------------------------------------------------------------------- arms
class PhaseClock:
    """Where a step's time goes: forward-backward over the micro batches, then the rest
    (the loss's reduction, the gradient norm, clipping, the update), without a
    synchronization of its own: on a GPU CUDA events on the stream (the device's time,
    read after the step's closing synchronize; made once, recorded every step), on the
    CPU the host's clock. Marks: the start, the end of forward-backward, the end."""

    def __init__(self) -> None:
        self.cuda = torch.cuda.is_available()
        self.events = [torch.cuda.Event(enable_timing=True) for _ in range(3)] \
            if self.cuda else []
        self.marks = [0.0] * 3

    def mark(self, i: int) -> None:
        if self.cuda:
            self.events[i].record()
        else:
            self.marks[i] = time.perf_counter()

    def phases(self) -> tuple[float, float]:
        """(forward-backward, the rest) in seconds, after the step's synchronize."""
        if self.cuda:
            a, b, c = self.events
            return a.elapsed_time(b) / 1e3, b.elapsed_time(c) / 1e3
        a, b, c = self.marks
        return b - a, c - b


@dataclass
class Arm:
    name: str
    run: Any  # kvtrain.train.setup.Run
    iterators: list
    forward_step: Any
    peak_bytes: Optional[int] = None
    requested_bytes: Optional[int] = None  # the peak of the bytes asked for (a GPU)
    times: list = field(default_factory=list)
    grad_norms: list = field(default_factory=list)  # of the timed steps
    phases: list = field(default_factory=list)  # (forward-backward, rest) of the timed steps
    clock: PhaseClock = field(default_factory=PhaseClock)

    def step(self, timed: bool = False) -> None:
        """One trainer step; ``timed``: its wall time, gradient norm and phases recorded."""
        from kvtrain.train.step import train_step

        run, t, clock = self.run, self.run.cfg.train, self.clock
        self.forward_step.iteration += 1

        def forward_backward(**kwargs):
            out = run.forward_backward(**kwargs)
            clock.mark(1)
            return out

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        clock.mark(0)
        result = train_step(forward_backward, self.forward_step, self.iterators,
                            run.model, run.optimizer, run.scheduler, run.num_microbatches,
                            t.seq_length, t.micro_batch_size, (0.0, 0.0))
        clock.mark(2)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if timed:
            self.times.append(time.perf_counter() - started)
            self.grad_norms.append(result.outcome.grad_norm)
            self.phases.append(clock.phases())


def build_arm(name: str, cfg: RunConfig, run_dir: Path, env, warmup: int,
              measure: bool) -> Arm:
    """Builds one arm and warms it up, measuring its peak memory if ``measure``."""
    from kvtrain.backend import set_seed
    from kvtrain.data import micro_batches
    from kvtrain.train.setup import build_run
    from kvtrain.train.step import ForwardStep

    memory = PeakMemory()
    if measure:
        memory.start()
    set_seed(cfg.train.seed)
    run = build_run(cfg, run_dir, env)
    t = cfg.train
    iterators = [micro_batches(run.datasets.train, 0, t.micro_batch_size, run.dp_rank,
                               run.dp_size, cfg.data.num_workers) for _ in run.model]
    arm = Arm(name, run, iterators, ForwardStep())
    for _ in range(warmup):
        arm.step()
    if measure:
        arm.peak_bytes, arm.requested_bytes = memory.peak(), memory.requested()
    return arm


def time_arms(arms: list[Arm], steps: int) -> None:
    """``steps`` timed steps per arm, alternating, the order flipped every round."""
    for i in range(steps):
        for arm in (arms if i % 2 == 0 else arms[::-1]):
            arm.step(timed=True)


def init_env(cfg: RunConfig):
    """The distributed environment of ``cfg``'s layout (the trainer's own init)."""
    from kvtrain.backend import init_distributed

    p, t = cfg.parallel, cfg.train
    return init_distributed(p.tensor, p.pipeline, p.virtual_pipeline, p.context, seed=t.seed,
                            timeout_minutes=t.dist_timeout_minutes, device=t.device)
