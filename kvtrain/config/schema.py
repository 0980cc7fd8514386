"""The typed config of a kvtrain run: one dataclass per section.

A YAML file maps onto ``RunConfig``; every field has a docstring (the string
under it). Cross-field checks live in ``RunConfig.validate`` and each gives one
clear line naming the keys involved. The translation into megatron's
``TransformerConfig`` is ``kvtrain.model.builder.transformer_config``.

Vanilla and KV shifting differ by one key: ``model.attention``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal, Optional

from kvtrain.tasks.config import TASK_TYPES, InductionDataConfig, NgramDataConfig

from .compat import check_allowed_keys
from .layout import derive_layout, total_steps
from .loader import ConfigError
from .model import (  # noqa: F401 (sections of RunConfig)
    KVShiftConfig, MLAConfig, ModelConfig, ShiftHeadsConfig,
)


# ----------------------------------------------------------------------------- parallelism
@dataclass
class ParallelConfig:
    """How the model and data are split over processes."""

    tensor: int = 1
    """Tensor-parallel size."""
    pipeline: int = 1
    """Pipeline-parallel size."""
    virtual_pipeline: Optional[int] = None
    """Virtual pipeline stages per rank (interleaved schedule); null for none."""
    context: int = 1
    """Context-parallel size: each sequence is cut into 2 x context chunks and CP rank r
    keeps chunks r and 2 x context - 1 - r (megatron's layout); the KV shift fetches
    its w halo tokens from the neighbouring CP ranks. Backends te and torch (not local)."""
    sequence_parallel: bool = False
    """Sequence parallelism in the TP group (norms/dropout on sequence shards)."""
    distributed_optimizer: bool = True
    """Shard optimizer state over data-parallel ranks (ZeRO-1)."""
    recompute: Literal["none", "selective", "full"] = "none"
    """Activation recomputation."""
    overlap_grad_reduce: bool = False
    """Overlap the DP gradient reduce-scatter with backward (GPU runs)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's param all-gather with forward (GPU runs);
    needs ``distributed_optimizer``."""
    cp_comm_type: Literal["p2p", "all_gather", "a2a"] = "p2p"
    """Context-parallel communication of Transformer Engine's attention (model.backend te):
    p2p (ring), all_gather, or a2a (needs the KV heads per TP rank to divide by
    parallel.context). The torch backend always all-gathers K and V over the CP group
    (the backend line and `kvtrain plan` say which exchange runs)."""


# ----------------------------------------------------------------------------- training
@dataclass
class TrainConfig:
    """The training loop."""

    micro_batch_size: int = 2
    """Sequences per micro batch per data-parallel rank."""
    global_batch_size: int = 8
    """Sequences per optimizer step, all ranks together."""
    seq_length: int = 128
    """Tokens per sequence (<= model.max_position_embeddings)."""
    max_steps: Optional[int] = 100
    """Optimizer steps to run (null: derived from train_tokens)."""
    train_tokens: Optional[int] = None
    """Stop after this many tokens (the paper's TOTAL TOKENS)."""
    seed: int = 1234
    """Seed of weights, data order and dropout."""
    precision: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    """Numerics: auto is bf16 with fp32 main params on GPU, fp32 on CPU."""
    log_interval: int = 10
    """Steps between log lines (metrics.jsonl, stdout, wandb)."""
    eval_interval: Optional[int] = 100
    """Steps between validations; null disables."""
    eval_iters: int = 10
    """Batches per validation."""
    kv_shift_stats_interval: Optional[int] = 100
    """Steps between alpha/beta statistics (KV-shift models)."""
    exit_duration_minutes: Optional[float] = None
    """Save and stop after this many minutes of wall time."""
    max_consecutive_nonfinite: int = 10
    """Save and stop after this many non-finite steps in a row (fp16 overflows count
    under a constant ``optimizer.loss_scale``, which never backs off; not under the
    dynamic one, which does)."""
    peak_tflops_per_device: Optional[float] = None
    """Peak dense TFLOP/s of one device at the run's precision, for MFU (null: guessed
    from the device name for bf16/fp16; an fp32 run reports no MFU unless this names
    its peak: TF32's under TE, whose GEMMs use it, else FP32's)."""
    dist_timeout_minutes: float = 10.0
    """Timeout of collective operations (a hung rank fails the job after this)."""
    device: Literal["auto", "cuda", "cpu"] = "auto"
    """``auto``: the GPU when torch sees one, else the CPU - but a process the launcher
    gave GPUs (CUDA_VISIBLE_DEVICES, SLURM's GPU variables, /dev/nvidiaN) that torch
    cannot see stops in one line instead of training on the CPU; ``cuda``: a GPU is
    required; ``cpu``: train on the CPU on purpose, even on a GPU node (the GPUs must
    be hidden from torch, e.g. CUDA_VISIBLE_DEVICES=)."""


@dataclass
class OptimizerConfig:
    """AdamW and the learning-rate schedule."""

    lr: float = 3e-4
    """Peak learning rate."""
    min_lr: Optional[float] = None
    """Floor of decaying schedules (null: lr for constant, 0.1*lr otherwise)."""
    weight_decay: float = 0.1
    """AdamW weight decay (not on norms, biases, or KV-shift coefficients unless enabled)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables)."""
    lr_warmup_steps: int = 0
    """Linear warmup steps."""
    lr_schedule: Literal["constant", "cosine", "wsd"] = "constant"
    """After warmup: constant (paper), cosine decay, or warmup-stable-decay."""
    lr_decay_steps: Optional[int] = None
    """Steps of the decaying part (null: to the end of training)."""
    wsd_decay_steps: Optional[int] = None
    """Final decay steps of the wsd schedule."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """Shape of the final decay of the wsd schedule."""
    loss_scale: Optional[float] = None
    """fp16 only: a constant loss scale; null uses megatron's dynamic loss scaling."""

    def check_wsd_fits(self, horizon: int, moved: str = "") -> None:
        """The wsd decay fits after the warmup in a schedule of ``horizon`` steps
        (megatron starts it at horizon - wsd_decay_steps, even inside the warmup);
        ``moved``: why the horizon is not a fresh run's (a resume moved it)."""
        if self.lr_schedule == "wsd" and self.wsd_decay_steps > horizon - self.lr_warmup_steps:
            raise ConfigError(
                f"optimizer.wsd_decay_steps ({self.wsd_decay_steps}) must fit after the warmup "
                f"in the schedule ({horizon} steps, warmup {self.lr_warmup_steps}){moved}")


# ----------------------------------------------------------------------------- data
@dataclass
class DataConfig:
    """Where training tokens come from."""

    type: Literal["gpt", "mock", "induction", "ngram"] = "mock"
    """``gpt``: Megatron .bin/.idx shards; ``mock``: random tokens for smoke runs;
    ``induction`` / ``ngram``: the paper's toy tasks (Appendix K / E.3), with their
    accuracy evaluated at every validation (options in data.induction / data.ngram)."""
    paths: list[float | str] = field(default_factory=list)
    """Shard prefixes, optionally with weights: [0.7, a_text_document, 0.3, b_text_document].
    Without weights, several prefixes are one corpus (each weighted by its tokens)."""
    split: str = "969,30,1"
    """Train/valid/test split weights over documents."""
    tokenizer: Optional[str] = None
    """SentencePiece model (its sidecar JSON gives BOS/EOS/PAD ids)."""
    cache_dir: Optional[str] = None
    """Folder for index caches (default: <run_dir>/data_cache; relative: to the
    working folder, as ``data.paths`` are; runs on the same data may share one)."""
    reset_attention_mask: bool = False
    """Packed documents: attention and the KV shift stop at every end-of-document
    token (Megatron-LM's name). Document ids are computed once per micro batch from
    the tokens and the EOD id and handed to the layers: THD packing on ``te``,
    FlexAttention / SDPA masks on ``torch``, an explicit mask on ``local``."""
    eod_mask_loss: bool = False
    """Mask the loss on end-of-document tokens."""
    num_workers: int = 1
    """DataLoader workers per rank (0 reads in the training process)."""
    seed: Optional[int] = None
    """Seed of the document/sample shuffle (null: train.seed)."""
    eod_id: Optional[int] = None
    """End-of-document id when data.tokenizer is null (shards from another tokenizer);
    needed only by reset_attention_mask and eod_mask_loss."""
    induction: InductionDataConfig = field(default_factory=InductionDataConfig)
    """Options of data.type induction."""
    ngram: NgramDataConfig = field(default_factory=NgramDataConfig)
    """Options of data.type ngram."""
    eval_seed: Optional[int] = None
    """Seed of the fixed validation set of induction/ngram data (null: data seed + 1000003)."""


# ----------------------------------------------------------------------------- checkpoints & logs
@dataclass
class CheckpointConfig:
    """Distributed checkpoints (megatron dist_checkpointing, torch_dist)."""

    dir: Optional[str] = None
    """Checkpoint folder (default: <run_dir>/checkpoints; relative: under the run folder)."""
    save_interval: Optional[int] = 100
    """Steps between saves; null saves only at the end and on signals."""
    keep_last: Optional[int] = 3
    """Keep the newest K checkpoints; null keeps all."""
    resume: str = "auto"
    """``auto``: the checkpoint ``latest`` names, else (damaged, missing) the newest intact
    one; ``none`` (refused where checkpoints exist); or a checkpoint path (no fallback): the
    run's first start; a rerun continues from the run's own checkpoints descending from it."""
    async_save: bool = False
    """Write checkpoints in the background (GPU runs)."""
    save_on_exit: bool = True
    """Save when stopping on a signal, time limit, or the end of training."""
    load_optimizer: bool = True
    """Restore optimizer and scheduler state on resume (false: weights only, a fresh
    optimizer and, as Megatron-LM's --no-load-optim, an LR schedule from its step 0,
    warmup included, while the iteration count goes on: a decaying schedule ends with
    the run only if optimizer.lr_decay_steps is set to the steps left)."""
    load_rng: bool = True
    """Restore every rank's RNG states on resume (skipped when the TP/PP/DP layout changed)."""
    allow_config_changes: list[str] = field(default_factory=list)
    """Keys (or sections) that may differ from the checkpoint's saved config on resume,
    e.g. [train.seq_length] for a longer context. Resume compares the model section,
    train.seq_length and the data (type, paths, split, tokenizer, seed, toy tasks,
    eod_id, eod_mask_loss, reset_attention_mask);
    any other difference stops the run with one line. Allowed changes are printed
    and recorded as an event in metrics.jsonl."""
    verify: Literal["full", "sizes", "none"] = "full"
    """Check a checkpoint against the file list of its marker before loading it: ``full``
    sizes and CRC-32 checksums (split over ranks), ``sizes`` only sizes (O(files): catches
    truncated and deleted files, not bit rot), ``none`` nothing. A damaged checkpoint is
    skipped for the previous one under resume ``auto``, an error under an explicit path."""


@dataclass
class WandbConfig:
    """Weights & Biases logging."""

    enabled: bool = True
    """Log to wandb."""
    project: str = "kvtrain"
    """wandb project."""
    entity: Optional[str] = None
    """wandb entity (team or user)."""
    name: Optional[str] = None
    """Run name (default: the run name)."""
    group: Optional[str] = None
    """Run group (e.g. a vanilla/KV-shift pair)."""
    tags: list[str] = field(default_factory=list)
    """Run tags."""
    dir: Optional[str] = None
    """Folder wandb writes its ``wandb/`` folder into (default: the run folder, so
    <run_dir>/wandb; relative: under the run folder)."""
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: offline unless WANDB_MODE says otherwise or an API key is set."""


# The longest timeout torch's process groups hold (int64 nanoseconds); beyond
# it each rank failed at start (an OverflowError, or a negative socket timeout).
_MAX_TIMEOUT_MINUTES = (2**63 - 1) // (60 * 10**9)


def _check_seeds(seeds: dict) -> None:
    """megatron's datasets seed numpy.random.RandomState, which takes 0 to 2**32 - 1
    (the toy tasks' SeedSequence no negative one): a seed outside failed on every
    rank after the process group started."""
    for key, seed in seeds.items():
        if seed is not None and not 0 <= seed < 2**32:
            raise ConfigError(f"{key} must be in [0, 2**32 - 1], got {seed}")


@dataclass
class RunConfig:
    """A whole run: one YAML file."""

    name: str = "run"
    """Run name (run folder and wandb name)."""
    run_dir: Optional[str] = None
    """Run folder (default: runs/<name>); --run-dir overrides."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The model."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Training loop."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """Optimizer and schedule."""
    data: DataConfig = field(default_factory=DataConfig)
    """Data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoints."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """wandb."""

    def validate(self, world_size: Optional[int] = None) -> None:
        """Cross-field checks, each one clear line. ``world_size`` enables DP checks."""
        m, p, t = self.model, self.parallel, self.train
        if not self.name.strip():  # runs/<name> would be runs itself
            raise ConfigError("name is empty: it names the run (its folder runs/<name> and its "
                              "wandb run)")
        m.validate()
        if p.tensor < 1 or p.pipeline < 1 or p.context < 1:
            raise ConfigError("parallel.tensor, parallel.pipeline and parallel.context must be >= 1")
        if p.context > 1:
            self._validate_context_parallel()
        if m.num_attention_heads % p.tensor:
            raise ConfigError(
                f"model.num_attention_heads ({m.num_attention_heads}) must be divisible by "
                f"parallel.tensor ({p.tensor})"
            )
        if m.kv_heads % p.tensor:
            raise ConfigError(
                f"model.num_query_groups ({m.kv_heads}) must be divisible by "
                f"parallel.tensor ({p.tensor})"
            )
        if m.ffn_size % p.tensor:
            raise ConfigError(
                f"model.ffn_hidden_size ({m.ffn_size}) must be divisible by parallel.tensor ({p.tensor})"
            )
        if m.mla is not None:
            # megatron's local MLA spec splits the down projections over TP too
            widths = {"model.mla.kv_lora_rank + model.mla.qk_pos_emb_head_dim":
                      m.mla.kv_lora_rank + m.mla.qk_pos_emb_head_dim,
                      "model.mla.q_lora_rank": m.mla.q_lora_rank or 0}
            for key, width in widths.items():
                if width % p.tensor:
                    raise ConfigError(f"{key} ({width}) must be divisible by parallel.tensor "
                                      f"({p.tensor})")
        stages = p.pipeline * (p.virtual_pipeline or 1)
        if m.num_layers % stages:
            raise ConfigError(
                f"model.num_layers ({m.num_layers}) must be divisible by parallel.pipeline "
                f"x parallel.virtual_pipeline ({stages})"
            )
        if p.virtual_pipeline is not None and p.pipeline < 2:
            raise ConfigError("parallel.virtual_pipeline needs parallel.pipeline >= 2")
        if p.sequence_parallel and p.tensor < 2:
            raise ConfigError("parallel.sequence_parallel needs parallel.tensor >= 2")
        if p.overlap_param_gather and not p.distributed_optimizer:  # as Megatron-LM refuses it
            raise ConfigError("parallel.overlap_param_gather needs parallel.distributed_optimizer "
                              "(it overlaps that optimizer's parameter all-gather)")
        if p.sequence_parallel and t.seq_length % (p.tensor * p.context):
            raise ConfigError(
                f"train.seq_length ({t.seq_length}) must be divisible by parallel.tensor "
                f"x parallel.context ({p.tensor * p.context}) with sequence parallel"
            )
        if t.seq_length > m.max_position_embeddings:
            raise ConfigError(
                f"train.seq_length ({t.seq_length}) exceeds model.max_position_embeddings "
                f"({m.max_position_embeddings})"
            )
        if t.micro_batch_size < 1 or t.global_batch_size < 1:
            raise ConfigError("train.micro_batch_size and train.global_batch_size must be >= 1")
        if t.max_steps is None and t.train_tokens is None:
            raise ConfigError("set train.max_steps or train.train_tokens")
        if world_size is not None:
            derive_layout(self, world_size)  # DP, micro batches: one rule (config/layout.py)
        self._validate_train()
        self._validate_optimizer()
        self._validate_data()
        self._validate_checkpoint()

    def _validate_context_parallel(self) -> None:
        """What context parallelism needs (``parallel.context`` > 1)."""
        m, p, t = self.model, self.parallel, self.train
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

    # The sections owned by the trainer; each check names its keys.
    def _validate_train(self) -> None:
        t = self.train
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
        _check_seeds({"train.seed": t.seed})

    def _validate_optimizer(self) -> None:
        o = self.optimizer
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
            o.check_wsd_fits(o.lr_decay_steps or total_steps(self)[0])
        if o.loss_scale is not None and o.loss_scale <= 0:
            raise ConfigError(f"optimizer.loss_scale must be positive, got {o.loss_scale}")

    def _validate_data(self) -> None:
        d = self.data
        if d.type == "gpt" and not d.paths:
            raise ConfigError("data.paths is empty: name at least one shard prefix for data.type gpt")
        if d.paths:
            weights = [x for x in d.paths if not isinstance(x, str)]
            if weights and (len(d.paths) % 2 or any(
                    not isinstance(w, (int, float)) or not isinstance(pth, str)
                    for w, pth in zip(d.paths[0::2], d.paths[1::2]))):
                raise ConfigError(
                    "data.paths must be all prefixes or weight, prefix pairs "
                    f"([0.7, a_text_document, 0.3, b_text_document]), got {d.paths}"
                )
            if any(w <= 0 for w in weights):
                raise ConfigError(f"data.paths weights must be positive, got {weights}")
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
        if self.train.eval_interval is not None and (len(values) < 2 or values[1] == 0):
            raise ConfigError(
                f"data.split {d.split!r} has no validation part but train.eval_interval is set "
                "(give the validation part a weight or set train.eval_interval: null)"
            )
        _check_seeds({"data.seed": d.seed, "data.eval_seed": d.eval_seed})
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
                validate_config(self)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if d.eod_id is not None and not 0 <= d.eod_id < self.model.vocab_size:
            raise ConfigError(
                f"data.eod_id ({d.eod_id}) must be a token id below model.vocab_size "
                f"({self.model.vocab_size})"
            )

    def _validate_checkpoint(self) -> None:
        c = self.checkpoint
        if c.save_interval is not None and c.save_interval < 1:
            raise ConfigError(f"checkpoint.save_interval must be >= 1 (or null), got {c.save_interval}")
        if c.keep_last is not None and c.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last must be >= 1 (or null), got {c.keep_last}")
        if not c.resume.strip():
            raise ConfigError("checkpoint.resume must be auto, none, or a checkpoint path")
        check_allowed_keys(c.allow_config_changes)
