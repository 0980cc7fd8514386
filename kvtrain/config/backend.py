"""Which attention backend a run uses, and what that backend cannot do.

``model.backend`` asks for ``auto``, ``te`` (Transformer Engine), ``torch``
(megatron's local linears and norms with PyTorch's fused attention: SDPA, and
FlexAttention for separated documents on a GPU; what ``auto`` gives on the CPU
and on GPUs without TE) or ``local`` (megatron's own modules with the s x s
score matrix: the reference). The answer is decided once per run from what the
machine offers - a GPU, an importable Transformer Engine, apex's fused softmax
kernels - by :func:`decide_backend`, a pure function: the trainer probes the
machine (``kvtrain.model.specs.backend_choice``) and the planner, which has no
GPU, assumes the cluster's answer. Both then apply the same refusals
(:func:`check_document_masks`, :func:`check_te_precision`); :func:`document_attention` names the kernel that
separates documents on each backend.

This module imports neither torch nor megatron, so ``kvtrain plan`` and config
validation stay light.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from .loader import ConfigError

TE_NOT_INSTALLED = "not installed"
"""``te_error`` when Transformer Engine is simply absent (not an error worth showing)."""

# megatron's FusedScaleMaskSoftmax takes apex's upper-triangular (causal) kernel,
# which ignores the attention mask, for 16-bit scores with 16 < s <= 4096.
FUSED_SOFTMAX_MAX_SEQ = 4096
FUSED_SOFTMAX_MIN_SEQ = 16


@dataclass(frozen=True)
class BackendChoice:
    """The resolved backend of a run: what it is, why, and which kernels it has."""

    name: str
    """``te``, ``torch`` or ``local``."""
    requested: str
    """The ``model.backend`` value it was resolved from."""
    reason: str
    """Why: ``auto: no GPU``, ``auto: Transformer Engine not installed``, ..."""
    fused_softmax: bool
    """apex's fused masked-softmax kernels are importable (used by the local spec)."""
    te_error: Optional[str] = None
    """First line of Transformer Engine's import error when it is installed but broken."""
    documents: Optional[str] = None
    """How documents are kept apart when ``data.reset_attention_mask`` is on (else None):
    see :func:`document_attention`."""
    shift_kernel: Optional[str] = None
    """What computes the KV shift (``model.kv_shift.kernel`` resolved: ``native``,
    ``triton`` or ``torch``, and why); None for vanilla attention."""
    multi_tensor: Optional[str] = None
    """What computes the optimizer's multi-tensor ops (gradient norm, clipping):
    ``transformer_engine``, ``apex`` or ``torch foreach (kvtrain)``
    (``kvtrain.train.multi_tensor``); None before the optimizer is built."""
    optimizer: Optional[str] = None
    """What computes the optimizer's update: ``torch fused AdamW (kvtrain)``,
    ``transformer_engine FusedAdam``, ``apex FusedAdam``, or ``torch foreach AdamW
    (kvtrain): <why not fused>`` (``kvtrain.train.optimizer.use_fused_adamw``); None
    before the optimizer is built."""
    rope: Optional[str] = None
    """What rotates queries and keys (``model.rope_kernel`` resolved: ``triton`` or
    ``torch``, and why; ``kvtrain.model.rope``); None where not resolved (tools
    that only read a config)."""
    cross_entropy: Optional[str] = None
    """What computes the loss (``model.cross_entropy_kernel`` resolved: ``triton`` or
    ``torch``, and why; ``kvtrain.model.cross_entropy``); None where not resolved."""
    context_parallel: Optional[str] = None
    """How the attention exchanges keys and values over the CP group when
    ``parallel.context`` > 1 (:func:`context_attention`); None without CP."""
    swiglu: Optional[str] = None
    """What computes the MLP's activation (``model.swiglu_kernel`` resolved: ``triton``
    or ``torch``, and why; ``kvtrain.model.swiglu``); None where not resolved."""

    def describe(self) -> str:
        """One line for stdout: ``backend torch (auto: no GPU; fused softmax: no)``,
        with :meth:`details` in the parentheses."""
        return f"backend {self.name} ({self.details()})"

    def details(self) -> str:
        """Why this backend and its kernels: ``auto: no GPU; fused softmax: no``, plus
        ``; documents: <kernel>`` when documents are separated and ``; KV shift:
        <kernel>`` for KV-shift attention, ``; context parallel: <exchange>`` under CP, ``; RoPE: <kernel>``, ``; cross-entropy:
        <kernel>``, ``; SwiGLU: <kernel>``, and ``; multi-tensor ops: <kernels>; optimizer: <update>`` once
        the optimizer is built."""
        fused = "yes" if self.fused_softmax else "no"
        docs = f"; documents: {self.documents}" if self.documents else ""
        docs += f"; context parallel: {self.context_parallel}" if self.context_parallel else ""
        shift = f"; KV shift: {self.shift_kernel}" if self.shift_kernel else ""
        rope = f"; RoPE: {self.rope}" if self.rope else ""
        loss = f"; cross-entropy: {self.cross_entropy}" if self.cross_entropy else ""
        loss += f"; SwiGLU: {self.swiglu}" if self.swiglu else ""
        multi = f"; multi-tensor ops: {self.multi_tensor}" if self.multi_tensor else ""
        update = f"; optimizer: {self.optimizer}" if self.optimizer else ""
        return (f"{self.reason}; fused softmax: {fused}{docs}{shift}{rope}{loss}{multi}"
                f"{update}")

    @property
    def warning(self) -> Optional[str]:
        """A broken Transformer Engine install, shown even when ``auto`` falls back."""
        if self.te_error in (None, TE_NOT_INSTALLED) or self.name == "te":
            return None
        return (f"Transformer Engine is installed but does not import ({self.te_error}); "
                f"using the {self.name} backend (model.backend: te would stop here)")

    def as_dict(self) -> dict:
        return asdict(self)


