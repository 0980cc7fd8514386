"""Where one trainer step's time goes, per arm of ``benchmarks/step.py --profile``.

After the timed steps, one more step of each arm runs under ``torch.profiler``
(its time is not among the timed ones). For each arm the result holds:

* ``wall_ms``: the profiled step's wall time (the profiler's own cost included);
* on a GPU, ``device_busy_ms`` and ``kernels``: the summed time and the number
  of the step's kernels, and ``busy`` = busy / wall. A busy fraction well below
  1 says the GPU waits for the host to launch work (a launch-bound step, as
  small shapes are): then fewer kernels pay, not faster ones;
* ``host_ops``: operator calls on the host (aten and custom operators, nested
  calls included): what a launch-bound step spends its time on;
* ``top``: the entries with the most self time (kernels on a GPU, operators on
  the CPU): ``[name, ms, calls]``.

``extra`` lists what the KV shift changes, ``[name, kv_shift ms - vanilla ms,
calls in kv_shift - calls in vanilla]``: every entry called a different number
of times (the shift's kernels, and the ops they replace), and the entries whose
self time grows most; those only one arm has come first. The result of a GPU run lands in the
step JSON, so that one call of a lent GPU also says why a target was missed.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

TOP = 12
NAME_WIDTH = 100  # kernel names are whole C++ templates
# Namespaces and qualifiers that fill a CUDA kernel's name before what tells it apart
# (the H200's profile: "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<
# at::native::(anonymous namespace):" named every multi-tensor kernel alike).
_NOISE = ("void ", "at::native::", "(anonymous namespace)::", "std::", "c10::")


def short_name(key: str) -> str:
    """An operator's or kernel's name, without :data:`_NOISE`, cut to NAME_WIDTH."""
    for noise in _NOISE:
        key = key.replace(noise, "")
    return key[:NAME_WIDTH]


def _entries(prof, on_gpu: bool) -> dict[str, tuple[float, int]]:
    """name -> (self ms, calls): kernels on a GPU, host operators on the CPU."""
    entries: dict[str, tuple[float, int]] = {}
    for event in prof.key_averages():
        if getattr(event, "is_user_annotation", False):
            continue  # record_function ranges (e.g. Optimizer.step) span kernels and gaps
        if on_gpu:
            if event.device_type != DeviceType.CUDA:
                continue
            us = getattr(event, "self_device_time_total", None)
            us = event.self_cuda_time_total if us is None else us
        else:
            us = event.self_cpu_time_total
        name = short_name(event.key)
        ms, calls = entries.get(name, (0.0, 0))
        entries[name] = (ms + us / 1e3, calls + event.count)
    return entries


def _host_ops(prof) -> int:
    """Operator calls on the host: events named ``namespace::op`` (aten, kvtrain, ...)."""
    return sum(e.count for e in prof.key_averages()
               if e.device_type == DeviceType.CPU and "::" in e.key
               and not e.key.startswith(("autograd::", "cuda")))


def profile_step(step: Callable[[], float]) -> dict:
    """Runs ``step`` once under the profiler: the record described above."""
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        step()
        wall_ms = (time.perf_counter() - started) * 1e3
    entries = _entries(prof, on_gpu)
    ranked = sorted(entries.items(), key=lambda kv: -kv[1][0])
    record = {"wall_ms": round(wall_ms, 3), "host_ops": _host_ops(prof),
              "device_busy_ms": None, "kernels": None, "busy": None,
              "top": [[name, round(ms, 4), calls] for name, (ms, calls) in ranked[:TOP]],
              "entries": entries}
    if on_gpu:
        busy = sum(ms for ms, _ in entries.values())
        record.update(device_busy_ms=round(busy, 3), busy=round(busy / wall_ms, 4),
                      kernels=sum(calls for _, calls in entries.values()))
    return record


def added_by_the_shift(vanilla: dict, shifted: dict, top: int = TOP) -> list:
    """What changes from vanilla to KV shift: every entry called a different number
    of times (the shift's own kernels and operators, and what they replace), and
    the ``top`` entries whose self time grows most. Entries only one arm has lead
    (the shift's own kernels, and what they replace), whatever their time: a summary
    shows the first few, and on a noisy host a busy op both arms run would otherwise
    push the shift's own out. Within each group, by time added."""
    rows, own = [], set()
    for name in set(vanilla["entries"]) | set(shifted["entries"]):
        if (name in vanilla["entries"]) != (name in shifted["entries"]):
            own.add(name)
        ms_v, calls_v = vanilla["entries"].get(name, (0.0, 0))
        ms_k, calls_k = shifted["entries"].get(name, (0.0, 0))
        rows.append([name, round(ms_k - ms_v, 4), calls_k - calls_v])
    rows.sort(key=lambda row: -row[1])
    grown = {row[0] for row in rows[:top] if row[1] > 0}
    rows = [row for row in rows if row[2] != 0 or row[0] in grown]
    return [row for row in rows if row[0] in own] + [row for row in rows if row[0] not in own]


def profiles(steps: dict[str, Callable[[], float]]) -> dict:
    """``{"arms": {arm: record}, "extra": ...}`` for the arms ``vanilla`` and ``kv_shift``."""
    arms = {name: profile_step(step) for name, step in steps.items()}
    extra = added_by_the_shift(arms["vanilla"], arms["kv_shift"])
    for record in arms.values():
        del record["entries"]  # the full lists stay out of the JSON
    return {"arms": arms, "extra": extra}


def profile_table(result: Optional[dict]) -> str:
    """A few lines for the benchmark's output."""
    if not result:
        return ""
    lines = []
    for name, r in result["arms"].items():
        gpu = ("" if r["busy"] is None else
               f", {r['kernels']} kernels busy {r['device_busy_ms']:.1f} ms ({r['busy']:.0%})")
        top = "; ".join(f"{n[:40]} {ms:.2f}" for n, ms, _ in r["top"][:3])
        lines.append(f"profile {name:9s}: {r['wall_ms']:.1f} ms, {r['host_ops']} host ops"
                     f"{gpu}; top: {top}")
    added = "; ".join(f"{n[:50]} {ms:+.3f} ms ({calls:+d} calls)"
                      for n, ms, calls in result["extra"][:6])
    lines.append(f"profile: what the KV shift changes: {added or 'nothing measurable'}")
    return "\n".join(lines)
