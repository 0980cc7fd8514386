"""Where evaluation results go: a JSON record (``RUN_DIR/eval/*.json`` or
``--out``), the requests' log-likelihoods (``--log-samples``), a printed
table, and the run's wandb run.

The record's shape (``kvtrain compare`` reads ``tasks``)::

    {"source": ..., "checkpoint": ..., "iteration": ..., "hf_dir": ...,
     "tasks": {task: {metric: value, ...}}, "n_samples": {...}, "n_shot": {...},
     "config": {num_fewshot, limit, ...}, "lm_eval_version": ..., "time": ...}
"""

from __future__ import annotations

import hashlib
import json
import re
import time
from pathlib import Path
from typing import Any, Optional

from data_tools.fileio import atomic_write_text
from kvtrain.config import RunConfig, wandb_folder

from .harness import DEFAULT_DTYPE, EvalOutput, EvalSpec
from .source import EVAL_DIR


def make_record(source: str, checkpoint: Optional[Path], iteration: Optional[int],
                hf_dir: Optional[Path], spec: EvalSpec, out: EvalOutput) -> dict[str, Any]:
    """The JSON record of one ``kvtrain eval`` (``hf_dir`` None: the model was a
    temporary export, removed since)."""
    return {"source": str(source), "checkpoint": str(checkpoint) if checkpoint else None,
            "iteration": iteration, "hf_dir": str(hf_dir) if hf_dir else None,
            "tasks": out.tasks,
            "n_samples": out.n_samples, "n_shot": out.n_shot, "versions": out.versions,
            "config": spec.as_record(), "lm_eval_version": out.lm_eval_version,
            "max_length": out.max_length,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def record_name(tasks: list[str], iteration: Optional[int], num_fewshot: Optional[int] = None,
                limit: Optional[float] = None, dtype: str = DEFAULT_DTYPE,
                max_length: Optional[int] = None) -> str:
    """``<task1>+<task2>-iter_0000100[-5shot][-limitN][-lenL][-bf16].json`` (a time
    stamp without an iteration): evaluations that differ in shots, limit, a
    ``--max-length`` or dtype keep apart. The default dtype is not named, so names
    written before the dtype was part of them still mean fp32."""
    joined = "+".join(re.sub(r"[^A-Za-z0-9_.-]", "_", t) for t in tasks)
    if len(joined) > 120:  # many tasks: a valid file name, one per list (its hash)
        digest = hashlib.sha1(joined.encode()).hexdigest()[:8]
        joined = joined[:100] + f"+{len(tasks)}tasks-{digest}"
    parts = [joined, f"iter_{iteration:07d}" if iteration is not None
             else time.strftime("%Y%m%d-%H%M%S")]
    if num_fewshot is not None:
        parts.append(f"{num_fewshot}shot")
    if limit is not None:
        parts.append(f"limit{limit:g}")
    if max_length is not None:
        parts.append(f"len{max_length}")
    if dtype != DEFAULT_DTYPE:
        parts.append(dtype)
    return "-".join(parts) + ".json"


def write_record(path: Path, record: dict, samples: list[dict]) -> list[Path]:
    """Writes the record (and the samples next to it as JSONL), atomically; a samples
    file of the record it replaces goes with it (it would pass for this one's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(record, indent=1) + "\n")
    written = [path]
    side = path.with_name(path.stem + ".samples.jsonl")
    if samples:
        atomic_write_text(side, "".join(json.dumps(s) + "\n" for s in samples))
        written.append(side)
    else:
        side.unlink(missing_ok=True)
    return written


def render_table(tasks: dict[str, dict[str, float]], n_samples: dict[str, int]) -> str:
    """task | metric | value | stderr, one line per metric."""
    rows = [("task", "metric", "value", "stderr", "n")]
    for task in sorted(tasks):
        metrics = tasks[task]
        for metric in sorted(m for m in metrics if "_stderr" not in m):
            base, _, filt = metric.partition("/")
            stderr = metrics.get(f"{base}_stderr" + (f"/{filt}" if filt else ""))
            rows.append((task, metric, f"{metrics[metric]:.4f}",
                         "" if stderr is None else f"{stderr:.4f}",
                         str(n_samples.get(task, ""))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def log_to_wandb(cfg: RunConfig, run_dir: Path, iteration: Optional[int],
                 tasks: dict[str, dict[str, float]]) -> str:
    """Logs ``eval/<task>/<metric>`` at ``iteration`` into the run's own wandb
    run (resumed by the id the trainer stored); returns a one-line note."""
    from kvtrain.train.wandb_logger import RUN_ID_FILE, WandbLogger, resolve_mode

    mode = resolve_mode(cfg.wandb)
    if mode == "disabled":
        return "wandb: disabled in the run's config, not logged"
    if not (run_dir / RUN_ID_FILE).exists():
        return f"wandb: {run_dir} has no {RUN_ID_FILE} (the run never opened one), not logged"
    folder = wandb_folder(cfg.wandb.dir, run_dir)
    try:  # the results are written: a folder of another machine is a line, not a traceback
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"wandb: cannot make the run's wandb folder {folder} ({e.strerror}), not logged"
    logger = WandbLogger(cfg.wandb, run_dir, run_name=cfg.name, config={})
    metrics: dict[str, Any] = {"iteration": iteration or 0}
    for task, values in tasks.items():
        metrics.update({f"eval/{task}/{m}": v for m, v in values.items()})
    logger.log(metrics)
    run_id, logged = logger.run_id, logger.active  # inactive: wandb failed, it said why
    logger.finish()
    if not logged:
        return f"wandb: run {run_id} not logged to (see the warning above)"
    return f"wandb: logged to run {run_id} ({mode})"


__all__ = ["EVAL_DIR", "log_to_wandb", "make_record", "record_name", "render_table",
           "write_record"]
