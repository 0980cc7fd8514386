"""A Llama with KV shifting attention (Xu, Wang, Chen, ICML 2025), exported by kvtrain.

Self-contained: imports torch and public transformers APIs only (``PreTrainedModel``,
``GenerationMixin``, ``DynamicCache``, ``CausalLMOutputWithPast``), so it runs
wherever the export is loaded with ``trust_remote_code=True``.

The model is Llama (RMSNorm, SwiGLU, RoPE, GQA) except in attention: right
after the projections, and before RoPE, each shifted tensor (K and V, or the
config's choice of Q/K/V) of token t is mixed with its ``w`` predecessors per
KV head: ``x̂_t = c_0·x_t + c_1·x_{t-1} + ... + c_w·x_{t-w}``; a predecessor
before the start of the sequence (or a left-padding token) counts as zero.

Decoding: the KV cache holds the shifted, rotated keys and values; the next
token's shift needs the *raw* projections of the last ``w`` tokens, which live
in the cache too (``KVShiftCache``: per layer and shifted tensor, ``[b, h, w, d]``),
so that beam search reorders them with the keys and values. Pad tokens of a
left-padded batch are zeroed before the shift and masked in attention, and
positions count from each sequence's first real token: every row of a batch
decodes as it would alone.

``config.reset_attention_mask`` (true: training kept packed documents apart, each
attending to and shifting with nothing before it) is not acted on inside a row,
as the stock Llama of a vanilla export cannot either: give such a model one
document per row, without an EOS before it; a row of documents joined by EOS
attends across them, which it never did in training.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_kvshift_llama import KVShiftLlamaConfig

DEFAULT_KV_SHIFT = {"shift": ["k", "v"], "window": 1, "mode": "free"}
# the output field of the cache: "cache" in recent transformers 5, "past_key_values" before
_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


class KVShiftCache(DynamicCache):
    """``DynamicCache`` plus the raw (unshifted) projections of the last ``w`` tokens
    of every sequence, per layer and shifted tensor (``[b, h, w, d]``). Reordered,
    repeated and selected along the batch with the keys and values."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.shift_tails: dict[tuple[int, str], Tensor] = {}

    def shift_tail(self, layer_idx: int, name: str) -> Optional[Tensor]:
        return self.shift_tails.get((layer_idx, name))

    def set_shift_tail(self, layer_idx: int, name: str, tail: Tensor) -> None:
        self.shift_tails[(layer_idx, name)] = tail

    def reorder_cache(self, beam_idx: torch.LongTensor):
        super().reorder_cache(beam_idx)
        for key, tail in self.shift_tails.items():
            self.shift_tails[key] = tail.index_select(0, beam_idx.to(tail.device))

    def batch_repeat_interleave(self, repeats: int):
        super().batch_repeat_interleave(repeats)
        for key, tail in self.shift_tails.items():
            self.shift_tails[key] = tail.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor):
        super().batch_select_indices(indices)
        for key, tail in self.shift_tails.items():
            self.shift_tails[key] = tail[indices]

    def reset(self):
        super().reset()
        self.shift_tails.clear()

    def crop(self, *args, **kwargs):
        # the raw projections of dropped tokens' predecessors are not kept
        raise ValueError("a KV-shift cache cannot be cropped (assisted or speculative "
                         "decoding is not supported)")


