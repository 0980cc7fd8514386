"""KV shifting attention (Xu, Wang, Chen, ICML 2025) for megatron-core.

Everything about the variant lives here:

* :func:`shift_tokens` - the math, a pure function:
  ``x̂_t = c_0·x_t + c_1·x_{t-1} + ... + c_w·x_{t-w}`` per head, with the tokens
  before the start of a sequence (or of a document in a packed sequence) taken
  as zero;
* :class:`KVShiftSelfAttention` - megatron's ``SelfAttention`` with K and V
  (optionally Q) shifted right after the QKV projection, so that RoPE and the
  core attention see the shifted tensors (paper §2.2, Appendix M);
* :class:`KVShiftMLASelfAttention` - the same on multi-latent attention
  (Appendix J): each head's up-projected K (no-RoPE part) and V are shifted;
* :class:`KVShiftMixin` - what both share: coefficients (learned, or fixed for
  selected heads), documents, decoding state, TP-sharded checkpoints;
* :func:`kv_shift_layer_spec` - the layer spec with only the self-attention
  module swapped.

The coefficients are per KV head (per GQA group). Paper notation: α are the
coefficients of K, β those of V; index 0 is the current token, so with the
default window 1, ``α = (α1, α2)`` and ``K̂_t = α1·K_t + α2·K_{t-1}``.
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from kvtrain.config.layout import coefficients_per_tensor
from kvtrain.model.shift_kernels import fused_shift, fused_shift_qkv

from .context_parallel import cp_group
from .documents import DocumentParams, doc_ids_from_attention_mask, doc_ids_from_cu_seqlens
from .kv_shift_cp import shift_context_parallel
from .qkv_rope import qkv_rope
from .mla import MLAttention
from .rope_attention import FusedRoPESelfAttention, is_identity

# Names of the coefficient parameters, by shifted tensor.
PARAM_NAMES = {"q": "shift_q", "k": "shift_k", "v": "shift_v"}


@dataclass(frozen=True)
class KVShiftOptions:
    """What the KV-shift attention module needs to know (from ``model.kv_shift``)."""

    shift: tuple[str, ...] = ("k", "v")
    window: int = 1
    mode: str = "free"  # free | gate | clamp
    seed: int = 1234  # coefficient init; the same values for every TP/PP layout
    # (tensor, global heads): only these heads of that tensor are shifted (Appendix J);
    # a tensor of ``shift`` not named here shifts all its heads
    heads: tuple[tuple[str, tuple[int, ...]], ...] = ()
    fixed: bool = False  # shifted heads take the previous token only: (0, 1), not learned
    kernel: str = "auto"  # auto | native | torch | triton (kvtrain.model.shift_kernels)

    def num_params(self) -> int:
        """Learnable scalars per KV head (4 for the paper's default, 0 when fixed)."""
        return 0 if self.fixed else coefficients_per_tensor(self) * len(self.shift)

    def selected_heads(self, tensor: str) -> Optional[tuple[int, ...]]:
        """The global heads of ``tensor`` that are shifted (None: all)."""
        return dict(self.heads).get(tensor)


# ----------------------------------------------------------------------------- the math
def shift_tokens(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor] = None) -> Tensor:
    """Mixes each token with its ``w`` predecessors, per head.

    Args:
        x: ``[s, b, h, d]`` (sequence first, as in megatron).
        coef: ``[h, w+1]``; ``coef[:, i]`` weighs the token ``i`` steps back.
        doc_ids: optional ``[s, b]`` integer document index of every token; a
            predecessor from another document counts as zero (packed sequences).
            Without it, only the sequence start resets.

    Returns:
        ``[s, b, h, d]``: ``out_t = Σ_i coef[:, i] · x_{t-i}``, zero for ``t-i < 0``.
    """
    s = x.shape[0]
    window = coef.shape[1] - 1
    c = coef.to(x.dtype)
    out = x * c[:, 0, None]  # [s, b, h, d] * [h, 1]
    for i in range(1, window + 1):
        if i >= s:
            break
        prev = x[:-i]  # token t-i for t = i..s-1, [s-i, b, h, d]
        term = prev * c[:, i, None]
        if doc_ids is not None:
            same_doc = (doc_ids[i:] == doc_ids[:-i]).to(x.dtype)  # [s-i, b]
            term = term * same_doc[:, :, None, None]
        # Left-pad with zeros: positions t < i have no predecessor i steps back.
        out = out + torch.nn.functional.pad(term, (0, 0, 0, 0, 0, 0, i, 0))
    return out


