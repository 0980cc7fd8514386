"""kvtrain (megatron) weight names and layouts <-> Hugging Face Llama names.

Both directions work on whole (TP=1, unsharded) tensors: the export loads the
checkpoint into one process first, the import saves from one process.

Layout facts (megatron-core 0.16.1, GPTModel with the local/torch specs):

* ``linear_qkv.weight`` ``[(nq + 2 ng) d, h]`` is grouped per KV head: for each
  group ``g`` the rows of its ``nq/ng`` query heads, then its key head, then its
  value head. HF's ``q_proj`` holds the query heads in order (the heads of group
  ``g`` are ``g*nq/ng ..``, what ``repeat_kv`` expects), ``k_proj``/``v_proj``
  the KV heads.
* ``linear_fc1.weight`` ``[2 f, h]`` is ``[gate; up]`` (megatron's GLU applies the
  activation to the first half), HF's ``gate_proj`` / ``up_proj``.
* The embedding and output layer are padded to
  ``make_vocab_size_divisible_by * TP`` rows; HF has ``vocab_size`` rows.
* The KV-shift coefficients ``shift_{q,k,v}`` ``[ng, n]`` keep their values; HF
  names them ``model.layers.i.self_attn.shift_{q,k,v}``.
"""

from __future__ import annotations

import re
from typing import Mapping, Optional

import torch
from torch import Tensor

from kvtrain.config import ConfigError
from kvtrain.config.model import ModelConfig

SHIFT = ("shift_q", "shift_k", "shift_v")
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# per-layer weights that only change their name: megatron suffix -> HF suffix
_PLAIN = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE fused norm
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",  # TE fused norm
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    **{f"self_attention.{s}": f"self_attn.{s}" for s in SHIFT},
}


def _shape(cfg: ModelConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim)."""
    return cfg.num_attention_heads, cfg.kv_heads, cfg.hidden_size // cfg.num_attention_heads


def split_qkv(weight: Tensor, cfg: ModelConfig) -> tuple[Tensor, Tensor, Tensor]:
    """megatron's grouped ``linear_qkv.weight`` -> HF (q_proj, k_proj, v_proj) weights."""
    nq, ng, d = _shape(cfg)
    per = nq // ng
    grouped = weight.reshape(ng, per + 2, d, weight.shape[-1])  # [ng, q heads + k + v, d, h]
    q = grouped[:, :per].reshape(nq * d, -1)
    k = grouped[:, per].reshape(ng * d, -1)
    v = grouped[:, per + 1].reshape(ng * d, -1)
    return q, k, v


