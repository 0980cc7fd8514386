"""Run configuration: typed sections (schema.py) loaded strictly from YAML (loader.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

from .loader import (
    ConfigError, apply_override, dump_yaml, first_line, from_dict, on_every_rank, read_yaml,
    to_dict,
)
from .schema import (
    CheckpointConfig,
    DataConfig,
    KVShiftConfig,
    MLAConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    ShiftHeadsConfig,
    TrainConfig,
    WandbConfig,
)


def load_config(
    path: Optional[str | Path] = None,
    overrides: Iterable[str] = (),
    world_size: Optional[int] = None,
) -> RunConfig:
    """Reads a YAML run config, applies ``--set`` overrides, builds and validates it."""
    data = read_yaml(path) if path is not None else {}
    if path is not None and not data:  # a failed copy, a wrong path: it trained the defaults
        raise ConfigError(f"{path} holds no settings (an empty file): a run config names at "
                          "least its model, data and train settings (configs/demo.yaml is one)")
    for assignment in overrides:
        apply_override(data, assignment, RunConfig)
    cfg = from_dict(RunConfig, data, source=str(path) if path is not None else None)
    cfg.validate(world_size=world_size)
    return cfg


def run_folder(cfg: RunConfig, override: Optional[str | Path] = None) -> Path:
    """The run folder: ``--run-dir``, else ``run_dir`` from the config, else
    ``runs/<name>``, with ``~`` expanded. The trainer and the launchers (kvtrain
    submit, launch/*.sh) all ask here, so that the run, its logs and stop files
    land in one folder and not in one of them under a folder named ``~``."""
    return Path(override or cfg.run_dir or Path("runs") / cfg.name).expanduser()


def checkpoint_folder(configured: Optional[str], run_dir: str | Path) -> Path:
    """The folder of a run's checkpoints: ``checkpoint.dir`` with ``~`` expanded,
    a relative one under the run folder, ``<run_dir>/checkpoints`` when it is null.
    Not under the working directory: the same run restarted from elsewhere (a job
    script that changes directory) must find its checkpoints. Every reader of
    checkpoint.dir (training, ``kvtrain demo``, loading a run folder) goes through
    here, so that they agree on where the checkpoints are."""
    # an absolute (or ~) folder replaces run_dir in the join
    return Path(run_dir) / Path(configured or "checkpoints").expanduser()


def profile_folder(configured: Optional[str], run_dir: str | Path) -> Path:
    """The folder of a run's step traces: ``profile.dir`` with ``~`` expanded, a
    relative one under the run folder, ``<run_dir>/profile`` when it is null."""
    return Path(run_dir) / Path(configured or "profile").expanduser()


def wandb_folder(configured: Optional[str], run_dir: str | Path) -> Path:
    """The folder wandb writes its ``wandb/`` folder into: ``wandb.dir`` with ``~``
    expanded, a relative one under the run folder (as ``checkpoint.dir``: a job
    script that changes directory must not split a run's wandb files), the run
    folder itself when it is null."""
    return Path(run_dir) / Path(configured or ".").expanduser()


def make_folder(path: str | Path, option: str) -> Path:
    """Makes the output folder ``path`` (``option``: the flag or key that named it):
    a file in its path, or a folder the system will not make (read-only,
    permissions, /proc), is one ``ConfigError`` naming ``option``, not mkdir's
    traceback after the work began."""
    from data_tools.fileio import not_a_folder

    if why := not_a_folder(path):
        raise ConfigError(f"{option} {why}")
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{option} {path} cannot be made: {e.strerror or e}") from None
    return Path(path)


def launched_world_size() -> int:
    """The processes a launcher started for this command (torchrun's or SLURM's
    ``WORLD_SIZE``; 1 started by hand), known before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def one_process_only(command: str) -> None:
    """Refuses ``command`` under a launcher that started several processes (every
    rank would do the whole work, into the same files)."""
    if launched_world_size() > 1:
        raise ConfigError(f"{command} runs in one process (not under torchrun)")


__all__ = [
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "KVShiftConfig",
    "MLAConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ParallelConfig",
    "ProfileConfig",
    "RunConfig",
    "ShiftHeadsConfig",
    "TrainConfig",
    "WandbConfig",
    "checkpoint_folder",
    "dump_yaml",
    "first_line",
    "launched_world_size",
    "load_config",
    "on_every_rank",
    "one_process_only",
    "profile_folder",
    "run_folder",
    "to_dict",
    "wandb_folder",
]
