"""What the GPU micro-benchmarks (``cross_entropy.py``, ``swiglu.py``) share: each
variant timed with CUDA events, in rounds whose order flips every round (after one
warm-up call each, which also compiles the Triton kernels), and the memory each
allocated at its peak; their command line's common options, the one-line refusal
without a GPU and the JSON they write."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Optional

import torch


def timed(fn: Callable[[], object]) -> tuple[float, int]:
    """ms of ``fn()`` on the GPU, and the bytes it allocated above what was held when
    it started, at its peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end), torch.cuda.max_memory_allocated() - held


def alternate(variants: tuple[str, ...], one_round: Callable[[str], tuple[float, int]],
              rounds: int) -> tuple[dict[str, float], dict[str, int]]:
    """(median ms, largest peak bytes) per variant of ``one_round(variant)`` (a
    :func:`timed` result) over ``rounds`` rounds, the order flipping every round."""
    for name in variants:  # compile and warm up
        one_round(name)
    times: dict = {name: [] for name in variants}
    peaks: dict = {name: [] for name in variants}
    for i in range(rounds):
        for name in variants[::-1] if i % 2 else variants:
            ms, peak = one_round(name)
            times[name].append(ms)
            peaks[name].append(peak)
    return ({name: statistics.median(v) for name, v in times.items()},
            {name: max(v) for name, v in peaks.items()})


def parser(doc: str, dtypes) -> argparse.ArgumentParser:
    """The options every micro-benchmark takes: --tokens, --dtype, --rounds, --json."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--dtype", choices=sorted(dtypes), default="bf16")
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", metavar="PATH")
    return p


def refused_without_gpu(why: str) -> bool:
    """True (and ``why`` said in one line) where there is no GPU to time on."""
    if torch.cuda.is_available():
        return False
    print(why)
    return True


def write_json(path: Optional[str], result: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
