"""The model section of a run config: a Llama-style decoder and its attention
variant (``model.attention``: vanilla | kv_shift). Part of ``schema.RunConfig``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from .layout import padded_vocab_size
from .loader import ConfigError


# ----------------------------------------------------------------------------- model
@dataclass
class KVShiftConfig:
    """Options of KV shifting attention (used when ``model.attention: kv_shift``)."""

    shift: list[Literal["q", "k", "v"]] = field(default_factory=lambda: ["k", "v"])
    """Which projections are shifted: [k, v] is the paper's KV shifting; [k], [v]
    and [q, k, v] are its K-only, V-only and QKV ablations (Appendix G/H)."""

    window: int = 1
    """Previous tokens mixed in: 1 is the paper's shift (K_t, K_{t-1}); 2 and 3 are
    the longer windows of Figure 7b (w+1 coefficients per tensor and KV head)."""

    mode: Literal["free", "gate", "clamp"] = "free"
    """Coefficient parametrisation: ``free`` scalars (paper default); ``gate``:
    alpha1 = sigmoid(a), alpha2 = 1 - alpha1 (softmax over w+1 for longer
    windows); ``clamp``: free scalars clamped to [0, 1] in the forward (App. F.1),
    started on the simplex at windows 2-3 (footnote 10's start would leave a
    negative, dead coefficient in most heads)."""

    weight_decay: bool = False
    """Apply weight decay to the shift coefficients (off by default)."""

    heads: Optional[ShiftHeadsConfig] = None
    """Which heads are shifted (null: every KV head of every shifted tensor). The
    paper's Appendix J shifts the key of one head and the value of another:
    ``heads: {k: [0], v: [1], fixed: true}``."""

    kernel: Literal["auto", "native", "torch", "triton"] = "auto"
    """What computes the shift (the same math; the run's backend line says which
    ran): ``native`` - C++ operators compiled on first use (CPU, fp32/fp64;
    ``kvtrain/model/csrc/kv_shift.cpp``); ``triton`` - Triton kernels (GPU);
    ``torch`` - torch ops, anywhere; ``auto`` - triton on a GPU where it
    imports, native on the CPU where it builds, else torch."""

    @property
    def fixed(self) -> bool:
        """The coefficients are fixed, not learned (``heads.fixed``)."""
        return self.heads is not None and self.heads.fixed


@dataclass
class ShiftHeadsConfig:
    """Per-head selection of the KV shift (``model.kv_shift.heads``, Appendix J).

    A head that is not selected keeps its own token (coefficients (1, 0, ...)).
    Head indices are global KV heads (0 .. num_query_groups-1; with ``model.mla``
    every attention head has its own K and V)."""

    q: Optional[list[int]] = None
    """Heads whose query is shifted (null: all heads, when q is in ``shift``)."""
    k: Optional[list[int]] = None
    """Heads whose key is shifted (null: all heads, when k is in ``shift``)."""
    v: Optional[list[int]] = None
    """Heads whose value is shifted (null: all heads, when v is in ``shift``)."""
    fixed: bool = False
    """true: a selected head takes the previous token only (coefficients (0, 1),
    not learned; needs window 1), as in Appendix J; false: its coefficients are
    learned like the paper's (``mode``, footnote-10 init)."""


