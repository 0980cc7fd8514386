"""torch's AdamW update on its ``foreach`` path against its ``fused`` kernel, inside
the trainer's own optimizer (what ``kvtrain.train.optimizer.use_fused_adamw`` chose).

    python benchmarks/optimizer_step.py [CONFIG] [--set KEY=VALUE ...] [--rounds 20]
                                        [--warmup 3]

Builds CONFIG (default ``configs/demo.yaml``, mock data) with the trainer's setup,
takes ``--warmup`` trainer steps (the AdamW state exists, the gradients are real),
then for ``--rounds`` rounds times both kernels, alternating and flipping the order
every round: the inner torch optimizers' ``step()`` alone (``inner step``), and one
whole trainer step (forward, backward, gradient norm, update: ``train step``).
Prints the median of each, in ms. Without TE or apex only (it refuses otherwise:
their FusedAdam has no such flags).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

KERNELS = ("foreach", "fused")


def use_kernel(optimizer, kernel: str) -> None:
    """Every param group of torch's AdamW on ``kernel``, its steps where it reads them."""
    from kvtrain.train.optimizer import adam_step, inner_optimizers

    for inner in inner_optimizers(optimizer):
        for group in inner.param_groups:
            group["fused"], group["foreach"] = kernel == "fused", kernel == "foreach"
            for p in group["params"]:
                step = inner.state.get(p, {}).get("step")
                if step is not None:
                    inner.state[p]["step"] = adam_step(group, p, float(step))


def timed(fn) -> float:
    """``fn``'s wall time in ms (the device drained before and after)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def measure(config: str, sets: list[str], rounds: int, warmup: int, scratch: Path) -> dict:
    from kvtrain.backend import init_distributed, set_seed
    from kvtrain.config import load_config
    from kvtrain.train.loop import _data_iterators
    from kvtrain.train.optimizer import FUSED, inner_optimizers
    from kvtrain.train.setup import build_run
    from kvtrain.train.step import ForwardStep, train_step

    cfg = load_config(config, ["data.type=mock", "train.eval_interval=null", *sets])
    p, t = cfg.parallel, cfg.train
    env = init_distributed(p.tensor, p.pipeline, p.virtual_pipeline, p.context, seed=t.seed,
                           device=t.device)
    set_seed(t.seed)
    run = build_run(cfg, scratch, env)
    if run.backend.optimizer != FUSED:
        raise SystemExit(f"the update is {run.backend.optimizer}: nothing to compare")
    iterators, forward = _data_iterators(run, 0), ForwardStep()

    def train() -> None:
        train_step(run.forward_backward, forward, iterators, run.model, run.optimizer,
                   run.scheduler, run.num_microbatches, t.seq_length, t.micro_batch_size,
                   (0.0, 0.0))

    def inner_step() -> None:
        for inner in inner_optimizers(run.optimizer):
            inner.step()  # the gradients of the last backward, still on the main params

    for _ in range(warmup):
        train()
    times: dict = {(k, what): [] for k in KERNELS for what in ("inner", "train")}
    for i in range(rounds):
        for kernel in KERNELS[::-1] if i % 2 else KERNELS:
            use_kernel(run.optimizer, kernel)
            times[kernel, "inner"].append(timed(inner_step))
            times[kernel, "train"].append(timed(train))
    params = sum(p.numel() for inner in inner_optimizers(run.optimizer)
                 for g in inner.param_groups for p in g["params"])
    tensors = sum(len(g["params"]) for inner in inner_optimizers(run.optimizer)
                  for g in inner.param_groups)
    return {"params": params, "tensors": tensors, "device": run.device,
            "threads": torch.get_num_threads(),
            **{f"{what} {k}": statistics.median(v) for (k, what), v in times.items()}}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default="configs/demo.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvtrain-adamw-") as scratch:  # the run's folder
        r = measure(args.config, args.set, args.rounds, args.warmup, Path(scratch))
    print(f"{args.config}: {r['params']:,} parameters in {r['tensors']} tensors, "
          f"{r['device']}, {r['threads']} threads, median of {args.rounds}")
    for what in ("inner", "train"):
        foreach, fused = r[f"{what} foreach"], r[f"{what} fused"]
        print(f"{what} step: foreach {foreach:.2f} ms, fused {fused:.2f} ms "
              f"({foreach / fused:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