def effective_coefficients(param: Tensor, mode: str) -> Tensor:
    """From the stored parameter to the mixing coefficients ``[h, w+1]``."""
    if mode == "free":
        return param
    if mode == "clamp":
        return param.clamp(0.0, 1.0)
    if mode == "gate":
        # softmax over (a_0..a_{w-1}, 0): for w = 1, (sigmoid(a), 1 - sigmoid(a)).
        logits = torch.cat([param, param.new_zeros(param.shape[0], 1)], dim=1)
        return torch.softmax(logits.float(), dim=1).to(param.dtype)
    raise ValueError(f"unknown KV-shift coefficient mode {mode!r}")


def initial_parameter(num_heads: int, opts: KVShiftOptions, layer_number: int,
                      tensor: str) -> Tensor:
    """The initial stored parameter of all ``num_heads`` (global) KV heads, ``[h, n]``.

    ``free``: footnote 10: the first w coefficients ``~ U(0, 1)``, the last 1 minus
    their sum (w = 1: ``α1 ~ U(0, 1), α2 = 1 - α1``). ``clamp``: the same at w = 1, a
    uniform point of the simplex at w = 2-3 (footnote 10's last one is negative in
    1/2 or 5/6 of the heads: clamped to 0, it would never get a gradient).
    ``gate``: a uniform point of the simplex (w = 1: ``α1 ~ U(0, 1)`` again), stored
    as logits relative to the last one. Drawn from a generator seeded by (seed,
    layer, tensor) alone: every TP/PP layout gets the same values, each rank its slice.
    """
    digest = hashlib.sha256(f"{opts.seed}/{layer_number}/{tensor}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    w = opts.window
    if opts.mode == "gate" or (opts.mode == "clamp" and w > 1):
        e = -torch.log(torch.rand(num_heads, w + 1, generator=gen, dtype=torch.float64, device="cpu"))
        p = e / e.sum(dim=1, keepdim=True)  # Dirichlet(1,...,1)
        if opts.mode == "clamp":
            return p.float()
        return (p[:, :w].log() - p[:, w:].log()).float()
    u = torch.rand(num_heads, w, generator=gen, dtype=torch.float64, device="cpu")
    return torch.cat([u, 1.0 - u.sum(dim=1, keepdim=True)], dim=1).float()


# ----------------------------------------------------------------------------- megatron modules
class _CallState:
    """What one forward call tells the shift's hooks (``get_query_key_value_tensors``),
    in a plain object: a module attribute set costs ``nn.Module.__setattr__``."""

    __slots__ = ("doc_ids", "inference")

    def __init__(self) -> None:
        self.doc_ids: Optional[tuple] = None  # (kind, value) of this forward's documents
        self.inference = None  # megatron's inference context while decoding


class KVShiftMixin:
    """The KV shift of an attention module: coefficients, documents, decoding, checkpoints.

    Mixed into ``KVShiftSelfAttention`` and ``KVShiftMLASelfAttention``, which call
    :meth:`_init_kv_shift` after their ``__init__`` and :meth:`_shift` on the tensors.

    Parameters ``shift_k``/``shift_v``/``shift_q`` are ``[heads_local, n]``
    (n = w+1, or w in gate mode), marked tensor-parallel on dim 0 so that the
    grad norm, the distributed optimizer and dist checkpoints treat each rank's
    slice as its own heads. With ``fixed`` there are none: the shifted heads use
    the constant (0, 1). Heads that ``heads`` does not select use (1, 0, ...).
    """

    def _init_kv_shift(self, config, layer_number: int, kv_shift: KVShiftOptions,
                       groups: int) -> None:
        """Creates the coefficients of ``groups`` (global) KV heads, this rank's slice."""
        self.kv_shift = kv_shift
        tp = self.pg_collection.tp
        tp_size = tp.size() if tp is not None else 1
        tp_rank = tp.rank() if tp is not None else 0
        if groups % tp_size:
            raise ValueError(
                f"KV shift needs the KV heads (num_query_groups={groups}) to divide by the "
                f"tensor-parallel size ({tp_size}): each rank must own whole KV heads"
            )
        local = groups // tp_size
        self._tp_slice = slice(tp_rank * local, (tp_rank + 1) * local)
        device = next(self.parameters()).device  # the projections exist already
        self._head_masks: dict[str, str] = {}  # tensor -> name of its head-selection buffer
        for tensor in kv_shift.shift:
            selected = kv_shift.selected_heads(tensor)
            if selected is not None:  # bool [local]: which of this rank's heads shift
                mask = torch.zeros(groups, dtype=torch.bool)
                mask[list(selected)] = True
                self._head_masks[tensor] = f"_heads_{tensor}"
                self.register_buffer(f"_heads_{tensor}", mask[self._tp_slice].to(device),
                                     persistent=False)
            if kv_shift.fixed:
                continue
            full = initial_parameter(groups, kv_shift, layer_number, tensor)
            data = full[self._tp_slice].to(device=device, dtype=config.params_dtype)
            param = torch.nn.Parameter(data)
            set_tensor_model_parallel_attributes(param, True, 0, 1)
            param.kv_shift = True  # lets the optimizer find them (weight decay switch)
            self.register_parameter(PARAM_NAMES[tensor], param)
        if kv_shift.fixed:  # [local, 2]: the previous token only
            fixed = torch.tensor([0.0, 1.0]).expand(local, 2)
            self.register_buffer("_fixed_coef", fixed.to(device, config.params_dtype),
                                 persistent=False)
        self._call = _CallState()

    # -- the shift ---------------------------------------------------------------
    def coefficients(self, tensor: str) -> Tensor:
        """Mixing coefficients ``[kv_heads_local, w+1]`` of ``tensor`` (q, k or v)."""
        if self.kv_shift.fixed:
            coef = self._fixed_coef
        else:
            coef = effective_coefficients(getattr(self, PARAM_NAMES[tensor]), self.kv_shift.mode)
        if tensor in self._head_masks:  # the heads not selected keep their own token
            mask = getattr(self, self._head_masks[tensor])
            identity = torch.zeros_like(coef)
            identity[:, 0] = 1.0
            coef = torch.where(mask[:, None], coef, identity)
        return coef

    def _shift(self, name: str, x: Tensor, doc_ids: Optional[Tensor]) -> Tensor:
        """``x`` ``[s, b, h, d]`` shifted with the coefficients of ``name`` (one per head of
        ``x``: a KV group's set is repeated for its query heads)."""
        coef = self.coefficients(name)
        if coef.shape[0] != x.shape[2]:
            coef = coef.repeat_interleave(x.shape[2] // coef.shape[0], 0)
        group = cp_group()
        if self._decoding():
            if group is not None:
                raise ValueError("KV-shift decoding with context parallelism is not supported")
            return self._shift_with_cache(name, x, coef)
        if group is not None:
            return shift_context_parallel(x, coef, group, self._global_doc_ids(),
                                          impl=self.kv_shift.kernel)
        return fused_shift(x, coef, doc_ids, impl=self.kv_shift.kernel)

    def _global_doc_ids(self) -> Optional[Tensor]:
        """Under context parallelism: ``[b, S]`` document ids of the whole sequence
        (the halo's documents), or None."""
        if self._call.doc_ids is None:
            return None
        kind, value = self._call.doc_ids
        if kind != "ids":
            raise ValueError("KV shift with context parallelism takes packed documents as "
                             "kvtrain's DocumentParams only (not THD or a mask)")
        return value.global_doc_ids

    def forward(self, hidden_states, attention_mask, *args, packed_seq_params=None, **kwargs):
        # get_query_key_value_tensors does not see the mask, packing or the
        # inference context: note them here for the shift.
        call = self._call
        call.inference = kwargs.get("inference_context") or kwargs.get("inference_params")
        if len(args) >= 2 and args[1] is not None:  # (key_value_states, inference_context, ...)
            call.inference = args[1]
        call.doc_ids = None
        if isinstance(packed_seq_params, DocumentParams):  # the trainer's packed documents
            call.doc_ids = ("ids", packed_seq_params)
        elif packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu = packed_seq_params.cu_seqlens_q_padded
            if cu is None:
                cu = packed_seq_params.cu_seqlens_q
            call.doc_ids = ("thd", cu)
        elif attention_mask is not None:  # a caller's own mask (megatron's inference wrappers)
            call.doc_ids = ("mask", attention_mask)
        try:
            return super().forward(hidden_states, attention_mask, *args,
                                   packed_seq_params=packed_seq_params, **kwargs)
        finally:
            call.doc_ids = call.inference = None

    def _resolve_doc_ids(self, s: int, b: int) -> Optional[Tensor]:
        """``[s, b]`` document ids of the tokens being shifted (None: one document)."""
        if self._call.doc_ids is None:
            return None
        kind, value = self._call.doc_ids
        if kind == "ids":
            return value.doc_ids.transpose(0, 1)  # [b, s] -> [s, b]
        if kind == "thd":
            return doc_ids_from_cu_seqlens(value, s).expand(s, b)
        return doc_ids_from_attention_mask(value, s, b)

    # -- incremental decoding ------------------------------------------------------
    def _decoding(self) -> bool:
        ctx = self._call.inference
        if ctx is None or self.training:
            return False
        if not ctx.is_static_batching():
            raise RuntimeError("KV shift supports megatron's static-batching inference; "
                               "dynamic batching needs per-request shift state")
        return True

    def _shift_with_cache(self, name: str, x: Tensor, coef: Tensor) -> Tensor:
        """Shift ``x`` [s, b, h, d] continuing from the cached raw tail of earlier steps.

        The KV cache holds shifted keys/values; the next step needs the previous
        tokens' *raw* projections, kept here as a ``[w, max_batch, h, d]`` tail.
        It is stored in ``key_value_memory_dict`` under a string key, as a pair
        indexed ``[:, batch]`` like megatron's own entries, so that
        ``swap_key_value_dict`` (beam search) reorders it with the KV cache.
        """
        ctx = self._call.inference
        w = self.kv_shift.window
        slot = f"kv_shift.{name}.{self.layer_number}"
        start = ctx.batch_size_offset
        end = start + x.shape[1]
        tail_all = ctx.key_value_memory_dict.get(slot, (None,))[0]
        shape = (w, ctx.max_batch_size, *x.shape[2:])
        if (tail_all is None or tail_all.shape != shape or tail_all.dtype != x.dtype
                or tail_all.device != x.device):  # once per context, like the KV cache:
            # megatron prefills a batch in micro batches, each at offset 0
            tail_all = x.new_zeros(shape)
            ctx.key_value_memory_dict[slot] = (tail_all, tail_all)
        if ctx.sequence_len_offset == 0:
            tail_all[:, start:end].zero_()  # a new sequence: nothing before it
        joined = torch.cat([tail_all[:, start:end], x], dim=0)  # [w + s, b, h, d]
        shifted = fused_shift(joined, coef, impl=self.kv_shift.kernel)[w:]  # the forward's bits
        tail_all[:, start:end] = joined[-w:].detach()
        return shifted

    # -- checkpoints ---------------------------------------------------------------
    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """Like the parent's, but the shift coefficients are TP-sharded on dim 0.

        The default treats a module's own parameters as replicated, which would
        save only TP rank 0's heads; sharding them lets a checkpoint saved at one
        TP size load at another.
        """
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        own = {name: getattr(self, name) for name in self._shift_param_names()}
        state.update(
            make_sharded_tensors_for_checkpoint(
                own, prefix, {name: 0 for name in own}, sharded_offsets,
                tp_group=self.pg_collection.tp,
                dp_cp_group=(metadata or {}).get("dp_cp_group"),
            )
        )
        return state

    def _shift_param_names(self) -> list[str]:
        return [] if self.kv_shift.fixed else [PARAM_NAMES[t] for t in self.kv_shift.shift]


class KVShiftSelfAttention(KVShiftMixin, FusedRoPESelfAttention):
    """``SelfAttention`` whose K and V (and optionally Q) are shifted before RoPE.

    Per KV head (GQA group) coefficients; requires ``num_query_groups % tp == 0``. Where
    RoPE fuses with the QKV split (``rope_attention``), the K+V shift joins that node."""

    def __init__(self, config, submodules, layer_number: int, *args,
                 kv_shift: KVShiftOptions = KVShiftOptions(), **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if getattr(config, "fused_single_qkv_rope", False):
            raise ValueError("KV shift needs split Q/K/V: set fused_single_qkv_rope=False")
        self._init_kv_shift(config, layer_number, kv_shift, config.num_query_groups)
        # K and V can be shifted in their place in the QKV output (fused_shift_qkv):
        # the paper's K+V shift with nothing (a K norm) between projection and shift
        self._kv_in_place = (sorted(kv_shift.shift) == ["k", "v"]
                             and is_identity(self.k_layernorm))

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True):
        if not split_qkv:
            raise ValueError("KV shift needs split Q/K/V tensors (fused QKV RoPE is not supported)")
        if self._rope_call.freqs is not None:  # shifted and rotated in one node
            return super().get_query_key_value_tensors(hidden_states)
        if self._shift_kv_in_qkv(key_value_states, output_gate):
            return self._query_shifted_key_value(hidden_states)
        out = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=True
        )
        tensors = dict(zip("qkv", out[:3]))  # q [s, b, np, d]; k, v [s, b, ng, d]
        s, b = tensors["k"].shape[0], tensors["k"].shape[1]
        doc_ids = self._resolve_doc_ids(s, b)
        for name in self.kv_shift.shift:
            # q: one coefficient set per KV group, shared by the group's query heads
            tensors[name] = self._shift(name, tensors[name], doc_ids)
        return (tensors["q"], tensors["k"], tensors["v"], *out[3:])

    def _fused_query_key_value(self, mixed: Tensor, freqs: Tensor, query_width: int):
        return qkv_rope(mixed, freqs, query_width, self.coefficients("k"), self.coefficients("v"),
                        self._resolve_doc_ids(*mixed.shape[:2]), self._rope_call.value_kept)

    def _fuses_here(self) -> bool:  # the paper's K+V shift, on the Triton kernels
        return self._kv_in_place and self.kv_shift.kernel in ("auto", "triton")

    def _shift_kv_in_qkv(self, key_value_states, output_gate) -> bool:
        """Whether K and V are shifted together, in their place in the QKV output:
        the paper's K+V shift (no K norm between the projection and the shift) in
        training or a full forward, without context parallelism (the halo path)."""
        if not self._kv_in_place or key_value_states is not None or output_gate:
            return False
        return cp_group() is None and not self._decoding()

    def _query_shifted_key_value(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Q, and K and V shifted, in one node (``fused_shift_qkv``) straight from
        megatron's QKV layout ``[s, b, ng, (np/ng) * hn | hn (k) | hn (v)]``."""
        mixed, split = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        s, b = mixed.shape[:2]
        query, key, value = fused_shift_qkv(mixed, self.coefficients("k"), self.coefficients("v"),
                                            self._resolve_doc_ids(s, b), query_width=split[0],
                                            impl=self.kv_shift.kernel)
        query = query.reshape(s, b, -1, split[1])  # [s, b, np, hn]
        if not is_identity(self.q_layernorm):
            query = self.q_layernorm(query)
        return query, key, value  # k, v: [s, b, ng, hn]


class KVShiftMLASelfAttention(KVShiftMixin, MLAttention):
    """Multi-latent attention whose per-head K (no-RoPE part) and V are shifted.

    The shift acts on what the latent's up-projection gives each head, before the
    shared RoPE key is attached: ``K̂_t = [α1·k_t + α2·k_{t-1} | rope(k_pe_t, t)]``,
    ``V̂_t = β1·v_t + β2·v_{t-1}``. As in the paper's MHA form (shift, then RoPE at
    the current position), the position part stays the current token's; the
    RoPE key is one vector for all heads, so a per-head shift of it would end
    MLA's sharing. Coefficients are per attention head (every MLA head has its
    own K and V); ``kv_shift.heads`` picks heads (Appendix J). See docs/mla.md.
    """

    def __init__(self, config, submodules, layer_number: int, *args,
                 kv_shift: KVShiftOptions = KVShiftOptions(), **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        if "q" in kv_shift.shift:
            raise ValueError("KV shift on MLA shifts k and/or v, not q")
        if config.apply_rope_fusion or config.cache_mla_latents:
            raise ValueError("KV shift on MLA needs unfused RoPE and full K/V "
                             "(apply_rope_fusion=False, cache_mla_latents=False)")
        self._init_kv_shift(config, layer_number, kv_shift, config.num_attention_heads)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        query, key, value, *rest = super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, packed_seq_params,
            inference_context=inference_context, inference_params=inference_params)
        # key [s, b, n, qk_head_dim + qk_pos_emb_head_dim], value [s, b, n, v_head_dim];
        # THD packing (TE) drops the batch dim: [t, n, d]
        thd = key.dim() == 3
        if thd:
            key, value = key[:, None], value[:, None]
        doc_ids = self._resolve_doc_ids(key.shape[0], key.shape[1])
        if "k" in self.kv_shift.shift:
            d = self.config.qk_head_dim  # the no-RoPE part, per head
            nope = key[..., :d]
            if not self.kv_shift.fixed:
                # the shift keeps its input for the coefficients' gradient: a copy of
                # this part, not a view that would hold the RoPE key's columns too
                nope = nope.contiguous()
            key = torch.cat([self._shift("k", nope, doc_ids), key[..., d:]], dim=-1)
        if "v" in self.kv_shift.shift:
            value = self._shift("v", value, doc_ids)
        if thd:
            key, value = key[:, 0], value[:, 0]
        return (query, key, value, *rest)


def is_kv_shift_param(param: Tensor) -> bool:
    """True for the shift coefficients (kept out of weight decay by default)."""
    return bool(getattr(param, "kv_shift", False))


# ----------------------------------------------------------------------------- the spec
def kv_shift_layer_spec(base: ModuleSpec, options: KVShiftOptions) -> ModuleSpec:
    """A copy of the GPT layer spec ``base`` with self-attention made KV-shifting.

    Only ``submodules.self_attention.module`` changes (plus its options); the
    projections, core attention and norms of ``base`` are kept, so the same
    builder serves every backend (te, torch, local)."""
    spec = copy.deepcopy(base)
    attn = spec.submodules.self_attention
    if issubclass(attn.module, MLAttention):
        attn.module = KVShiftMLASelfAttention
    elif issubclass(attn.module, SelfAttention):
        attn.module = KVShiftSelfAttention
    else:
        raise ValueError(f"expected a SelfAttention or MLAttention spec, got "
                         f"{attn.module.__name__}")
    attn.params = {**attn.params, "kv_shift": options}
    return spec


@dataclass
class ShiftStats:
    """Per-layer coefficient statistics (the paper's Appendix F / Table 5)."""

    layer: int
    coefficients: dict[str, Tensor] = field(default_factory=dict)  # tensor -> [kv_heads, w+1]


def collect_shift_coefficients(modules: Sequence[torch.nn.Module]) -> list[ShiftStats]:
    """Effective coefficients of every KV-shift layer in ``modules`` (this rank's
    heads; gather over TP for all heads), ordered by global layer number."""
    stats = []
    for root in modules:
        for m in root.modules():
            if isinstance(m, KVShiftMixin):
                coefs = {t: m.coefficients(t).detach().float().cpu() for t in m.kv_shift.shift}
                stats.append(ShiftStats(layer=m.layer_number, coefficients=coefs))
    return sorted(stats, key=lambda s: s.layer)