class KVShiftLlamaRMSNorm(nn.Module):
    """RMSNorm computed in fp32, as Llama's."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


def rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def rotary(position_ids: Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin ``[b, s, dim]`` of the rotate-half RoPE at ``position_ids`` ``[b, s]``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                             device=position_ids.device) / dim))
    freqs = position_ids[..., None].float() * inv_freq  # [b, s, dim/2]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x`` [b, h, s, d] rotated (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class KVShiftLlamaAttention(nn.Module):
    """Llama attention with Q/K/V shifting before RoPE."""

    def __init__(self, config: KVShiftLlamaConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        h, d = config.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        options = {**DEFAULT_KV_SHIFT, **(getattr(config, "kv_shift", None) or {})}
        self.shift = tuple(options["shift"])
        self.window = int(options["window"])
        self.mode = str(options["mode"])
        n = self.window if self.mode == "gate" else self.window + 1
        for name in self.shift:
            # a fresh model starts as plain attention: all weight on the current token
            init = torch.zeros(self.num_kv_heads, n)
            if self.mode != "gate":
                init[:, 0] = 1.0
            self.register_parameter(f"shift_{name}", nn.Parameter(init))

    def coefficients(self, name: str) -> Tensor:
        """Mixing coefficients ``[kv_heads, w+1]`` of ``name`` (q, k or v)."""
        param = getattr(self, f"shift_{name}")
        if self.mode == "clamp":
            return param.clamp(0.0, 1.0)
        if self.mode == "gate":
            logits = torch.cat([param, param.new_zeros(param.shape[0], 1)], dim=1)
            return torch.softmax(logits.float(), dim=1).to(param.dtype)
        return param

    def shifted(self, name: str, x: Tensor, real: Tensor, cache: Optional[KVShiftCache]) -> Tensor:
        """``x`` [b, h, s, d] mixed with its predecessors; ``real`` [b, s] marks the
        non-pad tokens (pads count as zero)."""
        coef = self.coefficients(name).to(x.dtype)  # [kv_heads, w+1]
        if name == "q":  # one coefficient set per KV group, shared by its query heads
            coef = coef.repeat_interleave(self.num_heads // self.num_kv_heads, dim=0)
        x = torch.where(real[:, None, :, None], x, torch.zeros((), dtype=x.dtype, device=x.device))
        w, s = self.window, x.shape[2]
        tail = cache.shift_tail(self.layer_idx, name) if cache is not None else None
        if tail is None:  # nothing before the sequence start
            tail = x.new_zeros(x.shape[0], x.shape[1], w, x.shape[3])
        joined = torch.cat([tail, x], dim=2)  # [b, h, w + s, d]
        out = joined[:, :, w:] * coef[:, 0, None, None]
        for i in range(1, w + 1):
            out = out + joined[:, :, w - i:w - i + s] * coef[:, i, None, None]
        if cache is not None:
            cache.set_shift_tail(self.layer_idx, name, joined[:, :, -w:])
        return out

    def forward(self, x: Tensor, rope: tuple[Tensor, Tensor], mask: Tensor, real: Tensor,
                cache: Optional[KVShiftCache]) -> Tensor:
        b, s, _ = x.shape
        d = self.head_dim
        tensors = {
            "q": self.q_proj(x).view(b, s, self.num_heads, d).transpose(1, 2),  # [b, h, s, d]
            "k": self.k_proj(x).view(b, s, self.num_kv_heads, d).transpose(1, 2),
            "v": self.v_proj(x).view(b, s, self.num_kv_heads, d).transpose(1, 2),
        }
        for name in self.shift:
            tensors[name] = self.shifted(name, tensors[name], real, cache)
        q = apply_rotary(tensors["q"], *rope)
        k = apply_rotary(tensors["k"], *rope)
        v = tensors["v"]
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=1)  # [b, h, t, d]
        v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * d))


class KVShiftLlamaMLP(nn.Module):
    def __init__(self, config: KVShiftLlamaConfig):
        super().__init__()
        h, f = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class KVShiftLlamaDecoderLayer(nn.Module):
    def __init__(self, config: KVShiftLlamaConfig, layer_idx: int):
        super().__init__()
        self.self_attn = KVShiftLlamaAttention(config, layer_idx)
        self.mlp = KVShiftLlamaMLP(config)
        self.input_layernorm = KVShiftLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = KVShiftLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: Tensor, rope, mask: Tensor, real: Tensor, cache) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask, real, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class KVShiftLlamaPreTrainedModel(PreTrainedModel):
    config_class = KVShiftLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["KVShiftLlamaDecoderLayer"]


def attention_masks(attention_mask: Optional[Tensor], b: int, s: int, past: int,
                    device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(4-D boolean attention mask ``[b, 1, s, past+s]``, real tokens ``[b, s]``,
    positions ``[b, s]``) from the 2-D padding mask of the whole sequence."""
    total = past + s
    if attention_mask is None:
        attention_mask = torch.ones(b, total, dtype=torch.long, device=device)
    if attention_mask.dim() != 2 or attention_mask.shape[1] < total:
        raise ValueError("KVShiftLlama expects a 2-D attention mask covering the cached and "
                         f"new tokens ({total}), got shape {tuple(attention_mask.shape)}")
    keep = attention_mask[:, -total:].bool()  # [b, past + s]
    q_pos = torch.arange(past, total, device=device)[:, None]
    k_pos = torch.arange(total, device=device)[None, :]
    # a pad query sees itself only: finite garbage, never read by real tokens
    mask = ((k_pos <= q_pos)[None] & keep[:, None, :]) | (k_pos == q_pos)[None]
    positions = (keep.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
    return mask[:, None], keep[:, past:], positions


class KVShiftLlamaModel(KVShiftLlamaPreTrainedModel):
    def __init__(self, config: KVShiftLlamaConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KVShiftLlamaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = KVShiftLlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, **kwargs) -> tuple[Tensor, Optional[KVShiftCache]]:
        """(final hidden states ``[b, s, hidden]``, the cache)."""
        cache = cache if cache is not None else kwargs.get("past_key_values")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        x = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        b, s = x.shape[:2]
        if cache is not None and not isinstance(cache, KVShiftCache):
            if cache.get_seq_length() > 0:
                raise ValueError("KVShiftLlama needs its KVShiftCache (it keeps the shift state)")
            cache = None  # generate's empty default cache: replaced by ours below
        if cache is None and use_cache:
            cache = KVShiftCache()
        past = cache.get_seq_length() if cache is not None else 0
        mask, real, positions = attention_masks(attention_mask, b, s, past, x.device)
        if position_ids is not None:
            positions = position_ids
        head_dim = self.layers[0].self_attn.head_dim
        rope = rotary(positions, head_dim, rope_theta(self.config), x.dtype)
        for layer in self.layers:
            x = layer(x, rope, mask, real, cache)
        return self.norm(x), cache


class KVShiftLlamaForCausalLM(KVShiftLlamaPreTrainedModel, GenerationMixin):
    def __init__(self, config: KVShiftLlamaConfig):
        super().__init__(config)
        self.model = KVShiftLlamaModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return getattr(self, "lm_head", None)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, logits_to_keep=0,
                **kwargs) -> CausalLMOutputWithPast:
        hidden, cache = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=position_ids, cache=cache,
                                   inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            hidden = hidden[:, -logits_to_keep:]
        weight = (self.model.embed_tokens.weight if self.config.tie_word_embeddings
                  else self.lm_head.weight)
        logits = F.linear(hidden, weight)  # [b, s, vocab]
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, **{_CACHE_FIELD: cache})


__all__ = ["KVShiftCache", "KVShiftLlamaForCausalLM", "KVShiftLlamaModel",
           "KVShiftLlamaPreTrainedModel"]
