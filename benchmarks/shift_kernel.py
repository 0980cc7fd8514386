"""Forward+backward time of the KV shift alone: the reference ``shift_tokens``
(ordinary torch ops under autograd) against the fused Function (its torch path,
and its Triton kernels on a GPU), alternating after a warm-up; median and
minimum (for a shared machine) of ``--repeat`` runs. On a GPU it also prints
each one's peak memory above its inputs.

    .venv/bin/python benchmarks/shift_kernel.py [--seq 2048 --batch 2 --heads 8 --dim 64
        --window 1 --docs 4 --dtype fp32 --repeat 21]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from kvtrain.model.kv_shift import shift_tokens
from kvtrain.model import native_shift
from kvtrain.model.shift_kernels import fused_shift, triton_available


def step(fn, x, coef, doc_ids, dy) -> None:
    y = fn(x, coef, doc_ids)
    y.backward(dy)
    x.grad = coef.grad = None


def measure(fn, args, device: torch.device) -> tuple[float, int]:
    """Seconds of one fwd+bwd and the peak bytes it allocates (GPU only, else 0)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    start = time.perf_counter()
    step(fn, *args)
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter() - start, torch.cuda.max_memory_allocated() - base
    return time.perf_counter() - start, 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--window", type=int, default=1)
    p.add_argument("--docs", type=int, default=0, help="documents per sequence (0: no resets)")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--repeat", type=int, default=21)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    x = torch.randn(args.seq, args.batch, args.heads, args.dim, device=device, dtype=dtype,
                    requires_grad=True)
    coef = torch.rand(args.heads, args.window + 1, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    doc_ids = None
    if args.docs > 1:
        doc_ids = (torch.arange(args.seq, device=device) * args.docs // args.seq)[:, None]
        doc_ids = doc_ids.expand(args.seq, args.batch)
    impls = {"shift_tokens": shift_tokens, "fused (torch)": partial(fused_shift, impl="torch")}
    if device.type == "cuda" and triton_available():
        impls["fused (triton)"] = partial(fused_shift, impl="triton")
    if device.type == "cpu" and dtype == torch.float32 and native_shift.unavailable_reason() is None:
        impls["fused (native)"] = partial(fused_shift, impl="native")
    times = {name: [] for name in impls}
    peaks = {name: 0 for name in impls}
    for name, fn in impls.items():  # warm-up (and Triton compilation)
        for _ in range(3):
            step(fn, x, coef, doc_ids, dy)
    for _ in range(args.repeat):
        for name, fn in impls.items():
            seconds, peak = measure(fn, (x, coef, doc_ids, dy), device)
            times[name].append(seconds)
            peaks[name] = max(peaks[name], peak)
    ref = statistics.median(times["shift_tokens"])
    print(f"shift fwd+bwd, x [{args.seq}, {args.batch}, {args.heads}, {args.dim}] {args.dtype}, "
          f"window {args.window}, {max(args.docs, 1)} document(s), {device}, "
          f"{torch.get_num_threads()} thread(s), median of {args.repeat}")
    for name in impls:
        med = statistics.median(times[name])
        mem = f"  peak {peaks[name] / 2**20:8.1f} MiB" if device.type == "cuda" else ""
        best = min(times[name])
        print(f"  {name:15s} median {med * 1e3:8.3f} ms ({med / ref:5.2f} x shift_tokens), "
              f"min {best * 1e3:8.3f} ms ({best / min(times['shift_tokens']):5.2f} x){mem}")


if __name__ == "__main__":
    main()
