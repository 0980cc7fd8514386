"""Forward+backward time of the KV shift alone: the reference ``shift_tokens``
(ordinary torch ops under autograd) against the fused Function (its torch path,
and its Triton kernels on a GPU), alternating after a warm-up; median and
minimum (for a shared machine) of ``--repeat`` runs. On a GPU it also prints
each one's peak memory above its inputs.

    .venv/bin/python benchmarks/shift_kernel.py [--seq 2048 --batch 2 --heads 8 --dim 64
        --window 1 --docs 4 --dtype fp32 --repeat 21] [--qkv [--heads-per-group 1]]

``--qkv``: the paper's K+V shift as a layer runs it, from megatron's QKV output
``[s, b, heads, (heads_per_group + 2) * dim]`` to Q, K̂, V̂ and back to the QKV
output's gradient: ``fused_shift_qkv`` per kernel against vanilla's split
(views forward, one concatenation backward: what the shift replaces) and the
split followed by ``shift_tokens``. ``x vanilla`` is then the shift's cost.

``--qkv --rope``: the same with Q and K rotated after (kvtrain's Triton RoPE on a
GPU, megatron's ops on the CPU), as the layer runs them, against the node that
does the split, the shift and RoPE in one pass each way (``qkv_rope``, a GPU):
vanilla's and the KV shift's, each against vanilla's split and RoPE.
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial

import torch

from kvtrain.model.kv_shift import shift_tokens
from kvtrain.model import native_shift
from kvtrain.model.shift_kernels import fused_shift, fused_shift_qkv, triton_available


def step(fn, x, coef, doc_ids, dy) -> None:
    y = fn(x, coef, doc_ids)
    if isinstance(y, tuple):  # --qkv: (q, k, v) and their gradients
        torch.autograd.backward(y, dy)
    else:
        y.backward(dy)
    x.grad = None
    for c in (coef if isinstance(coef, tuple) else (coef,)):
        c.grad = None


def qkv_impls(device: torch.device, dtype: torch.dtype, q_width: int) -> dict:
    """``--qkv``: fn(mixed, (coef_k, coef_v), doc_ids) -> (q, k, v), per implementation."""
    def split(mixed, coefs, doc_ids):
        d = (mixed.shape[-1] - q_width) // 2
        return mixed.split([q_width, d, d], dim=-1)

    def reference(mixed, coefs, doc_ids):
        q, k, v = split(mixed, coefs, doc_ids)
        return q, shift_tokens(k, coefs[0], doc_ids), shift_tokens(v, coefs[1], doc_ids)

    impls = {"split (vanilla)": split, "shift_tokens": reference}
    kernels = ["torch"]
    if device.type == "cuda" and triton_available():
        kernels.append("triton")
    if device.type == "cpu" and dtype == torch.float32 and native_shift.unavailable_reason() is None:
        kernels.append("native")
    for kernel in kernels:
        impls[f"fused ({kernel})"] = partial(
            lambda m, c, ids, kernel: fused_shift_qkv(m, *c, ids, q_width, impl=kernel),
            kernel=kernel)
    return impls


def qkv_rope_impls(device: torch.device, s: int, q_width: int, d: int) -> dict:
    """``--qkv --rope``: fn(mixed, (coef_k, coef_v), doc_ids) -> (q', k', v) per path."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from kvtrain.model import qkv_rope, rope

    half = torch.rand(s, 1, 1, d // 2, device=device) * s
    freqs = torch.cat([half, half], dim=-1)  # megatron's layout
    gpu = device.type == "cuda" and rope.triton_rope.available()

    def rotate(t):
        return rope.fused_rope(t, freqs) if gpu else _apply_rotary_pos_emb_bshd(t, freqs)

    def split_rope(mixed, coefs, doc_ids):
        q, k, v = mixed.split([q_width, d, d], dim=-1)
        return rotate(q.reshape(*q.shape[:2], -1, d)), rotate(k), v

    def shift_rope(mixed, coefs, doc_ids):
        q, k, v = fused_shift_qkv(mixed, *coefs, doc_ids, q_width)
        return rotate(q.reshape(*q.shape[:2], -1, d)), rotate(k), v

    impls = {"split+RoPE (vanilla)": split_rope, "shift+RoPE": shift_rope}
    if gpu and qkv_rope.available():  # mixed is written over (V̂): timing only
        impls["qkv_rope (vanilla)"] = lambda m, c, ids: qkv_rope.qkv_rope(m, freqs, q_width)
        impls["qkv_rope (shift)"] = lambda m, c, ids: qkv_rope.qkv_rope(m, freqs, q_width,
                                                                         *c, ids)
    return impls


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


def main(argv: list[str] | None = None) -> None:
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
    p.add_argument("--qkv", action="store_true", help="K and V from the QKV output (above)")
    p.add_argument("--heads-per-group", type=int, default=1, help="--qkv: query heads per KV head")
    p.add_argument("--rope", action="store_true", help="--qkv: with RoPE of Q and K (above)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    s, b, h, d = args.seq, args.batch, args.heads, args.dim
    doc_ids = None
    if args.docs > 1:
        doc_ids = (torch.arange(s, device=device) * args.docs // s)[:, None].expand(s, b)

    def rand(*shape, grad=False):
        return torch.randn(*shape, device=device, dtype=dtype).requires_grad_(grad)

    if args.qkv:
        q_width = args.heads_per_group * d
        x = rand(s, b, h, q_width + 2 * d, grad=True)
        coef = tuple(torch.rand(h, args.window + 1, device=device, dtype=dtype,
                                requires_grad=True) for _ in range(2))
        dy = (rand(s, b, h, q_width), rand(s, b, h, d), rand(s, b, h, d))
        impls = qkv_impls(device, dtype, q_width)
        ref_name = "split (vanilla)"
        if args.rope:
            dy = (rand(s, b, h * args.heads_per_group, d), *dy[1:])
            impls = qkv_rope_impls(device, s, q_width, d)
            ref_name = "split+RoPE (vanilla)"
    else:
        x = rand(s, b, h, d, grad=True)
        coef = torch.rand(h, args.window + 1, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn_like(x)
        impls = {"shift_tokens": shift_tokens, "fused (torch)": partial(fused_shift, impl="torch")}
        if device.type == "cuda" and triton_available():
            impls["fused (triton)"] = partial(fused_shift, impl="triton")
        if (device.type == "cpu" and dtype == torch.float32
                and native_shift.unavailable_reason() is None):
            impls["fused (native)"] = partial(fused_shift, impl="native")
        ref_name = "shift_tokens"
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
    ref = statistics.median(times[ref_name])
    what = f"mixed {list(x.shape)}" if args.qkv else f"x {list(x.shape)}"
    print(f"shift fwd+bwd, {what} {args.dtype}, window {args.window}, "
          f"{max(args.docs, 1)} document(s), {device}, {torch.get_num_threads()} thread(s), "
          f"median of {args.repeat}")
    short = "vanilla" if args.qkv else "shift_tokens"
    for name in impls:
        med = statistics.median(times[name])
        mem = f"  peak {peaks[name] / 2**20:8.1f} MiB" if device.type == "cuda" else ""
        best = min(times[name])
        print(f"  {name:20s} median {med * 1e3:8.3f} ms ({med / ref:5.2f} x {short}), "
              f"min {best * 1e3:8.3f} ms ({best / min(times[ref_name]):5.2f} x){mem}")


if __name__ == "__main__":
    main()