def join_qkv(q: Tensor, k: Tensor, v: Tensor, cfg: ModelConfig) -> Tensor:
    """HF (q_proj, k_proj, v_proj) weights -> megatron's grouped ``linear_qkv.weight``."""
    nq, ng, d = _shape(cfg)
    h = q.shape[-1]
    grouped = torch.cat([q.reshape(ng, nq // ng, d, h), k.reshape(ng, 1, d, h),
                         v.reshape(ng, 1, d, h)], dim=1)  # [ng, q heads + k + v, d, h]
    return grouped.reshape(-1, h)


def to_hf(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """A whole megatron GPTModel state dict -> HF Llama names (vocab unpadded).

    Tied embeddings (``untie_embeddings: false``) give no ``lm_head.weight``."""
    out: dict[str, Tensor] = {}
    vocab = cfg.vocab_size
    for name, value in state.items():
        if name.endswith("_extra_state") or value is None:
            continue
        layer = _LAYER.match(name)
        if name == "embedding.word_embeddings.weight":
            out["model.embed_tokens.weight"] = value[:vocab]
        elif name == "output_layer.weight":
            if cfg.untie_embeddings:
                out["lm_head.weight"] = value[:vocab]
        elif name == "decoder.final_layernorm.weight":
            out["model.norm.weight"] = value
        elif layer and layer.group(2) == "self_attention.linear_qkv.weight":
            prefix = f"model.layers.{layer.group(1)}.self_attn."
            for part, tensor in zip("qkv", split_qkv(value, cfg)):
                out[f"{prefix}{part}_proj.weight"] = tensor
        elif layer and layer.group(2) == "mlp.linear_fc1.weight":
            gate, up = value.chunk(2, dim=0)
            out[f"model.layers.{layer.group(1)}.mlp.gate_proj.weight"] = gate
            out[f"model.layers.{layer.group(1)}.mlp.up_proj.weight"] = up
        elif layer and layer.group(2) in _PLAIN:
            out[f"model.layers.{layer.group(1)}.{_PLAIN[layer.group(2)]}"] = value
        else:
            raise ConfigError(f"no Hugging Face name for the kvtrain weight {name}")
    return {k: v.contiguous() for k, v in out.items()}


def _pad_vocab(weight: Tensor, rows: int, vocab: int, name: str) -> Tensor:
    """``weight`` [vocab, h] padded with zero rows to ``rows`` (megatron's padded table).
    Its rows must be the config's ``vocab``, as transformers' own loader asks: fewer
    were padded with zero rows the config calls tokens, silently."""
    if weight.shape[0] != vocab:
        raise ConfigError(f"the Hugging Face weight {name} has {weight.shape[0]} rows, but "
                          f"config.json's vocab_size is {vocab}")
    return torch.cat([weight, weight.new_zeros(rows - weight.shape[0], weight.shape[1])])


class _Weights(dict):
    """HF weights, taken one by one; a missing one is a one-line error."""

    def take(self, name: str, shape: Optional[tuple[int, ...]] = None) -> Tensor:
        """The weight ``name``; ``shape``: the one config.json makes it (a weight that
        is joined with others is checked before: torch's reshape or cat raised)."""
        if name not in self:
            raise ConfigError(f"the Hugging Face weights have no {name}")
        value = self.pop(name)
        if shape is not None and tuple(value.shape) != shape:
            raise ConfigError(f"the Hugging Face weight {name} has shape {tuple(value.shape)}, "
                              f"config.json makes it {shape}")
        return value


def from_hf(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """HF Llama weights -> the state dict of a TP=1 kvtrain GPTModel (vocab padded
    for one rank; padded rows zero). Missing or unknown names: ConfigError."""
    rows = cfg.padded_vocab_size(1)
    # rotary inverse frequencies of older exports are buffers, not weights
    state = _Weights((k, v) for k, v in state.items() if not k.endswith("rotary_emb.inv_freq"))
    out = {"embedding.word_embeddings.weight": _pad_vocab(state.take("model.embed_tokens.weight"),
                                                          rows, cfg.vocab_size,
                                                          "model.embed_tokens.weight"),
           "decoder.final_layernorm.weight": state.take("model.norm.weight")}
    lm_head = state.pop("lm_head.weight", None)
    if cfg.untie_embeddings:
        if lm_head is None:
            raise ConfigError("the Hugging Face weights have no lm_head.weight but the "
                              "model has untied embeddings (model.untie_embeddings: true)")
        out["output_layer.weight"] = _pad_vocab(lm_head, rows, cfg.vocab_size, "lm_head.weight")
    reverse = {hf: mg for mg, hf in _PLAIN.items() if "layer_norm_weight" not in mg}
    nq, ng, d = _shape(cfg)
    h, f = cfg.hidden_size, cfg.ffn_size
    for i in range(cfg.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q, k, v = (state.take(f"{hf}self_attn.{p}_proj.weight", (heads * d, h))
                   for p, heads in zip("qkv", (nq, ng, ng)))
        out[f"{mg}self_attention.linear_qkv.weight"] = join_qkv(q, k, v, cfg)
        out[f"{mg}mlp.linear_fc1.weight"] = torch.cat(
            [state.take(f"{hf}mlp.{p}_proj.weight", (f, h)) for p in ("gate", "up")])
        for hf_suffix, mg_suffix in reverse.items():
            if hf_suffix.startswith("self_attn.shift_") and f"{hf}{hf_suffix}" not in state:
                continue  # a vanilla model, or a stock Llama getting KV shift (initialised)
            out[f"{mg}{mg_suffix}"] = state.take(f"{hf}{hf_suffix}")
    if state:
        raise ConfigError(f"unknown Hugging Face weights: {', '.join(sorted(state)[:6])}")
    return out


__all__ = ["from_hf", "join_qkv", "split_qkv", "to_hf"]