def decide_backend(requested: str, cuda: bool, te_error: Optional[str],
                   fused_softmax: bool) -> BackendChoice:
    """The backend for ``model.backend: requested`` on a machine where torch does
    (``cuda``) or does not see a GPU, Transformer Engine imports (``te_error`` None)
    or fails (``TE_NOT_INSTALLED`` or the error's first line), and apex's fused
    softmax is (``fused_softmax``) or is not available."""
    fused = fused_softmax and cuda
    if requested in ("local", "torch"):
        return BackendChoice(requested, requested, f"model.backend: {requested}", fused, te_error)
    if requested == "te":
        if not cuda:
            raise ConfigError("model.backend: te needs a GPU, but torch sees no GPU "
                              "(use model.backend: auto, torch or local on the CPU)")
        if te_error == TE_NOT_INSTALLED:
            raise ConfigError("model.backend: te, but Transformer Engine is not installed "
                              "(pip install transformer_engine[pytorch], or model.backend: torch)")
        if te_error is not None:
            raise ConfigError(f"model.backend: te, but Transformer Engine does not import: "
                              f"{te_error}")
        return BackendChoice("te", requested, "model.backend: te", fused)
    if requested != "auto":
        raise ConfigError(f"model.backend must be auto, te, torch or local, got {requested!r}")
    if not cuda:
        return BackendChoice("torch", requested, "auto: no GPU", fused, te_error)
    if te_error == TE_NOT_INSTALLED:
        return BackendChoice("torch", requested, "auto: Transformer Engine not installed",
                             fused, te_error)
    if te_error is not None:
        return BackendChoice("torch", requested,
                             f"auto: transformer_engine import failed: {te_error}", fused,
                             te_error)
    return BackendChoice("te", requested, "auto: Transformer Engine on a GPU", fused)


# FlexAttention's GPU kernels multiply with Triton's tl.dot, which needs 16 channels
# (inductor raises NotImplementedError for narrower heads)
FLEX_MIN_HEAD_DIM = 16


def document_attention(backend: str, cuda: bool, attention_dropout: float, context: int,
                       head_dim: int) -> str:
    """The kernel that keeps packed documents apart on ``backend``.

    ``te``: THD packing (``PackedSeqParams`` with ``cu_seqlens`` from the EOD
    positions); ``local``: megatron's softmax with an explicit ``[b, 1, s, s]``
    mask; ``torch``: FlexAttention with a document-causal block mask on a GPU
    (compiled; it has no dropout, so ``attention_dropout > 0`` falls back), else
    SDPA with an explicit boolean mask: on the CPU (compiling is too slow for
    tests), under context parallelism (``context`` > 1: the attention over the
    gathered keys masks each chunk itself) and for heads narrower than
    ``FLEX_MIN_HEAD_DIM`` (``head_dim``: the narrower of the Q/K and V heads).
    """
    if backend == "te":
        return "thd"
    if backend == "local":
        return "mask"
    flex = cuda and attention_dropout == 0 and context == 1 and head_dim >= FLEX_MIN_HEAD_DIM
    return "flex" if flex else "sdpa+mask"


def context_attention(backend: str, cp_comm_type: str) -> str:
    """How the attention exchanges K/V over the context-parallel group: Transformer
    Engine's ``parallel.cp_comm_type``; on ``torch`` kvtrain's attention, which
    all-gathers K and V (``kvtrain.model.context_parallel``) whatever that key says
    (a config written for a te cluster still smoke-tests on the CPU, and says so)."""
    if backend == "te":
        return f"{cp_comm_type} (Transformer Engine)"
    note = "" if cp_comm_type == "all_gather" else \
        f"; parallel.cp_comm_type {cp_comm_type} applies to model.backend te"
    return f"all_gather of K/V (kvtrain{note})"


