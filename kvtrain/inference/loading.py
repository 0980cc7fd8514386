"""A kvtrain checkpoint's model, for everything after training: generation,
export to Hugging Face, evaluation.

``find_checkpoint`` turns what a user names (a run folder, its checkpoints
folder, or one ``iter_*`` checkpoint) into one complete checkpoint;
``saved_config`` reads the run config the checkpoint was saved with; and
``load_model`` builds that model on this process's megatron layout (TP/PP as
the caller initialised them: megatron's dist_checkpointing reshards from
whatever layout the run used) and loads its weights strictly, without the
optimizer. ``inference_process`` sets up the one-process layout a CPU export
or a single-process generation needs.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from kvtrain.config import (
    ConfigError, RunConfig, checkpoint_folder, first_line, from_dict, on_every_rank, read_yaml,
)

CHECKPOINTS = "checkpoints"  # the default checkpoint.dir inside a run folder


@dataclass
class LoadedModel:
    """A checkpoint's model on this rank, in eval mode."""

    model: torch.nn.Module  # megatron GPTModel (this rank's TP/PP shard)
    config: RunConfig  # the config the checkpoint was saved with
    checkpoint: Path
    iteration: int
    backend: str  # te | torch | local: the backend it was built on


def _checkpoint_roots(source: Path) -> list[Path]:
    """Folders that may hold checkpoint folders: a run folder's checkpoint.dir
    (its config.yaml may name one elsewhere), ``checkpoints/``, or ``source``."""
    roots = []
    config_file = source / "config.yaml"
    if config_file.is_file():
        try:
            named = (read_yaml(config_file).get("checkpoint") or {}).get("dir")
        except (ConfigError, AttributeError):
            named = None
        if isinstance(named, str) and named:
            roots.append(checkpoint_folder(named, source))
    return roots + [source / CHECKPOINTS, source]


def _checked(candidates: list[Path]):
    """``(path, problem)`` of each complete checkpoint among ``candidates``, in their
    order (problem None: its files are whole)."""
    from kvtrain.train.checkpoint import is_complete
    from kvtrain.train.integrity import check_checkpoint

    for path in candidates:
        if is_complete(path):
            yield path, check_checkpoint(path, "sizes").problem


def _say_damaged(path: Path, why: str, then: str) -> None:
    from kvtrain.train.integrity import warn

    if os.environ.get("RANK", "0") == "0":  # every rank looks it up: one says it
        print(warn(f"checkpoint {path} is damaged ({why}); {then}"), file=sys.stderr,
              flush=True)


def _checkpoint_itself(source: Path) -> Optional[Path]:
    """``source`` when it is one checkpoint (refused when damaged), else None; a
    missing ``source`` is refused."""
    from kvtrain.train.integrity import MARKER, check_checkpoint

    if not source.exists():
        raise ConfigError(f"{source}: no such run folder or checkpoint")
    if not (source / MARKER).exists():
        return None
    problem = check_checkpoint(source, "sizes").problem
    if problem:
        raise ConfigError(f"checkpoint {source} is damaged: {problem}")
    return source


def find_checkpoint(source: str | Path) -> Path:
    """The complete checkpoint ``source`` names: itself when it is one; else
    the one ``latest`` names, else the newest complete checkpoint folder.
    ConfigError (one line) when there is none."""
    from kvtrain.train.integrity import checkpoint_folders, read_tracker

    source = Path(source).expanduser()
    itself = _checkpoint_itself(source)
    if itself is not None:
        return itself
    skipped = []  # damaged complete checkpoints passed over: said, not silent
    for root in _checkpoint_roots(source):
        hint, _ = read_tracker(root)
        for candidate, problem in _checked(([hint] if hint else []) + checkpoint_folders(root)):
            if not problem:
                for path, why in skipped:
                    _say_damaged(path, why, f"using {candidate}")
                return candidate
            if (candidate, problem) not in skipped:
                skipped.append((candidate, problem))
    if skipped:
        path, why = skipped[0]
        raise ConfigError(f"{source}: every complete checkpoint is damaged ({path}: {why})")
    raise ConfigError(f"{source} holds no complete kvtrain checkpoint")


def every_checkpoint(source: str | Path) -> list[Path]:
    """The complete checkpoints of the run folder ``source`` (its checkpoint.dir or
    ``checkpoints/``), oldest first, a damaged one passed over with a warning; a
    checkpoint itself: [it]. ConfigError (one line) when there is none."""
    from kvtrain.train.integrity import checkpoint_folders

    source = Path(source).expanduser()
    itself = _checkpoint_itself(source)
    if itself is not None:
        return [itself]
    for root in _checkpoint_roots(source):
        good = []
        for path, problem in _checked(list(reversed(checkpoint_folders(root)))):
            if problem:
                _say_damaged(path, problem, "passed over")
            else:
                good.append(path)
        if good:
            return good
    raise ConfigError(f"{source} holds no complete kvtrain checkpoint")


