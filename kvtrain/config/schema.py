"""The typed config of a kvtrain run: one dataclass per section.

A YAML file maps onto ``RunConfig``; every field has a docstring (the string
under it). Cross-field checks live in ``RunConfig.validate`` (the layout's) and
``checks.py`` (each section's); each gives one clear line naming the keys
involved. The translation into megatron's ``TransformerConfig`` is
``kvtrain.model.builder.transformer_config``.

Vanilla and KV shifting differ by one key: ``model.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from kvtrain.tasks.config import HopDataConfig, InductionDataConfig, NgramDataConfig

from . import checks
from .layout import derive_layout
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
    """Overlap the DP gradient reduce-scatter with backward (it pays on GPUs; the CPU's
    gloo runs it too)."""
    overlap_param_gather: bool = False
    """Overlap the distributed optimizer's param all-gather with forward (it pays on
    GPUs; the CPU's gloo runs it too); needs ``distributed_optimizer``."""
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
    """The update at which a decaying schedule reaches min_lr, counted from the first
    update, warmup included (megatron's lr_decay_steps: the decay itself takes
    lr_decay_steps - lr_warmup_steps updates); null: the run's last step."""
    wsd_decay_steps: Optional[int] = None
    """Final decay steps of the wsd schedule."""
    wsd_decay_style: Literal["linear", "cosine", "exponential", "minus_sqrt"] = "linear"
    """Shape of the final decay of the wsd schedule."""
    loss_scale: Optional[float] = None
    """fp16 only (train.precision: fp16): a constant loss scale; null uses megatron's
    dynamic loss scaling."""

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

    type: Optional[Literal["gpt", "mock", "induction", "ngram", "hop"]] = None
    """``gpt``: Megatron .bin/.idx shards; ``mock``: random tokens for smoke runs;
    ``induction`` / ``ngram`` / ``hop``: the paper's toy tasks (Appendix K / E.3 / E.1),
    with their accuracy evaluated at every validation (options in data.induction /
    data.ngram / data.hop).
    Left out: ``gpt`` where data.paths names shards, else ``mock``."""
    paths: list[float | str] = field(default_factory=list)
    """Shard prefixes, optionally with weights: [0.7, a_text_document, 0.3, b_text_document].
    An entry may also be what the data tools take: a preprocess --output-prefix (``a``:
    its one ``a_text_document`` or all its ``a_NNNNN_text_document`` shards, sharing
    its weight by their tokens), a dataset's ``.idx`` or a glob of ``.idx`` files.
    Without weights, several datasets are one corpus (each weighted by its tokens)."""
    split: str | int | float = "969,30,1"
    """Train/valid/test split weights over documents; one number is the training part
    alone (``100``, as Megatron-LM's ``--split 100``), kept as the string ``'100'``.
    Not used with data.valid_paths (leave it out, or give the training part alone)."""
    valid_paths: list[float | str] = field(default_factory=list)
    """Shards of a held-out validation set, in the forms of data.paths, in place of
    data.split's validation part (Megatron-LM's --valid-data-path): the training draws
    from all of data.paths, and runs on other corpora or splits validate on the same
    sequences. No shard may be in both. Empty: data.split's validation part."""
    valid_sets: dict[str, list[float | str]] = field(default_factory=dict)
    """More validation sets, each scored at every evaluation beside the validation
    above and named by its key: ``{code: [code_text_document], web: [0.5, a, 0.5, b]}``
    (each in the forms of data.paths, sharing no shard with it). Each reads its first
    train.eval_iters global batches, the same sequences for every run; its records in
    metrics.jsonl carry ``set: NAME``, and wandb plots ``valid/NAME/val_loss``. A name
    is letters, digits, ``_``, ``-`` and ``.``. ``--set data.valid_sets.NAME=[...]`` adds one."""
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
    hop: HopDataConfig = field(default_factory=HopDataConfig)
    """Options of data.type hop (the k-hop induction heads task)."""
    eval_seed: Optional[int] = None
    """Seed of the fixed validation set of the toy tasks' data (null: data seed + 1000003)."""

    def __post_init__(self) -> None:
        # the default was mock: a config naming its shards without ``type: gpt``
        # trained on random tokens, silently
        if self.type is None:
            self.type = "gpt" if self.paths else "mock"
        # YAML reads `split: 100` as a number: it was refused as "expected str"
        if isinstance(self.split, (int, float)) and not isinstance(self.split, bool):
            self.split = str(self.split)


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
    """Write checkpoints in the background (it pays on GPUs; the CPU runs it too)."""
    save_on_exit: bool = True
    """Save when stopping on a signal, time limit, or the end of training."""
    load_optimizer: bool = True
    """Restore optimizer and scheduler state on resume (false: weights only, a fresh
    optimizer and, as Megatron-LM's --no-load-optim, an LR schedule from its step 0,
    warmup included, while the iteration count goes on: a decaying schedule ends with
    the run only if optimizer.lr_decay_steps is set to the steps left). Once: the run's
    own checkpoints written under false restore the fresh optimizer and its schedule
    (a restart after a crash goes on exactly); to start afresh again from one of them,
    name it in checkpoint.resume."""
    load_rng: bool = True
    """Restore every rank's RNG states on resume (skipped when the TP/PP/DP layout
    changed). False, like load_optimizer false, holds for the checkpoint it starts from,
    not for the run's own checkpoints written under it."""
    allow_config_changes: list[str] = field(default_factory=list)
    """Keys (or sections) that may differ from the checkpoint's saved config on resume,
    e.g. [train.seq_length] for a longer context. Resume compares the model section,
    train.seq_length and the data (type, paths, split, valid_paths, tokenizer, seed,
    toy tasks, eod_id, eod_mask_loss, reset_attention_mask);
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


@dataclass
class ProfileConfig:
    """Traces of a few training steps on chosen ranks (``kvtrain/train/profiling.py``):
    ``torch.profiler``'s trace and operator table, on a GPU also the caching allocator's
    history, written under the run folder. Off while ``start_step`` is null."""

    start_step: Optional[int] = None
    """First iteration traced (1-based, as the log counts them); null: no profiling. The
    step before it runs under the profiler untraced (its warm-up) where this start runs it."""
    num_steps: int = 2
    """Iterations traced, from start_step (a window past the run's last step ends there)."""
    ranks: list[int] = field(default_factory=lambda: [0])
    """Global ranks that trace; each writes its own files."""
    record_shapes: bool = False
    """Record each operator's input shapes (a larger trace)."""
    with_stack: bool = False
    """Record each operator's Python stack (a much larger trace; slower traced steps)."""
    memory_history: bool = False
    """Also record the CUDA caching allocator's history over the traced steps and write its
    snapshot (``rankNNNNN.memory.pickle``, for pytorch.org/memory_viz). GPU runs only."""
    dir: Optional[str] = None
    """Folder of the traces (default: <run_dir>/profile; relative: under the run folder);
    each window in ``iter_AAAAAAA-BBBBBBB/``."""


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
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Step traces (off by default)."""

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
            checks.check_context_parallel(self)
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
        if p.virtual_pipeline is not None and p.virtual_pipeline < 1:  # -1 passed, 0 too
            raise ConfigError(f"parallel.virtual_pipeline must be >= 1 (or null), got "
                              f"{p.virtual_pipeline}")
        if p.virtual_pipeline is not None and p.pipeline < 2:
            raise ConfigError("parallel.virtual_pipeline needs parallel.pipeline >= 2")
        if p.sequence_parallel and p.tensor < 2:
            raise ConfigError("parallel.sequence_parallel needs parallel.tensor >= 2")
        if p.overlap_param_gather and not p.distributed_optimizer:  # as Megatron-LM refuses it
            raise ConfigError("parallel.overlap_param_gather needs parallel.distributed_optimizer "
                              "(it overlaps that optimizer's parameter all-gather)")
        if p.overlap_param_gather and not p.overlap_grad_reduce:  # as Megatron-LM refuses it
            raise ConfigError("parallel.overlap_param_gather needs parallel.overlap_grad_reduce "
                              "(megatron overlaps the gather with the reduce's buckets)")
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
        for check in (checks.check_train, checks.check_optimizer, checks.check_data,
                      checks.check_checkpoint):
            check(self)
        checks.check_profile(self.profile, world_size)