def document_mask_problem(backend: str, fused_softmax: bool, half: bool,
                          seq_length: int) -> Optional[str]:
    """Why ``backend`` would ignore a document mask at ``seq_length`` (None: it applies it).

    ``te`` separates documents by THD packing and ``torch`` by its own masks; the
    local spec's ``FusedScaleMaskSoftmax`` drops the mask when it takes apex's
    causal kernel (16-bit scores, 16 < s <= 4096). The torch softmax path applies it.
    """
    if backend != "local":
        return None
    if fused_softmax and half and FUSED_SOFTMAX_MIN_SEQ < seq_length <= FUSED_SOFTMAX_MAX_SEQ:
        return (f"apex's fused softmax kernel ignores the mask for 16-bit sequences of "
                f"{FUSED_SOFTMAX_MIN_SEQ + 1}..{FUSED_SOFTMAX_MAX_SEQ} tokens (backend local, "
                f"train.seq_length {seq_length})")
    return None


def check_document_masks(cfg, choice: BackendChoice, half: bool) -> None:
    """Refuses ``data.reset_attention_mask`` where ``choice`` would silently ignore
    the mask (attention would cross documents while the KV shift resets at them),
    and with context parallelism on ``te``, whose THD-packed documents the
    trainer does not split per CP rank."""
    if not cfg.data.reset_attention_mask:
        return
    if cfg.parallel.context > 1 and choice.name == "te":
        raise ConfigError(
            f"parallel.context ({cfg.parallel.context}) with data.reset_attention_mask needs "
            f"model.backend torch (the backend is te: {choice.reason}): THD-packed documents are not split per "
            "CP rank on te")
    problem = document_mask_problem(choice.name, choice.fused_softmax, half,
                                    cfg.train.seq_length)
    if problem:
        raise ConfigError(
            f"data.reset_attention_mask: true is refused: {problem}, so attention would cross "
            f"documents; use model.backend: torch or te (or local without apex's fused "
            f"softmax, or train.precision fp32)"
        )


def check_te_precision(cfg, choice: BackendChoice, half: bool,
                       capability: Optional[tuple[int, int]] = None) -> None:
    """Refuses ``te`` in fp32 (``half`` False), or on a GPU before compute capability
    8.0 (``capability``, the trainer's GPU; None: not known, as in the planner), with
    THD-packed documents or context parallelism: Transformer Engine's only attention
    there is its unfused one, which takes neither (its flash and cuDNN kernels are
    16-bit and sm80+ only), so TE would stop at the first forward with "No dot
    product attention backend is available"."""
    if choice.name != "te":
        return
    needs = [key for key, on in (("data.reset_attention_mask", cfg.data.reset_attention_mask),
                                 (f"parallel.context {cfg.parallel.context}",
                                  cfg.parallel.context > 1)) if on]
    if needs and capability is not None and tuple(capability) < (8, 0):
        raise ConfigError(
            f"{' and '.join(needs)} on model.backend te needs a GPU of compute capability "
            f"8.0 or newer (this one: {capability[0]}.{capability[1]}): Transformer Engine's "
            f"only attention before it (unfused) takes neither THD-packed documents nor "
            f"context parallelism; use model.backend torch")
    if needs and not half:
        raise ConfigError(
            f"{' and '.join(needs)} on model.backend te (the backend is te: {choice.reason}) "
            f"needs train.precision bf16 or fp16: Transformer Engine's only fp32 attention "
            f"(unfused) takes neither THD-packed documents nor context parallelism; use "
            f"train.precision bf16, or model.backend torch for fp32")


def check_te_mla(cfg, choice: BackendChoice) -> None:
    """Refuses ``model.mla`` over TP without SP on ``te``: megatron's TE MLA spec
    makes the K/V down projection a duplicated ``TELinear``, whose weight's gradient
    megatron sums over TP only under SP, and whose RoPE key, shared by all heads, takes
    only this rank's heads' gradient (the ``torch``/``local`` twin of that, mended in
    ``kvtrain/model/mla.py``, was 1e-3 to 1e-2 off in every weight before the layer).
    With SP megatron gathers the RoPE key over the sequence and sums both."""
    p = cfg.parallel
    if choice.name != "te" or cfg.model.mla is None or p.tensor == 1 or p.sequence_parallel:
        return
    raise ConfigError(
        f"model.mla with parallel.tensor {p.tensor} on model.backend te (the backend is te: "
        f"{choice.reason}) needs parallel.sequence_parallel: true: without it megatron's "
        "duplicated K/V down projection leaves its weight's and the shared RoPE key's "
        "gradients unsummed over TP; or use model.backend torch")


__all__ = ["BackendChoice", "TE_NOT_INSTALLED", "check_document_masks", "check_te_mla",
           "check_te_precision", "context_attention", "decide_backend", "document_attention",
           "document_mask_problem"]
