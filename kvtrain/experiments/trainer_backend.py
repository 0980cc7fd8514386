"""Running an arm with ``kvtrain train`` instead of the standalone loop.

The trainer reads the task from ``data.type: induction | ngram`` and adds the
accuracies to its validation records. Each arm becomes a run config
(``arms/<arm>/arm.yaml``) and a ``kvtrain train`` process; its
``metrics.jsonl`` validation records give the curve (``val_acc_<mask>``,
``val_loss``). Megatron's optimizer, DDP and
schedules then do the training, and checkpoints, resume and wandb come with it.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from .metrics import MASKS
from .standalone import CURVE_FIELDS, Arm, Settings


def arm_config(s: Settings, arm: Arm, name: str, group: Optional[str], wandb: bool) -> dict:
    """The ``kvtrain train`` config (a dict for YAML) of one arm."""
    eval_iters = max(1, math.ceil(s.eval_samples / s.batch_size))
    return {
        "name": name,
        "model": {
            "num_layers": arm.num_layers, "hidden_size": s.hidden_size,
            "num_attention_heads": s.num_attention_heads,
            "ffn_hidden_size": s.ffn_hidden_size, "vocab_size": s.vocab_size,
            "max_position_embeddings": s.seq_length, "rotary_base": s.rotary_base,
            "attention": arm.attention, "init_method_std": s.init_method_std,
        },
        "train": {
            "micro_batch_size": s.micro_batch_size, "global_batch_size": s.batch_size,
            "seq_length": s.seq_length, "max_steps": s.steps, "seed": s.seed,
            "log_interval": s.eval_interval, "eval_interval": s.eval_interval,
            "eval_iters": eval_iters, "kv_shift_stats_interval": s.eval_interval,
        },
        "optimizer": {
            "lr": s.lr, "lr_warmup_steps": s.warmup_steps, "lr_schedule": "constant",
            "weight_decay": s.weight_decay, "adam_beta1": s.adam_betas[0],
            "adam_beta2": s.adam_betas[1], "adam_eps": s.adam_eps, "clip_grad": s.clip_grad,
        },
        "data": {
            "type": s.task, s.task: dict(s.task_options), "seed": s.data_seed,
            "eval_seed": s.eval_seed, "num_workers": 0,
        },
        "checkpoint": {"save_interval": None, "save_on_exit": False, "resume": "none"},
        "wandb": {"enabled": wandb, "project": os.environ.get("WANDB_PROJECT",
                                                                "kvtrain-induction"),
                  "group": group, "name": arm.name},
    }


def curve_from_metrics(path: str | Path, arm: str, task: str) -> list[dict]:
    """Rows (the standalone loop's curve fields) from a run's ``metrics.jsonl``."""
    first, every = MASKS[task]
    rows, train_losses, lr = [], [], float("nan")
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        kind = rec.get("kind")
        if kind == "train":
            loss = rec.get("lm_loss")
            if isinstance(loss, (int, float)):
                train_losses.append(float(loss))
            lr = float(rec.get("lr") or float("nan"))
        elif kind == "valid":
            rows.append({
                "arm": arm, "step": int(rec["iteration"]),
                "accuracy": float(rec.get(f"val_acc_{first}", float("nan"))),
                "accuracy_all": float(rec.get(f"val_acc_{every}", float("nan"))),
                "loss": float(rec["val_loss"]),
                "train_loss": train_losses[-1] if train_losses else float("nan"),
                "lr": lr, "elapsed_s": float("nan"),
            })
    return rows


def train_arm_with_trainer(s: Settings, arm: Arm, out_dir: str | Path, threads: int = 0,
                           group: Optional[str] = None, wandb: bool = True,
                           nproc: int = 1) -> dict:
    """Trains one arm with ``kvtrain train`` (``nproc`` > 1: under torchrun, DP)."""
    import yaml

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = arm_config(s, arm, f"{out_dir.parent.parent.name}-{arm.name}", group, wandb)
    cfg_path = out_dir / "arm.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "kvtrain.cli"]
    else:
        cmd = [sys.executable, "-m", "kvtrain.cli"]
    cmd += ["train", str(cfg_path), "--run-dir", str(out_dir / "run")]
    t0 = time.time()
    with open(out_dir / "train.log", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"kvtrain train failed for {arm.name} (exit {proc.returncode}); "
                           f"see {out_dir / 'train.log'}")
    rows = curve_from_metrics(out_dir / "run" / "metrics.jsonl", arm.name, s.task)
    with open(out_dir / "curve.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, CURVE_FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    params = _param_counts(s, arm)
    return {"arm": arm.name, "rows": rows, "wall_s": wall, "params": params,
            "threads": threads or None, "config": asdict(arm)}


def _param_counts(s: Settings, arm: Arm) -> dict:
    """Parameter counts from kvtrain's planner formulas (no model is built here)."""
    try:
        from kvtrain.plan.params import count_params  # type: ignore

        from .standalone import model_config

        n = count_params(model_config(s, arm))
        return {"total": int(n.total), "embedding": int(n.embedding),
                "non_embedding": int(n.non_embedding)}
    except Exception:
        return {"total": -1, "embedding": -1, "non_embedding": -1}