def saved_config(checkpoint: str | Path) -> tuple[RunConfig, int]:
    """(the run config ``checkpoint`` was saved with, its iteration)."""
    from megatron.core import dist_checkpointing

    checkpoint = Path(checkpoint)
    try:
        common = dist_checkpointing.load_common_state_dict(str(checkpoint))
    except Exception as e:  # a damaged common.pt: name it, in one line
        raise ConfigError(f"checkpoint {checkpoint}: cannot read its common state "
                          f"({first_line(e)})") from None
    meta = common.get("kvtrain") if isinstance(common, dict) else None
    if not meta or "config" not in meta:
        raise ConfigError(f"checkpoint {checkpoint} has no kvtrain config (not saved by kvtrain)")
    data = {k: v for k, v in meta["config"].items() if k != "resolved"}
    cfg = from_dict(RunConfig, data, source=f"{checkpoint} (saved config)")
    return cfg, int(meta.get("state", {}).get("iteration", 0))


def inference_process(tensor: int = 1, pipeline: int = 1, seed: int = 1234) -> None:
    """torch.distributed and megatron's parallel state for an inference process
    (one CPU process when launched without torchrun), at TP ``tensor`` x PP
    ``pipeline``; idempotent."""
    from kvtrain.backend import init_distributed

    init_distributed(tensor=tensor, pipeline=pipeline, seed=seed)


def load_model(source: str | Path, backend: str = "auto",
               dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Builds the model of the checkpoint ``source`` names on this rank's layout
    (megatron's parallel state must be initialised) and loads its weights strictly.

    ``backend``: the layer implementation to build on (checkpoints load across
    backends); ``dtype``: parameter dtype (fp32 for exact export and parity).
    """
    from kvtrain.train.checkpoint_readers import reading

    for _ in range(3):  # a running training's keep_last may delete what was found
        path = _found_by_rank0(source)
        with reading(path) as there:  # held against keep_last while it loads
            if _on_every_rank(there):
                return _load(path, backend, dtype)
    raise ConfigError(f"{source}: its checkpoints were deleted as they were found, three "
                      "times (a training with a small checkpoint.keep_last?): try again")


def _found_by_rank0(source: str | Path) -> Path:
    """``find_checkpoint`` on rank 0, its answer (or its one-line refusal) on every
    rank: ranks that each looked it up while a training saved found different
    checkpoints, and their shards made one model of mixed weights."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return find_checkpoint(source)
    answer = [None]
    if dist.get_rank() == 0:
        try:
            answer[0] = ("path", str(find_checkpoint(source)))
        except ConfigError as e:
            answer[0] = ("refused", str(e))
    dist.broadcast_object_list(answer, src=0)
    kind, value = answer[0]
    if kind == "refused":
        raise on_every_rank(ConfigError(value))
    return Path(value)


def _on_every_rank(flag: bool) -> bool:
    """``flag`` held on every rank (each holds the checkpoint it is to load)."""
    import torch.distributed as dist

    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return flag
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, flag)
    return all(flags)


def _load(path: Path, backend: str, dtype: torch.dtype) -> LoadedModel:
    """``load_model`` of the complete checkpoint ``path``."""
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from kvtrain.config import ParallelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config
    from kvtrain.model.specs import resolve_backend
    from kvtrain.train.checkpoint import SHARDING_METADATA
    from kvtrain.train.model_fit import check_same_parameters

    cfg, iteration = saved_config(path)
    parallel = ParallelConfig(tensor=parallel_state.get_tensor_model_parallel_world_size(),
                              pipeline=parallel_state.get_pipeline_model_parallel_world_size())
    numerics = Numerics(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    name = resolve_backend(backend)
    # the training run's kernel keys may name another machine's kernels: every kernel
    # computes the same values, so inference takes what this machine has (auto)
    from kvtrain.model import rope
    from kvtrain.model.swiglu import choose_swiglu

    cuda = torch.cuda.is_available()
    shift_kernel = None
    if cfg.model.attention == "kv_shift":
        from kvtrain.model.shift_kernels import choose_kernel

        shift_kernel = choose_kernel("auto", cuda, dtype)[0]
    rope_kernel = rope.resolve(cfg.model, name, cuda)[0]
    model = build_gpt(cfg.model, transformer_config(cfg.model, parallel, numerics,
                                                    rope_fusion=rope.fuses(rope_kernel)),
                      seed=cfg.train.seed, backend=name, shift_kernel=shift_kernel,
                      swiglu=choose_swiglu("auto", name, cuda, dtype)[0])
    if cuda:
        model.cuda(torch.cuda.current_device())
    request = {"model": model.sharded_state_dict(metadata=dict(SHARDING_METADATA))}
    loaded, in_checkpoint_only, in_model_only = dist_checkpointing.load(
        request, str(path), strict=StrictHandling.RETURN_ALL)
    # a VPP run saved chunks as model0, model1, ...: their tensors' keys are global, so
    # one unsplit model asks for the same keys; only the top-level names differ
    check_same_parameters(path, in_checkpoint_only, in_model_only)
    model.load_state_dict(loaded["model"], strict=True)
    return LoadedModel(model=model.eval(), config=cfg, checkpoint=path, iteration=iteration,
                       backend=name)


__all__ = ["LoadedModel", "every_checkpoint", "find_checkpoint", "inference_process",
           "load_model", "saved_config"]