@dataclass
class MLAConfig:
    """Multi-latent attention (DeepSeek-V2's MLA, megatron's ``MLASelfAttention``).

    Per head, the key is ``[k_nope (qk_head_dim) | k_rope (qk_pos_emb_head_dim)]``
    with ``k_nope`` and the value up-projected from a ``kv_lora_rank`` latent
    (RMS-normed) and ``k_rope`` one RoPE'd vector shared by all heads. The
    defaults are the paper's Appendix J setting (hidden 768, 12 heads)."""

    q_lora_rank: Optional[int] = None
    """Rank of the query's low-rank projection; null: a full-rank query projection
    (Appendix J: no low-rank query)."""
    kv_lora_rank: int = 256
    """Width of the K/V latent (Appendix J: 256)."""
    qk_head_dim: int = 32
    """Per-head query/key dims without RoPE (Appendix J: 32)."""
    qk_pos_emb_head_dim: int = 32
    """Per-head query/key dims with RoPE (Appendix J: 32; the key's part is shared by the heads)."""
    v_head_dim: int = 64
    """Per-head value dims (64 = hidden / heads in Appendix J)."""

    @property
    def q_head_dim(self) -> int:
        """Query and key head width: ``qk_head_dim + qk_pos_emb_head_dim``."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention, as the parameter and FLOP counts see it (unsharded).

    Standard attention: Q ``h·h``, K and V ``h·g·d`` each, output ``h·h``. MLA:
    the query projection(s), the K/V down projection ``h·(r_kv + d_pe)``, the
    up projection ``r_kv·n·(d_nope + d_v)``, output ``n·d_v·h``, and the latent
    RMSNorm weights (``r_kv``, plus ``r_q`` with a low-rank query).
    """

    projections: int
    """Weights of the Q/K/V projections."""
    output: int
    """Weights of the output projection."""
    latent_norms: int
    """Latent RMSNorm weights (MLA only)."""
    qk_width: int
    """Per token, all heads: the query (= key) width the scores contract over."""
    v_width: int
    """Per token, all heads: the value width the probabilities multiply."""
    shift_width: dict
    """Per token: elements of each shiftable tensor (q, k, v) the KV shift mixes."""


