"""What ``kvtrain eval`` evaluates: a Hugging Face folder as it is, or a
kvtrain run / checkpoint exported to one first.

A run's export is cached in ``RUN_DIR/eval/hf-iter_XXXXXXX-<dtype>/`` and
reused while the checkpoint it came from is unchanged (a stamp records the
checkpoint and its common state's size and mtime), so evaluating one
checkpoint on several task lists exports it once. The export appears whole or
not at all (``export_hf`` writes it aside and renames it), its stamp after it;
evaluations of one checkpoint at once export it once (``cached_export``). A
checkpoint outside any run folder is exported into a temporary folder that is
removed afterwards; its results go only to ``--out``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from data_tools.fileio import atomic_write_text, not_a_folder
from kvtrain.config import ConfigError, RunConfig

EVAL_DIR = "eval"  # inside a run folder: results and the cached export
STAMP = "kvtrain_eval_source.json"  # in a cached export: the checkpoint it came from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class Source:
    """A model ready for lm-eval, and the kvtrain run it belongs to (if any)."""

    hf_dir: Path
    run_dir: Optional[Path] = None  # results and wandb go there
    checkpoint: Optional[Path] = None
    iteration: Optional[int] = None
    config: Optional[RunConfig] = None  # the run config the checkpoint was saved with
    temporary: bool = False  # hf_dir is removed afterwards: no record names it


def is_hf_folder(path: Path) -> bool:
    """A Hugging Face model folder (config.json) rather than a kvtrain run."""
    return (path / "config.json").is_file()


def check_tokenizer(hf_dir: Path) -> None:
    """lm-eval scores text: a folder without tokenizer files is refused in one line."""
    if not any((hf_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{hf_dir}: no tokenizer files ({', '.join(TOKENIZER_FILES)}): "
                          "lm-eval scores text")


def exported_from(hf_dir: Path) -> tuple[Optional[Path], Optional[int]]:
    """(checkpoint, iteration) a kvtrain export records (``kvtrain_export.json``);
    (None, None) for any other folder. Results of an HF folder still go only to
    ``--out``: the export may live far from its run."""
    from kvtrain.hf.export import RECORD

    try:
        record = json.loads((hf_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None, None
    checkpoint, iteration = record.get("checkpoint"), record.get("iteration")
    return (Path(checkpoint) if checkpoint else None,
            int(iteration) if isinstance(iteration, int) else None)


def run_folder_of(named: Path, checkpoint: Path) -> Optional[Path]:
    """The run folder results go to: the one the user named (it has config.yaml;
    its checkpoint.dir may be elsewhere), else the run holding the checkpoint
    (``<run>/checkpoints/iter_*``: the user named the checkpoint or its
    checkpoints folder). None for checkpoints outside any run folder: like an
    HF folder, its results go only to --out."""
    if named.resolve() != checkpoint.resolve() and (named / "config.yaml").is_file():
        return named
    run = checkpoint.parent.parent
    return run if (run / "config.yaml").is_file() else None


def _stamp_of(checkpoint: Path, dtype: str) -> dict:
    from kvtrain.hf.export import EXPORT_VERSION

    common = checkpoint / "common.pt"
    stat = common.stat() if common.exists() else None
    return {"checkpoint": str(checkpoint.resolve()), "dtype": dtype,
            "export_version": EXPORT_VERSION,
            "common_size": stat.st_size if stat else None,
            "common_mtime_ns": stat.st_mtime_ns if stat else None}


def _cached(folder: Path, stamp: dict) -> bool:
    try:
        return json.loads((folder / STAMP).read_text()) == stamp and is_hf_folder(folder)
    except (OSError, ValueError):
        return False


def _export(checkpoint: Path, out_dir: Path, dtype: str) -> Path:
    """The checkpoint as a Hugging Face folder (``kvtrain.hf.export``, atomic)."""
    from kvtrain.hf.export import export_hf

    return Path(export_hf(checkpoint, out_dir, dtype=dtype, force=True))


@contextlib.contextmanager
def cached_export(checkpoint: Path, iteration: int, run_dir: Path, dtype: str) -> Iterator[Path]:
    """``RUN_DIR/eval/hf-iter_XXXXXXX-<dtype>``, for the time of the block: reused
    while its stamp matches the checkpoint, else exported (replacing a stale one)
    and stamped.

    Several ``kvtrain eval`` of one checkpoint at once (a task list each) read
    the export under a shared ``flock`` of its lock file, and export it under an
    exclusive one: one exports while the others wait, then find it cached, and
    no export replaces a folder that an evaluation still reads."""
    final = run_dir / EVAL_DIR / f"hf-iter_{iteration:07d}-{dtype}"
    if why := not_a_folder(final.parent):  # a FileExistsError traceback in mkdir
        raise ConfigError(f"the export and the results go to {final.parent}, but {why}")
    final.parent.mkdir(parents=True, exist_ok=True)
    stamp = _stamp_of(checkpoint, dtype)
    fd = os.open(final.with_name(f".{final.name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _flock(fd, fcntl.LOCK_SH, final)  # waits only for an export under way
        if not _cached(final, stamp):
            _flock(fd, fcntl.LOCK_EX, final)  # not atomic: another may export meanwhile
            if not _cached(final, stamp):
                _export(checkpoint, final, dtype)  # written aside and renamed in whole
                # the stamp last: an export without it is redone next time
                atomic_write_text(final / STAMP, json.dumps(stamp, indent=1) + "\n")
            fcntl.flock(fd, fcntl.LOCK_SH)
        yield final
    finally:
        os.close(fd)  # drops the lock


def _flock(fd: int, kind: int, folder: Path) -> None:
    """``flock`` that says why it waits, when it has to."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        doing = "exports" if kind == fcntl.LOCK_SH else "reads or exports"
        print(f"kvtrain eval: waiting for another kvtrain eval that {doing} {folder}",
              file=sys.stderr, flush=True)
        fcntl.flock(fd, kind)


