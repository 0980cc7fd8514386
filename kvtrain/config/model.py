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
    windows); ``clamp``: free scalars clamped to [0, 1] in the forward (App. F.1)."""

    weight_decay: bool = False
    """Apply weight decay to the shift coefficients (off by default)."""


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
    hidden_dropout: float = 0.0
    """Dropout on residual branches."""

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        return ((8 * self.hidden_size // 3) + 255) // 256 * 256

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        """Vocabulary padded for ``tensor_parallel`` ranks (``layout.padded_vocab_size``)."""
        return padded_vocab_size(self, tensor_parallel)

    def validate(self) -> None:
        """Checks of the model alone (parallel checks are in RunConfig.validate)."""
        for key in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size",
                    "max_position_embeddings"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model.{key} must be positive, got {getattr(self, key)}")
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
        ks = self.kv_shift
        if not 1 <= ks.window <= 3:
            raise ConfigError(f"model.kv_shift.window must be 1, 2 or 3, got {ks.window}")
        if not ks.shift:
            raise ConfigError("model.kv_shift.shift must name at least one of q, k, v")
        if len(set(ks.shift)) != len(ks.shift):
            raise ConfigError(f"model.kv_shift.shift has duplicates: {ks.shift}")