@dataclass
class ModelConfig:
    """A Llama-style decoder (RMSNorm, SwiGLU, RoPE, no biases)."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 128
    """Model width."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """KV heads (GQA groups); null means as many as query heads (MHA)."""
    ffn_hidden_size: Optional[int] = None
    """SwiGLU inner size; null means 8/3 * hidden rounded up to a multiple of 256."""
    vocab_size: int = 32000
    """Tokenizer vocabulary; the embedding is padded to ``make_vocab_size_divisible_by * TP``."""
    make_vocab_size_divisible_by: int = 128
    """Padding multiple for the embedding table (per TP rank)."""
    max_position_embeddings: int = 2048
    """Maximum sequence length (the paper's MAX LENGTH)."""
    position_embedding: Literal["rope", "none"] = "rope"
    """Positional encoding: RoPE, or none (used by analysis tests)."""
    rotary_base: int = 100000
    """RoPE base (the paper uses 100000)."""
    rope_kernel: Literal["auto", "triton", "torch"] = "auto"
    """What rotates queries and keys (resolved once per start, printed and recorded
    with the backend): ``triton`` - one pass over memory each way (GPU, not MLA;
    kvtrain.model.rope); ``torch`` - megatron's torch ops (~12 passes forward,
    ~10 backward per tensor); ``auto`` - ``triton`` for the ``torch`` backend on a
    GPU where Triton imports, Transformer Engine's fused RoPE for the ``te``
    backend where that TE has it, else ``torch``."""
    cross_entropy_kernel: Literal["auto", "triton", "torch"] = "auto"
    """What computes the loss over the vocab-parallel logits (resolved once per
    start, printed and recorded with the backend): ``triton`` - one pass over the
    logits each way, the logits kept in their dtype and overwritten by their
    gradient (GPU; kvtrain.model.cross_entropy); ``torch`` - megatron's (an fp32
    copy, ~10 passes, its fp32 softmax kept); ``auto`` - ``triton`` for the
    ``torch`` and ``te`` backends on a GPU where Triton imports, else ``torch``."""
    swiglu_kernel: Literal["auto", "triton", "torch"] = "auto"
    """What computes the MLP's activation ``silu(gate) · linear`` (resolved once per
    start, printed and recorded with the backend): ``triton`` - one pass over memory
    each way (GPU; kvtrain.model.swiglu); ``torch`` - torch's ops (5 passes of an
    f-wide tensor forward, 11 backward); ``auto`` - ``triton`` for the ``torch`` and
    ``te`` backends on a GPU where Triton imports (not fp64: the kernels compute in
    fp32, also where ``triton`` is asked for), else ``torch``."""
    norm_epsilon: float = 1e-5
    """RMSNorm epsilon."""
    init_method_std: float = 0.02
    """Std of the normal init of linear weights."""
    untie_embeddings: bool = True
    """Separate input embedding and output layer (Llama style)."""
    attention: Literal["vanilla", "kv_shift"] = "vanilla"
    """The attention variant: the one key that differs between a vanilla run and a KV-shift run."""
    kv_shift: KVShiftConfig = field(default_factory=KVShiftConfig)
    """KV shifting options (ignored by vanilla attention)."""
    backend: Literal["auto", "te", "torch", "local"] = "auto"
    """Layer implementation: ``te`` (Transformer Engine: fused attention, TE linears),
    ``torch`` (megatron's local linears and norms with PyTorch's fused attention: SDPA,
    FlexAttention for separated documents on a GPU), ``local`` (megatron's own modules,
    s x s scores: the reference), or ``auto``: ``te`` on a GPU where Transformer Engine
    imports, else ``torch`` (the CPU included). Resolved once at start, printed, and
    recorded (metrics.jsonl event, config.yaml comment, checkpoint, wandb config);
    ``te`` that cannot be used stops the run in one line, and an installed TE that
    fails to import is shown even under ``auto``. Checkpoints load across backends."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    mla: Optional[MLAConfig] = None
    """Multi-latent attention instead of (GQA) multi-head attention; null: off.
    Works with both ``attention`` variants (the KV shift acts on each head's
    up-projected K (no-RoPE part) and V, see docs/mla.md)."""
    hidden_dropout: float = 0.0
    """Dropout on residual branches."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        """Channels of the narrower of a query/key head and a value head (MLA's differ)."""
        shape = self.attention_shape()
        return min(shape.qk_width, shape.v_width) // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return ((8 * self.hidden_size // 3) + 255) // 256 * 256

    def attention_shape(self) -> AttentionShape:
        """Widths and weights of one layer's attention (standard or ``mla``)."""
        h, n = self.hidden_size, self.num_attention_heads
        if self.mla is None:
            gd = self.kv_heads * (h // n)
            return AttentionShape(projections=h * (h + 2 * gd), output=h * h, latent_norms=0,
                                  qk_width=h, v_width=h,
                                  shift_width={"q": h, "k": gd, "v": gd})
        m = self.mla
        q_width = n * m.q_head_dim
        if m.q_lora_rank is None:
            query = h * q_width
        else:
            query = h * m.q_lora_rank + m.q_lora_rank * q_width
        kv = h * (m.kv_lora_rank + m.qk_pos_emb_head_dim) \
            + m.kv_lora_rank * n * (m.qk_head_dim + m.v_head_dim)
        return AttentionShape(projections=query + kv, output=n * m.v_head_dim * h,
                              latent_norms=m.kv_lora_rank + (m.q_lora_rank or 0),
                              qk_width=q_width, v_width=n * m.v_head_dim,
                              shift_width={"q": q_width, "k": n * m.qk_head_dim,
                                           "v": n * m.v_head_dim})

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary padded for ``tensor_parallel`` ranks (``layout.padded_vocab_size``)."""
        return padded_vocab_size(self, tensor_parallel)

    def validate(self) -> None:
        """Checks of the model alone (parallel checks are in RunConfig.validate)."""
        self._validate_sizes()
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) must be divisible by "
                f"model.num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ConfigError(
                f"model.num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"model.num_query_groups ({self.kv_heads})"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_embedding == "rope" and self.mla is None and head_dim % 2:
            # every RoPE kernel, megatron's too, rotates pairs of a head's channels: an odd
            # head dim died at the first forward in a traceback (MLA: its own RoPE dims)
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) / model.num_attention_heads "
                f"({self.num_attention_heads}) = {head_dim} channels per head: RoPE rotates "
                "pairs of them and needs an even head dim (or model.position_embedding: none)")
        ks = self.kv_shift
        if not 1 <= ks.window <= 3:
            raise ConfigError(f"model.kv_shift.window must be 1, 2 or 3, got {ks.window}")
        if not ks.shift:
            raise ConfigError("model.kv_shift.shift must name at least one of q, k, v")
        if len(set(ks.shift)) != len(ks.shift):
            raise ConfigError(f"model.kv_shift.shift has duplicates: {ks.shift}")
        if ks.heads is not None:
            self._validate_shift_heads()
        if self.mla is not None:
            self._validate_mla()

    def _validate_sizes(self) -> None:
        """Sizes and scalars each on its own: 0 or negative ones pass the divisibility
        checks (num_query_groups 0 silently meant MHA) or fail later in a traceback."""
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                    "max_position_embeddings", "make_vocab_size_divisible_by", "rotary_base",
                    "norm_epsilon", "init_method_std"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key} must be positive, got {getattr(self, key)}")
        for key in ("num_query_groups", "ffn_hidden_size"):
            value = getattr(self, key)
            if value is not None and value <= 0:
                raise ConfigError(f"model.{key} must be positive (or null), got {value}")
        for key in ("attention_dropout", "hidden_dropout"):
            if not 0 <= getattr(self, key) < 1:
                raise ConfigError(f"model.{key} must be in [0, 1), got {getattr(self, key)}")

    def _validate_shift_heads(self) -> None:
        """``model.kv_shift.heads``: known heads of shifted tensors, window 1 when fixed."""
        ks = self.kv_shift
        for tensor in ("q", "k", "v"):
            heads = getattr(ks.heads, tensor)
            if heads is None:
                continue
            key = f"model.kv_shift.heads.{tensor}"
            if tensor not in ks.shift:
                raise ConfigError(f"{key} selects heads of {tensor}, which model.kv_shift.shift "
                                  f"({ks.shift}) does not shift")
            if not heads:
                raise ConfigError(f"{key} is empty: drop {tensor} from model.kv_shift.shift instead")
            if len(set(heads)) != len(heads):
                raise ConfigError(f"{key} has duplicates: {heads}")
            bad = [h for h in heads if not 0 <= h < self.kv_heads]
            if bad:
                raise ConfigError(f"{key}: head {bad[0]} does not exist (KV heads are "
                                  f"0..{self.kv_heads - 1})")
        if ks.heads.fixed and ks.window != 1:
            raise ConfigError(f"model.kv_shift.heads.fixed takes the previous token only and "
                              f"needs model.kv_shift.window 1, got {ks.window}")

    def _validate_mla(self) -> None:
        """``model.mla``: positive ranks and dims, MHA, RoPE, no query shift."""
        mla = self.mla
        for key in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
            if getattr(mla, key) <= 0:
                raise ConfigError(f"model.mla.{key} must be positive, got {getattr(mla, key)}")
        if mla.q_lora_rank is not None and mla.q_lora_rank <= 0:
            raise ConfigError(f"model.mla.q_lora_rank must be positive or null, got "
                              f"{mla.q_lora_rank}")
        if mla.qk_pos_emb_head_dim % 2:
            raise ConfigError(f"model.mla.qk_pos_emb_head_dim must be even (RoPE rotates "
                              f"pairs), got {mla.qk_pos_emb_head_dim}")
        if self.kv_heads != self.num_attention_heads:
            raise ConfigError(f"model.mla: every head has its own K and V; set "
                              f"model.num_query_groups to null or {self.num_attention_heads}, "
                              f"got {self.num_query_groups}")
        if self.position_embedding != "rope":
            raise ConfigError("model.mla needs model.position_embedding: rope (MLA's decoupled "
                              "RoPE key)")
        if self.attention == "kv_shift" and "q" in self.kv_shift.shift:
            raise ConfigError("model.kv_shift.shift: q is not supported with model.mla "
                              "(shift k and/or v)")
