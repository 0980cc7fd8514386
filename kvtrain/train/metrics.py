"""What a run reports: ``metrics.jsonl``, one line on stdout, and wandb.

Every record is one JSON object with ``kind`` (train | valid | kv_shift |
event) and ``iteration``; train records carry ``lm_loss``, ``lr``,
``grad_norm``, consumed samples/tokens, step time, tokens/s, TFLOP/s per
device, MFU and peak memory. The same numbers go to wandb under
``train/``, ``valid/`` and ``kv_shift/`` names (a named validation set's record,
``set: NAME``, under ``valid/NAME/``). Only global rank 0 writes.

On a resume the records past the checkpoint's iteration (steps a crashed run
did after its last save) are dropped from ``metrics.jsonl``: the file then
reads as one consistent history, the one the resumed run continues. When the
resume passed over something (a damaged checkpoint, a history set aside), or
when a start found no checkpoint in a folder with records (checkpoints deleted,
``checkpoint.dir`` changed), the dropped records may be a history of their own:
the file is first copied to ``metrics.jsonl.before-<iteration>-<UTC time>``.
"""

from __future__ import annotations

import json
import math
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from data_tools.fileio import atomic_write_text
from data_tools.units import human
from kvtrain.config import ConfigError

from .wandb_logger import WandbLogger

METRICS_FILE = "metrics.jsonl"


def peak_memory_gib() -> tuple[float, str]:
    """Peak device memory (CUDA allocator) or, on CPU, the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "cuda_allocated"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20, "cpu_rss"


def truncate_after(path: Path, iteration: int,
                   backup: Optional[Path] = None) -> tuple[int, int, Optional[Path]]:
    """Drops records with ``iteration`` > ``iteration`` (atomically), and damaged
    lines: a line torn by a kill mid-write, or one that is no record (not UTF-8,
    not a JSON object, no whole iteration). Returns (records dropped, damaged
    lines, where the original was kept). ``backup``: where the original goes
    first, if anything is dropped; with damaged lines other than a torn last one
    it is kept anyway (they were not the trainer's)."""
    if not path.exists():
        return 0, 0, None
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the file's final newline
    keep, dropped, damaged = [], 0, []
    for n, raw in enumerate(lines):
        try:
            line = raw.decode("utf-8")
            number = json.loads(line).get("iteration", 0)
            if not isinstance(number, int) or isinstance(number, bool):
                raise ValueError
        except (ValueError, AttributeError):
            damaged.append(n)
            continue
        if number > iteration:
            dropped += 1
        else:
            keep.append(line)
    torn_last_only = damaged == [len(lines) - 1]
    if damaged and not torn_last_only and backup is None:
        backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ')}")
    if not (dropped or damaged):
        return 0, 0, None
    if backup is not None:
        shutil.copy2(path, backup)
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return dropped, len(damaged), backup


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1e5:
            return human(value)
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    """Rank 0's sink for records; other ranks hold an inactive one."""

    def __init__(self, run_dir: Path, wandb: WandbLogger, active: bool):
        self.active = active
        self.path = Path(run_dir) / METRICS_FILE
        self.wandb = wandb
        self._file = None
        if active:
            if self.path.is_dir():  # an IsADirectoryError traceback at the start
                raise ConfigError(f"{self.path} is a folder, not the run's metrics file: "
                                  "move it away")
            self._file = open(self.path, "a", buffering=1)  # line-buffered

    def resume_at(self, iteration: int, keep_copy: bool = False) -> None:
        """Forget records a crashed run wrote after the checkpoint we resume from
        (``keep_copy``: in a copy of the file, kept)."""
        if not self.active:
            return
        self._file.close()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        backup = self.path.with_name(f"{self.path.name}.before-{iteration}-{stamp}")
        dropped, damaged, copy = truncate_after(self.path, iteration,
                                                backup if keep_copy else None)
        kept = f"; the file before is kept as {copy.name}" if copy is not None else ""
        if dropped:
            why = ("no checkpoint continues them" if iteration == 0 else
                   "written by the interrupted run after its last checkpoint")
            print(f"metrics: dropped {dropped} records after iteration {iteration} "
                  f"({why}){kept}", flush=True)
        if damaged:
            print(f"metrics: dropped {damaged} damaged lines of {self.path} (not records: "
                  f"torn by a kill, or not the trainer's){'' if dropped else kept}", flush=True)
        self._file = open(self.path, "a", buffering=1)

    def write(self, record: dict, echo: bool = True) -> None:
        if not self.active:
            return
        # JSON has no NaN/inf: a non-finite loss or norm is written as "nan"/"inf"
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self._file.write(json.dumps(clean) + "\n")
        self.wandb.log(self._wandb_view(record))
        if echo:
            print(self._line(record), flush=True)

    @staticmethod
    def _wandb_view(record: dict) -> dict:
        kind = record.get("kind", "train")
        # a named validation set's curves: valid/NAME/val_loss beside valid/val_loss
        group = f"{kind}/{record['set']}" if kind == "valid" and record.get("set") else kind
        out = {"iteration": record["iteration"]}
        for key, value in record.items():
            if key in ("kind", "iteration", "time") or isinstance(value, (str, dict, list)):
                continue
            name = key if "/" in key else f"{group}/{key}"
            out[name] = value
        return out

    @staticmethod
    def _line(record: dict) -> str:
        kind = record.get("kind", "train")
        if kind == "train":
            keys = ("lm_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
                    "tflops_per_device", "mfu", "peak_memory_gib", "skipped_steps")
            parts = [f"iter {record['iteration']:>7d}",
                     f"samples {record.get('consumed_samples')}"]
            parts += [f"{k} {_fmt(record.get(k))}" for k in keys if k in record]
            return " | ".join(parts)
        if kind == "valid":
            accs = "".join(f" | {k} {_fmt(v)}" for k, v in record.items()
                           if k.startswith("val_acc_"))
            named = f" {record['set']}" if record.get("set") else ""
            return (f"iter {record['iteration']:>7d} | validation{named} | val_loss "
                    f"{_fmt(record['val_loss'])} | val_ppl {_fmt(record['val_ppl'])}{accs}")
        if kind == "kv_shift":
            quad = {k.rsplit("/", 1)[1]: v for k, v in record.items() if "/quadrant/" in k}
            return f"iter {record['iteration']:>7d} | kv_shift quadrants {quad}"
        return f"iter {record['iteration']:>7d} | {record.get('message', kind)}"

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def say(message: str) -> None:
    """Prints a line from global rank 0 (every process before distributed init)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stdout, flush=True)
