"""What ``kvtrain eval`` evaluates: a Hugging Face folder as it is, or a
kvtrain run / checkpoint exported to one first.

A run's export is cached in ``RUN_DIR/eval/hf-iter_XXXXXXX-<dtype>/`` and
reused while the checkpoint it came from is unchanged (a stamp records the
checkpoint and its common state's size and mtime), so evaluating one
checkpoint on several task lists exports it once. The cache appears whole or
not at all: the export is written into a temporary sibling and renamed. A
checkpoint outside any run folder is exported into a temporary folder that is
removed afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from data_tools.fileio import atomic_write_text
from kvtrain.config import ConfigError, RunConfig

EVAL_DIR = "eval"  # inside a run folder: results and the cached export
STAMP = "kvtrain_eval_source.json"  # in a cached export: the checkpoint it came from


@dataclass
class Source:
    """A model ready for lm-eval, and the kvtrain run it belongs to (if any)."""

    hf_dir: Path
    run_dir: Optional[Path] = None  # results and wandb go there
    checkpoint: Optional[Path] = None
    iteration: Optional[int] = None
    config: Optional[RunConfig] = None  # the run config the checkpoint was saved with


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json) rather than a kvtrain run."""
    return (path / "config.json").is_file()


def run_folder_of(named: Path, checkpoint: Path) -> Optional[Path]:
    """The run folder results go to: the folder the user named when it is not
    the checkpoint itself, else the run holding ``<run>/checkpoints/iter_*``."""
    if named.resolve() != checkpoint.resolve():
        return named
    run = checkpoint.parent.parent
    return run if (run / "config.yaml").is_file() else None


def _stamp_of(checkpoint: Path, dtype: str) -> dict:
    common = checkpoint / "common.pt"
    stat = common.stat() if common.exists() else None
    return {"checkpoint": str(checkpoint.resolve()), "dtype": dtype,
            "common_size": stat.st_size if stat else None,
            "common_mtime_ns": stat.st_mtime_ns if stat else None}


def _cached(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp and is_hf_folder(folder)
    except (OSError, ValueError):
        return False


def _export(checkpoint: Path, out_dir: Path, dtype: str) -> Path:
    """The checkpoint as a Hugging Face folder (kvtrain.hf.export)."""
    try:
        from kvtrain.hf.export import export_hf
    except ImportError as e:
        from .harness import EXTRA_HINT

        raise ConfigError(f"exporting {checkpoint} for lm-eval needs the hf extra "
                          f"({e}): {EXTRA_HINT}") from None
    from kvtrain.inference.loading import inference_process

    inference_process()  # one CPU process: export loads the checkpoint at TP=PP=1
    return Path(export_hf(checkpoint, out_dir, dtype=dtype))


def cached_export(checkpoint: Path, iteration: int, run_dir: Path, dtype: str) -> Path:
    """``RUN_DIR/eval/hf-iter_XXXXXXX-<dtype>``: reused, or exported and renamed into place."""
    final = run_dir / EVAL_DIR / f"hf-iter_{iteration:07d}-{dtype}"
    stamp = _stamp_of(checkpoint, dtype)
    if _cached(final, stamp):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=final.name + ".tmp-", dir=final.parent))
    try:
        _export(checkpoint, staging, dtype)
        atomic_write_text(staging / STAMP, json.dumps(stamp, indent=1) + "\n")
        if final.exists():  # an export of an older checkpoint of the same iteration
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return final


@contextlib.contextmanager
def prepared(source: str | Path, dtype: str) -> Iterator[Source]:
    """The ``Source`` that ``source`` names (an HF folder, a run folder, a
    checkpoint), exported when needed; a temporary export is removed on exit."""
    named = Path(source).expanduser()
    if is_hf_folder(named):
        yield Source(hf_dir=named)
        return
    from kvtrain.inference.loading import find_checkpoint, saved_config

    checkpoint = find_checkpoint(named)  # ConfigError: one line
    cfg, iteration = saved_config(checkpoint)
    run_dir = run_folder_of(named, checkpoint)
    if run_dir is not None:
        hf_dir = cached_export(checkpoint, iteration, run_dir, dtype)
        yield Source(hf_dir, run_dir, checkpoint, iteration, cfg)
        return
    with tempfile.TemporaryDirectory(prefix="kvtrain-eval-") as tmp:
        hf_dir = _export(checkpoint, Path(tmp) / "hf", dtype)
        yield Source(hf_dir, None, checkpoint, iteration, cfg)


__all__ = ["EVAL_DIR", "STAMP", "Source", "cached_export", "is_hf_folder", "prepared", "run_folder_of"]
