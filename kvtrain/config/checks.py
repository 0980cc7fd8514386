"""The cross-key checks of a run's config, section by section: each raises one
``ConfigError`` line naming the keys involved. ``RunConfig.validate``
(``schema.py``) runs them after its own layout checks."""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING

from kvtrain.tasks.config import TASK_TYPES

from .compat import check_allowed_keys
from .layout import total_steps
from .loader import ConfigError

if TYPE_CHECKING:
    from .schema import ProfileConfig, RunConfig


# The longest timeout torch's process groups hold (int64 nanoseconds); beyond
# it each rank failed at start (an OverflowError, or a negative socket timeout).
_MAX_TIMEOUT_MINUTES = (2**63 - 1) // (60 * 10**9)


def check_seeds(seeds: dict) -> None:
    """megatron's datasets seed numpy.random.RandomState, which takes 0 to 2**32 - 1
    (the toy tasks' SeedSequence no negative one): a seed outside failed on every
    rank after the process group started."""
    for key, seed in seeds.items():
        if seed is not None and not 0 <= seed < 2**32:
            raise ConfigError(f"{key} must be in [0, 2**32 - 1], got {seed}")


def check_context_parallel(cfg: RunConfig) -> None:
    """What context parallelism needs (``parallel.context`` > 1)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    if m.backend == "local":
        raise ConfigError(
            f"parallel.context ({p.context}) needs model.backend torch or te: the local "
            "backend's attention (megatron's DotProductAttention) has no context parallelism")
    if m.mla is not None:
        raise ConfigError(
            f"parallel.context ({p.context}) with model.mla: multi-latent attention under "
            "context parallelism is not built yet (its halo and attention); set "
            "parallel.context: 1")
    chunks = 2 * p.context
    if t.seq_length % chunks:
        raise ConfigError(
            f"train.seq_length ({t.seq_length}) must be divisible by 2 x parallel.context "
            f"({chunks}): each CP rank keeps two of {chunks} equal chunks")
    if m.attention == "kv_shift" and m.kv_shift.window > t.seq_length // chunks:
        raise ConfigError(
            f"model.kv_shift.window ({m.kv_shift.window}) exceeds a context-parallel chunk "
            f"(train.seq_length / (2 x parallel.context) = {t.seq_length // chunks} tokens)")
    if p.cp_comm_type == "a2a" and (m.kv_heads // p.tensor) % p.context:
        raise ConfigError(
            f"parallel.cp_comm_type a2a needs the KV heads per TP rank (model.num_query_groups "
            f"{m.kv_heads} / parallel.tensor {p.tensor}) to be divisible by parallel.context "
            f"({p.context}); use p2p or all_gather")


def check_schedule_layout(cfg: RunConfig) -> None:
    """What the training step's pipeline schedule needs of ``parallel`` beyond the
    layout checks of ``RunConfig.validate``."""
    if cfg.parallel.virtual_pipeline == 1:
        # megatron takes its interleaved schedule for any virtual size, and one chunk
        # per rank reached it bare: every rank's first step died in a TypeError
        # ('DistributedDataParallel' object is not subscriptable); Megatron-LM reads 1
        # as no interleaving
        raise ConfigError("parallel.virtual_pipeline 1 is one model chunk per pipeline "
                          "rank, no interleaving: set it to null (or to 2 or more for the "
                          "interleaved schedule)")


def check_train(cfg: RunConfig) -> None:
    check_schedule_layout(cfg)  # the schedule is the training step's (see above)
    t = cfg.train
    positive = {
        "train.max_steps": t.max_steps, "train.train_tokens": t.train_tokens,
        "train.log_interval": t.log_interval, "train.eval_interval": t.eval_interval,
        "train.kv_shift_stats_interval": t.kv_shift_stats_interval,
        "train.max_consecutive_nonfinite": t.max_consecutive_nonfinite,
        "train.exit_duration_minutes": t.exit_duration_minutes,
        "train.peak_tflops_per_device": t.peak_tflops_per_device,
        "train.dist_timeout_minutes": t.dist_timeout_minutes,
    }
    for key, value in positive.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{key} must be positive (or null), got {value}")
    if t.dist_timeout_minutes > _MAX_TIMEOUT_MINUTES:
        raise ConfigError(f"train.dist_timeout_minutes must be at most {_MAX_TIMEOUT_MINUTES} "
                          f"(torch keeps it in 64-bit nanoseconds, 292 years), got "
                          f"{t.dist_timeout_minutes}")
    if t.eval_interval is not None and t.eval_iters < 1:
        raise ConfigError(f"train.eval_iters must be >= 1 when train.eval_interval is set, "
                          f"got {t.eval_iters}")
    if t.seq_length < 1:
        raise ConfigError(f"train.seq_length must be positive, got {t.seq_length}")
    check_seeds({"train.seed": t.seed})

def check_optimizer(cfg: RunConfig) -> None:
    o = cfg.optimizer
    if o.lr <= 0:
        raise ConfigError(f"optimizer.lr must be positive, got {o.lr}")
    if o.min_lr is not None and not 0 <= o.min_lr <= o.lr:
        raise ConfigError(f"optimizer.min_lr ({o.min_lr}) must be in [0, optimizer.lr ({o.lr})]")
    if o.weight_decay < 0 or o.clip_grad < 0 or o.adam_eps <= 0:
        raise ConfigError("optimizer.weight_decay and optimizer.clip_grad must be >= 0 and "
                          "optimizer.adam_eps > 0")
    for key in ("adam_beta1", "adam_beta2"):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(f"optimizer.{key} must be in [0, 1), got {getattr(o, key)}")
    if o.lr_warmup_steps < 0:
        raise ConfigError(f"optimizer.lr_warmup_steps must be >= 0, got {o.lr_warmup_steps}")
    if o.lr_decay_steps is not None and o.lr_decay_steps <= o.lr_warmup_steps:
        raise ConfigError(
            f"optimizer.lr_decay_steps ({o.lr_decay_steps}) must exceed "
            f"optimizer.lr_warmup_steps ({o.lr_warmup_steps})"
        )
    if o.lr_schedule == "wsd":
        if not o.wsd_decay_steps:
            raise ConfigError("optimizer.lr_schedule wsd needs optimizer.wsd_decay_steps")
        if o.wsd_decay_steps < 1:  # megatron would never start the decay
            raise ConfigError(f"optimizer.lr_schedule wsd needs optimizer.wsd_decay_steps "
                              f">= 1, got {o.wsd_decay_steps}")
        # the scheduler's horizon (build_scheduler): train.max_steps or train_tokens
        o.check_wsd_fits(o.lr_decay_steps or total_steps(cfg)[0])
    if o.loss_scale is not None and o.loss_scale <= 0:
        raise ConfigError(f"optimizer.loss_scale must be positive, got {o.loss_scale}")
    if o.loss_scale is not None and cfg.train.precision != "fp16":
        # megatron applies it at bf16 (and fp32 under the distributed optimizer) and
        # drops it at fp32 without: one key, two meanings, neither asked for
        raise ConfigError(f"optimizer.loss_scale ({o.loss_scale}) scales fp16's loss: "
                          f"train.precision is {cfg.train.precision}; set it to fp16 or "
                          "optimizer.loss_scale: null")


def setting_warnings(cfg: "RunConfig", steps: int) -> list[str]:
    """What of the settings will not train as written, said at start and in the plan,
    not refused: the LR schedule's (:func:`_schedule_warnings`), a token budget that
    ``train.max_steps`` cuts short (whichever comes first ends the run: a smoke run of a
    paper config does it on purpose), and shards or a split that a ``data.type`` making
    its own sequences never reads (``--set data.type=mock`` over a config of shards)."""
    warnings = _schedule_warnings(cfg, steps)
    t, d = cfg.train, cfg.data
    if t.train_tokens and t.max_steps is not None:
        by_tokens = math.ceil(t.train_tokens / (t.global_batch_size * t.seq_length))
        if t.max_steps < by_tokens:
            warnings.append(
                f"train.max_steps ({t.max_steps}) ends the run before train.train_tokens "
                f"({t.train_tokens:,} tokens: {by_tokens:,} steps): set train.max_steps: "
                "null to train on the tokens")
    unread = [key for key, given in (("data.paths", d.paths),
                                     ("data.split", d.split != type(d).split)) if given]
    if d.type != "gpt" and unread:
        warnings.append(f"{' and '.join(unread)} not read: data.type {d.type} makes its own "
                        "sequences (data.type: gpt trains on the shards)")
    return warnings


def _schedule_warnings(cfg: "RunConfig", steps: int) -> list[str]:
    """A warmup longer than the run (update k runs at lr * k / warmup), and keys the
    chosen LR schedule never reads (a sweep over schedules shares them)."""
    o, warnings = cfg.optimizer, []
    if o.lr_warmup_steps > steps:
        warnings.append(
            f"optimizer.lr_warmup_steps ({o.lr_warmup_steps}) is longer than the run "
            f"({steps} steps): the LR never reaches optimizer.lr ({o.lr:g}); its last step "
            f"trains at {o.lr * steps / o.lr_warmup_steps:.3g}")
    if o.lr_schedule == "constant":
        keys, why = ("min_lr", "lr_decay_steps", "wsd_decay_steps", "wsd_decay_style"), (
            "keeps optimizer.lr after the warmup (cosine or wsd decay)")
    elif o.lr_schedule == "cosine":
        keys, why = ("wsd_decay_steps", "wsd_decay_style"), (
            "decays from the warmup to optimizer.lr_decay_steps (wsd: its last steps)")
    else:
        keys = ()
    default_style = type(o).wsd_decay_style  # the class attribute: set only if not it
    unused = [f"optimizer.{key} ({_shown(getattr(o, key))})" for key in keys
              if getattr(o, key) is not None
              and not (key == "wsd_decay_style" and o.wsd_decay_style == default_style)]
    if unused:
        warnings.append(f"{', '.join(unused)} not used: optimizer.lr_schedule "
                        f"{o.lr_schedule} {why}")
    return warnings


def _shown(value) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def check_blend(key: str, paths: list) -> None:
    """``paths``: all prefixes, or (positive weight, prefix) pairs."""
    weights = [x for x in paths if not isinstance(x, str)]
    if weights and (len(paths) % 2 or any(
            not isinstance(w, (int, float)) or not isinstance(pth, str)
            for w, pth in zip(paths[0::2], paths[1::2]))):
        raise ConfigError(
            f"{key} must be all prefixes or weight, prefix pairs "
            f"([0.7, a_text_document, 0.3, b_text_document]), got {paths}"
        )
    # nan passed `w <= 0`, and weights whose sum overflows made megatron's
    # normalised weights nan: an assertion deep in its blend builder, or a ValueError
    if any(isinstance(w, bool) or not math.isfinite(w) or w <= 0 for w in weights):
        raise ConfigError(f"{key} weights must be positive finite numbers, got {weights}")
    if not math.isfinite(sum(weights)):
        raise ConfigError(f"{key} weights must sum to a finite number, got {weights}: scale "
                          "them down (only their ratios count)")


def _check_valid_paths(cfg: RunConfig, split: list[float]) -> None:
    """A held-out validation set (``data.valid_paths``) replaces data.split's parts."""
    d = cfg.data
    check_blend("data.valid_paths", d.valid_paths)
    if d.type != "gpt":
        raise ConfigError(f"data.valid_paths names shards: it needs data.type gpt, not "
                          f"{d.type}")
    if cfg.train.eval_interval is None:
        raise ConfigError("data.valid_paths is set but train.eval_interval is null: nothing "
                          "validates on it (set train.eval_interval)")
    if d.split != type(d).split and any(split[1:]):  # the class attribute: the default
        raise ConfigError(
            f"data.split {d.split!r} gives data.paths validation or test parts, but "
            "data.valid_paths is the validation set and the training draws from all of "
            "data.paths: leave data.split out (or give the training part alone: '100')")


