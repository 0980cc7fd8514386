"""``kvtrain train CONFIG.yaml [--set a.b=v ...] [--run-dir DIR]``.

One process, or one per rank under ``torchrun`` / SLURM: the same command.
Config problems are reported as one line (``kvtrain: config error: ...``,
exit code 2) before anything heavy is imported.
"""

from __future__ import annotations

import logging
import os
import warnings


def register(sub) -> None:
    p = sub.add_parser(
        "train", help="train (or resume) a model from a YAML config",
        description="Train or resume a run. Under torchrun every rank runs this command.",
    )
    p.add_argument("config", metavar="CONFIG.yaml", help="run config (see configs/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.max_steps=200 (repeatable)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="run folder (default: run_dir from the config, else runs/<name>)")
    p.add_argument("--status-file", default=None, metavar="PATH",
                   help="at the end, write 'finished ITER/STEPS' or 'stopped ITER/STEPS' there "
                        "(rank 0, atomically): launch/slurm.sbatch requeues a stopped job only")
    p.set_defaults(func=run)


def quiet_imports() -> None:
    # megatron warns at import about optional GPU libraries (TE/apex); on a CPU
    # these are expected, and a screen of them hides the run's own output.
    for pattern in (".*Transformer Engine and Apex are not installed.*",
                    ".*Apex is not installed.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="megatron")
    warnings.filterwarnings("ignore", category=FutureWarning, module="megatron")
    # megatron's optimizer probes .grad of non-leaf views; torch's c10d marks the
    # *_tensor collectives megatron calls as deprecated aliases.
    warnings.filterwarnings("ignore", message=".*The .grad attribute of a Tensor that is not a leaf")
    warnings.filterwarnings("ignore", category=FutureWarning, message=".*is deprecated. Please use")
    # megatron's dist_checkpointing calls torch.distributed.checkpoint APIs that torch
    # marks as deprecated (ShardedTensor, load_state_dict): nothing a user can act on
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    # a CUDA build of torch on a host with no GPU (a login node) logs this when megatron
    # imports torch.utils.cpp_extension: a line before kvtrain's one-line refusals
    cpp = logging.getLogger("torch.utils.cpp_extension")
    if not any(isinstance(f, _NoCudaRuntimeLine) for f in cpp.filters):
        cpp.addFilter(_NoCudaRuntimeLine())


class _NoCudaRuntimeLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


def run(args) -> int:
    from kvtrain.config import ConfigError, launched_world_size, load_config, on_every_rank

    world = launched_world_size()
    try:  # every rank of a node reads the same files and arguments: one line a node
        # Checked here in full (with the world size) so that a bad config fails in
        # one line before torch/megatron are imported.
        cfg = load_config(args.config, args.overrides, world_size=world)
        quiet_imports()
        from kvtrain.train import resolve_run_dir, train
        from kvtrain.train.processes import freeze_imports

        run_dir = resolve_run_dir(cfg, args.run_dir)
        check_output_folders(cfg, run_dir, "--run-dir" if args.run_dir else "run_dir")
        status = check_status_file(args.status_file)
    except ConfigError as e:
        raise on_every_rank(e) from None
    freeze_imports()  # the imports above stay alive: no collection need walk them
    return train(cfg, run_dir, status_file=status)


def check_status_file(path: "str | None"):
    """The status file's path, made absolute (None: none). One that cannot be
    written at the end (a folder there, a file where its folder goes) is refused
    now, not after the training."""
    from pathlib import Path

    from data_tools.fileio import not_a_folder
    from kvtrain.config import ConfigError

    if path is None:
        return None
    status = Path(os.path.expanduser(path)).absolute()
    if status.is_dir():
        raise ConfigError(f"--status-file {path} is a folder, not a file")
    if why := not_a_folder(status.parent):
        raise ConfigError(f"--status-file {path}: {why}")
    return status


def check_output_folders(cfg, run_dir, run_dir_key: str) -> None:
    """A file where a folder of the run would go (a typo in --run-dir or a
    *.dir key) is one line here, not a traceback from every rank."""
    from data_tools.fileio import not_a_folder
    from kvtrain.config import ConfigError, checkpoint_folder, wandb_folder

    checkpoints = checkpoint_folder(cfg.checkpoint.dir, run_dir) if cfg.checkpoint.dir else None
    wandb = wandb_folder(cfg.wandb.dir, run_dir) if cfg.wandb.dir else None
    for key, path in ((run_dir_key, run_dir), ("checkpoint.dir", checkpoints),
                      ("data.cache_dir", cfg.data.cache_dir), ("wandb.dir", wandb)):
        if path is not None and (why := not_a_folder(os.path.expanduser(path))):
            raise ConfigError(f"{key} {why}")