@contextlib.contextmanager
def prepared(source: str | Path, dtype: str) -> Iterator[Source]:
    """The ``Source`` that ``source`` names (an HF folder, a run folder, a
    checkpoint), exported when needed; a temporary export is removed on exit."""
    named = Path(source).expanduser()
    if is_hf_folder(named):
        check_tokenizer(named)
        yield Source(named, None, *exported_from(named))
        return
    from kvtrain.inference.loading import find_checkpoint, saved_config

    checkpoint = find_checkpoint(named)  # ConfigError: one line
    cfg, iteration = saved_config(checkpoint)
    if not cfg.data.tokenizer:  # before the export: its folder would have no tokenizer
        raise ConfigError(f"{checkpoint}: the run has no tokenizer (data.tokenizer is unset; "
                          "it was trained on token ids) and lm-eval scores text")
    run_dir = run_folder_of(named, checkpoint)
    if run_dir is not None:
        with cached_export(checkpoint, iteration, run_dir, dtype) as hf_dir:
            yield Source(hf_dir, run_dir, checkpoint, iteration, cfg)
        return
    with tempfile.TemporaryDirectory(prefix="kvtrain-eval-") as tmp:
        hf_dir = _export(checkpoint, Path(tmp) / "hf", dtype)
        yield Source(hf_dir, None, checkpoint, iteration, cfg, temporary=True)


def window_of(hf_dir: Path, asked: Optional[int] = None) -> tuple[Optional[int], str]:
    """(tokens lm-eval scores within, where that comes from). lm-eval's own is the
    folder's ``max_position_embeddings``; a kvtrain run trained on ``train.seq_length``
    (often shorter) has seen no position beyond it, and its perplexity and validation
    read that context: a kvtrain export (its record) is scored within it. ``asked``:
    ``--max-length``. None: lm-eval's."""
    from kvtrain.hf.export import RECORD

    try:
        positions = json.loads((Path(hf_dir) / "config.json").read_text())[
            "max_position_embeddings"]
    except (OSError, ValueError, KeyError, TypeError):
        positions = None
    if asked is not None:
        if isinstance(positions, int) and asked > positions:  # past them: no position
            raise ConfigError(f"--max-length {asked} is longer than the model's "
                              f"max_position_embeddings ({positions})")
        return asked, "--max-length"
    try:
        record = json.loads((Path(hf_dir) / RECORD).read_text())
        trained = record["config"]["train"]["seq_length"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, "lm-eval's, the folder's max_position_embeddings"
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
               for v in (trained, positions)):
        return None, "lm-eval's, the folder's max_position_embeddings"
    if trained >= positions:
        return None, "lm-eval's, the folder's max_position_embeddings"
    return trained, "the run's train.seq_length"



__all__ = ["EVAL_DIR", "STAMP", "Source", "cached_export", "check_tokenizer", "is_hf_folder",
           "prepared", "run_folder_of", "window_of"]