# a name is one part of a wandb key (valid/NAME/val_loss) and of a record: no '/', no spaces
SET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _check_valid_sets(cfg: RunConfig) -> None:
    """Named validation sets (``data.valid_sets``): shards, scored at every evaluation."""
    d = cfg.data
    for name, paths in d.valid_sets.items():
        key = f"data.valid_sets.{name}"
        if not SET_NAME.fullmatch(name):
            raise ConfigError(f"{key}: a set's name is letters, digits, '_', '-' and '.', "
                              f"starting with a letter or digit (it names its wandb curve, "
                              f"valid/NAME/val_loss)")
        if not paths:
            raise ConfigError(f"{key} is empty: name its shards (the forms of data.paths), "
                              f"or leave the set out")
        check_blend(key, paths)
    if d.type != "gpt":
        raise ConfigError(f"data.valid_sets names shards: it needs data.type gpt, not {d.type}")
    if cfg.train.eval_interval is None:
        raise ConfigError("data.valid_sets is set but train.eval_interval is null: nothing "
                          "validates on them (set train.eval_interval)")


def check_data(cfg: RunConfig) -> None:
    d = cfg.data
    if d.type == "gpt" and not d.paths:
        raise ConfigError("data.paths is empty: name at least one shard prefix for data.type gpt")
    if d.paths:
        check_blend("data.paths", d.paths)
    parts = [x.strip() for x in d.split.split(",")]
    # plain decimals only: megatron reads the split as the runs of digits and dots
    # in it, so 1e-3, 1_000 or inf (float() takes them) would be other numbers there
    plain = all(re.fullmatch(r"[0-9]+\.?[0-9]*|\.[0-9]+", x) for x in parts)
    values = [float(x) for x in parts] if plain else []
    if not 1 <= len(values) <= 3 or any(v < 0 for v in values) or not values[0] > 0:
        raise ConfigError(
            f"data.split must be up to three non-negative training,validation,test weights "
            f"with a positive training part (e.g. '969,30,1'), got {d.split!r}"
        )
    if d.valid_paths:
        _check_valid_paths(cfg, values)
    elif cfg.train.eval_interval is not None and (len(values) < 2 or values[1] == 0):
        raise ConfigError(
            f"data.split {d.split!r} has no validation part but train.eval_interval is set "
            "(give the validation part a weight or set train.eval_interval: null)"
        )
    if d.valid_sets:
        _check_valid_sets(cfg)
    check_seeds({"data.seed": d.seed, "data.eval_seed": d.eval_seed})
    if d.num_workers < 0:
        raise ConfigError(f"data.num_workers must be >= 0, got {d.num_workers}")
    needs_eod = d.reset_attention_mask or d.eod_mask_loss
    if d.type == "gpt" and needs_eod and d.tokenizer is None and d.eod_id is None:
        raise ConfigError(
            "data.reset_attention_mask/eod_mask_loss need the "
            "end-of-document id: set data.tokenizer or data.eod_id"
        )
    if d.type in TASK_TYPES:
        from kvtrain.tasks.sequences import validate_config  # numpy, only for toy tasks

        try:
            validate_config(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if d.eod_id is not None and not 0 <= d.eod_id < cfg.model.vocab_size:
        raise ConfigError(
            f"data.eod_id ({d.eod_id}) must be a token id below model.vocab_size "
            f"({cfg.model.vocab_size})"
        )

def check_checkpoint(cfg: RunConfig) -> None:
    c = cfg.checkpoint
    if c.save_interval is not None and c.save_interval < 1:
        raise ConfigError(f"checkpoint.save_interval must be >= 1 (or null), got {c.save_interval}")
    if c.keep_last is not None and c.keep_last < 1:
        raise ConfigError(f"checkpoint.keep_last must be >= 1 (or null), got {c.keep_last}")
    if not c.resume.strip():
        raise ConfigError("checkpoint.resume must be auto, none, or a checkpoint path")
    check_allowed_keys(c.allow_config_changes)


def check_profile(pr: ProfileConfig, world_size: int | None) -> None:
    """The trace window and its ranks (``profile``); a setting of a profile that traces
    nothing (``start_step`` null) is refused, not ignored."""
    if pr.start_step is None:
        default = type(pr)()
        for key in ("num_steps", "ranks", "record_shapes", "with_stack", "memory_history", "dir"):
            if getattr(pr, key) != getattr(default, key):
                raise ConfigError(f"profile.{key} is set but profile.start_step is null: no "
                                  "step is traced (set profile.start_step)")
        return
    if pr.start_step < 1 or pr.num_steps < 1:
        raise ConfigError(f"profile.start_step and profile.num_steps must be >= 1, got "
                          f"{pr.start_step} and {pr.num_steps}")
    if not pr.ranks:
        raise ConfigError("profile.ranks is empty: name the ranks that trace (e.g. [0])")
    if len(set(pr.ranks)) != len(pr.ranks) or min(pr.ranks) < 0:
        raise ConfigError(f"profile.ranks must be distinct ranks >= 0, got {pr.ranks}")
    if world_size is not None and max(pr.ranks) >= world_size:
        raise ConfigError(f"profile.ranks: rank {max(pr.ranks)} is not one of this run's "
                          f"{world_size} (0-{world_size - 1})")
