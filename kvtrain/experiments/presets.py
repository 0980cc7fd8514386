"""The induction experiments of the paper as run configs: Figure 1a (depth),
Figure 1b (width), the 3-gram control of Appendix E.3 and the k-hop task of
Appendix E.1 (Figure 8), a grid of arms with the same seed and data, at two scales.

A preset at a scale is one ``RunConfig`` (as a dict) that every arm shares;
an arm sets ``model.attention`` and ``model.num_layers``. The user's ``--set``
overrides use ``kvtrain train``'s grammar and checks
(``kvtrain.config.loader.apply_override``) and apply to every arm, after the
preset and before the arm's own keys; a ``--set`` of a key the arms vary is
refused (it would make the arms one model).

Presets (arms):

* ``fig1a`` - KV shift 1 layer; vanilla 1, 2 and 4 layers; same width.
* ``fig1b`` - hidden size 8: vanilla 2 layers vs KV shift 1 layer.
* ``ngram`` - the 3-gram task: vanilla vs KV shift, same depth and width.
* ``fig8`` - the k-hop task: vanilla vs KV shift at 2, 3 and 4 layers (the paper
  scale 2 to 6, as Sanford et al.'s runs: Figure 8's result is at 5); the
  error rate of each hop count (``hop_errors.png``). The paper "followed the
  code of Sanford et al. (2024b)", whose setting the paper scale takes: 4 symbols,
  hops 0..16, length 100, width 128 (4 heads), batch 32, AdamW lr 1e-4 with 1000
  warmup steps then a linear decay to 0 over 100k steps; GPT-2 there, kvtrain's
  Llama-style model (RoPE, SwiGLU, RMSNorm) here. The cpu scale asks for up to 8 hops.

Scales:

* ``paper`` - Appendix N / §3.2: Llama architecture, hidden 1024 (16 heads),
  vocabulary 8000, length 512 (App. K data with its defaults), AdamW
  lr 2e-4 with 1000 linear warmup steps then constant, β = (0.9, 0.95), weight
  decay 0.1, 8 GPUs x 512 samples = 4096 sequences per step. The number of
  steps is not given by the paper (10000 here). For GPUs.
* ``cpu`` - scaled down so that the fig1a grid finishes within 30 minutes on
  2 CPU cores (see docs/induction.md for the tuning and the measured numbers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from kvtrain.config import ConfigError, RunConfig
from kvtrain.config.loader import apply_override, from_dict
from kvtrain.tasks.config import TASK_TYPES

PRESETS = ("fig1a", "fig1b", "ngram", "fig8")
SCALES = ("cpu", "paper")

PER_ARM_KEYS = ("model.attention", "model.num_layers", "name", "run_dir", "wandb.name")
"""Keys each arm sets (the two that make the arms differ, and the arm's names)."""


@dataclass(frozen=True)
class Arm:
    """One model of a grid."""

    name: str
    attention: str  # vanilla | kv_shift
    num_layers: int


def preset_arms(preset: str, scale: str) -> list[Arm]:
    if preset == "fig1a":
        return [Arm("kv_shift-1L", "kv_shift", 1), Arm("vanilla-1L", "vanilla", 1),
                Arm("vanilla-2L", "vanilla", 2), Arm("vanilla-4L", "vanilla", 4)]
    if preset == "fig1b":
        return [Arm("kv_shift-1L", "kv_shift", 1), Arm("vanilla-2L", "vanilla", 2)]
    if preset == "ngram":
        return [Arm("kv_shift-2L", "kv_shift", 2), Arm("vanilla-2L", "vanilla", 2)]
    if preset == "fig8":
        depths = (2, 3, 4) if scale == "cpu" else (2, 3, 4, 5, 6)
        return [Arm(f"{attention}-{n}L", attention, n) for n in depths
                for attention in ("kv_shift", "vanilla")]
    raise ConfigError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")


def _every(interval: int) -> dict:
    """Train log, validation and KV-shift statistics at the same steps (one curve point each)."""
    return {"log_interval": interval, "eval_interval": interval,
            "kv_shift_stats_interval": interval}


# Shared by every preset and scale: the paper's optimizer (Appendix N) and the
# experiment's bookkeeping (no checkpoints at the cpu scale: an arm is short and
# an unfinished one restarts; resume auto, so that an arm rerun into its folder
# continues from its checkpoints where --set or the scale saves some).
_COMMON = {
    "model": {"rotary_base": 100000, "init_method_std": 0.02},
    "train": {"seed": 1234},
    "optimizer": {"lr_schedule": "constant", "weight_decay": 0.1, "adam_beta1": 0.9,
                  "adam_beta2": 0.95, "adam_eps": 1e-8, "clip_grad": 1.0},
    "data": {"type": "induction", "seed": 0, "eval_seed": 1_000_003, "num_workers": 0},
    "checkpoint": {"save_interval": None, "save_on_exit": False, "resume": "auto"},
    "wandb": {"project": "kvtrain-induction"},
}

# The paper's setting (Appendix N, §3.2, Appendix K): 4096 sequences per step,
# evaluated on one global batch (>= the 2048 sequences of the paper's eval).
_PAPER = {
    "model": {"hidden_size": 1024, "num_attention_heads": 16, "vocab_size": 8000},
    "train": {"micro_batch_size": 64, "global_batch_size": 4096, "seq_length": 512,
              "max_steps": 10000, "eval_iters": 1, **_every(250)},
    "optimizer": {"lr": 2e-4, "lr_warmup_steps": 1000},
    "data": {"induction": {"max_val": 8000}},
    # an arm takes hours on GPUs: a stopped or failed one resumes from these
    "checkpoint": {"save_interval": 1000, "save_on_exit": True},
}

# CPU: App. K data with length 128 (the pool of distinct ids per sequence is
# the length, as in the script) over ids 11..1023; hidden 64, 4 heads; a
# larger learning rate and a shorter warmup than the paper's 2e-4/1000;
# 8 x 32 = 256 fixed evaluation sequences.
_CPU = {
    "model": {"hidden_size": 64, "num_attention_heads": 4, "vocab_size": 1024},
    "train": {"micro_batch_size": 32, "global_batch_size": 32, "seq_length": 128,
              "max_steps": 1200, "eval_iters": 8, **_every(50)},
    "optimizer": {"lr": 3e-3, "lr_warmup_steps": 50},
    "data": {"induction": {"max_val": 1024}},
}

# Figure 1b: hidden size 8 (the width pressure test).
_FIG1B = {"model": {"hidden_size": 8, "num_attention_heads": 2, "ffn_hidden_size": 32}}
# At width 8 the script's data (a copy after each repeat, fresh draws
# otherwise) gives too sparse a signal to leave the initial plateau within a
# CPU budget (no movement in 3000 steps); §3.2's rule taken literally
# (``variant: strict``: the sequence continues as a copy after its first
# repeat) has the same scored first position and a dense copy signal. Same
# data for both arms.
_FIG1B_CPU = {"optimizer": {"lr": 1e-2}, "train": {"max_steps": 2000, **_every(100)},
              "data": {"induction": {"variant": "strict"}}}

# Appendix E.3: ~200 (x1, x2) pairs with a fixed x3 each.
_NGRAM = {"model": {"vocab_size": 128},
          "data": {"type": "ngram", "induction": None, "ngram": {"num_pairs": 200,
                                                                 "num_symbols": 32}}}
_NGRAM_CPU = {"train": {"seq_length": 96, "max_steps": 600}}

# Appendix E.1 / Figure 8: Sanford et al.'s k-hop setting (their code's defaults).
_HOP = {"model": {"hidden_size": 128, "num_attention_heads": 4, "ffn_hidden_size": 512,
                  "vocab_size": 32, "max_position_embeddings": 128},
        "train": {"micro_batch_size": 32, "global_batch_size": 32, "seq_length": 100},
        "data": {"type": "hop", "induction": None,
                 "hop": {"alphabet": 4, "min_hops": 0, "max_hops": 16}}}
_HOP_PAPER = {"train": {"max_steps": 100_000, "eval_iters": 8, **_every(1000)},
              "optimizer": {"lr": 1e-4, "lr_warmup_steps": 1000, "lr_schedule": "wsd",
                            "wsd_decay_steps": 99_000, "wsd_decay_style": "linear",
                            "min_lr": 0.0},
              "checkpoint": {"save_interval": 5000, "save_on_exit": True}}
# CPU: up to 8 hops (2^3), a larger learning rate, constant after a short warmup
_HOP_CPU = {"train": {"max_steps": 1500, "eval_iters": 8, **_every(150)},
            "optimizer": {"lr": 1e-3, "lr_warmup_steps": 100},
            "data": {"hop": {"max_hops": 8}}}


def _merge(base: dict, changes: dict) -> dict:
    """``base`` updated by ``changes`` section by section (a None value drops the key)."""
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def preset_config(preset: str, scale: str) -> dict:
    """The run config (a dict in the YAML's shape) every arm of ``preset`` at
    ``scale`` shares, before the user's overrides and the arm's keys."""
    if scale not in SCALES:
        raise ConfigError(f"unknown scale {scale!r}; one of {', '.join(SCALES)}")
    preset_arms(preset, scale)  # checks the name
    layers = [_COMMON, _CPU if scale == "cpu" else _PAPER]
    if preset == "fig1b":
        layers += [_FIG1B] + ([_FIG1B_CPU] if scale == "cpu" else [])
    if preset == "ngram":
        layers += [_NGRAM] + ([_NGRAM_CPU] if scale == "cpu" else [])
    if preset == "fig8":
        layers += [_HOP, _HOP_CPU if scale == "cpu" else _HOP_PAPER]
    out: dict = {}
    for layer in layers:
        out = _merge(out, layer)
    return out


def _override_key(assignment: str) -> str:
    return assignment.partition("=")[0].strip()


def owned_key(assignment: str, owned: Sequence[str]) -> Optional[str]:
    """The key of ``owned`` that the ``--set``/``--grid`` ``assignment`` sets (itself,
    or a section holding it), else None: a key a command sets after the user's."""
    key = _override_key(assignment)
    return next((k for k in owned if key == k or k.startswith(key + ".")), None)


def check_overrides(preset: str, scale: str, overrides: Sequence[str]) -> None:
    """Refuses a ``--set`` of a key that each arm sets (or of a section holding one)."""
    for assignment in overrides:
        key = _override_key(assignment)
        arm_key = owned_key(assignment, PER_ARM_KEYS)
        if arm_key is not None:
            varied = ", ".join(a.name for a in preset_arms(preset, scale))
            raise ConfigError(
                f"--set {key}: {arm_key} is set by each arm of preset {preset} ({varied}); "
                "choose arms with --arms, or train one config with kvtrain train")


def select_arms(preset: str, scale: str, names: Optional[Sequence[str]]) -> list[Arm]:
    arms = preset_arms(preset, scale)
    if not names:
        return arms
    unknown = [n for n in names if n not in {a.name for a in arms}]
    if unknown:
        raise ConfigError(f"--arms: unknown arm(s) {unknown}; preset {preset} has "
                          f"{[a.name for a in arms]}")
    return [a for a in arms if a.name in names]


def _check_own_checkpoints(base: dict) -> None:
    """An absolute ``checkpoint.dir`` is one folder for every arm (a relative one is
    under each arm's run folder): each arm would resume from the checkpoint another
    saved there, refused only once the earlier arms had trained (hours at the paper
    scale), and overwrite the others' checkpoints. Refused before any arm trains."""
    folder = (base.get("checkpoint") or {}).get("dir")
    if isinstance(folder, str) and Path(folder).expanduser().is_absolute():
        raise ConfigError(f"checkpoint.dir {folder} is one folder for every arm of the "
                          "experiment: leave it out or relative (each arm's run folder holds "
                          "its own)")


def arm_configs(preset: str, scale: str, overrides: Sequence[str] = (),
                arms: Optional[Sequence[str]] = None, world_size: int = 1,
                extra: Optional[dict[str, Any]] = None) -> list[tuple[Arm, RunConfig]]:
    """One validated ``RunConfig`` per arm: the preset, ``extra`` (the runner's
    own keys, e.g. the wandb group), the user's ``overrides`` (``KEY=VALUE``,
    kvtrain train's ``--set``), then the arm's keys."""
    check_overrides(preset, scale, overrides)
    base = _merge(preset_config(preset, scale), extra or {})
    for assignment in overrides:
        apply_override(base, assignment, RunConfig)
    # the results read each arm's accuracy records, which only the toy tasks have:
    # refused here, not after every arm has trained
    data_type = (base.get("data") or {}).get("type")
    if data_type not in TASK_TYPES:
        raise ConfigError(f"data.type {data_type!r}: kvtrain experiment induction trains the toy "
                          f"tasks (data.type {' or '.join(TASK_TYPES)}); train other data with "
                          "kvtrain train")
    _check_own_checkpoints(base)
    out = []
    for arm in select_arms(preset, scale, arms):
        data = _merge(base, {"name": arm.name, "model": {"attention": arm.attention,
                                                          "num_layers": arm.num_layers}})
        cfg = from_dict(RunConfig, data)
        cfg.validate(world_size=world_size)
        if cfg.train.eval_interval is None:  # the same for every arm
            raise ConfigError("train.eval_interval null: kvtrain experiment reads each arm's "
                              "curve from its validation records; give it an interval")
        out.append((arm, cfg))
    return out
