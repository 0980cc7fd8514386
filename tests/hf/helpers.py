"""Shared pieces of the Hugging Face tests: tiny models of every variant, kvtrain
logits, HF loading."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kvtrain.config import ModelConfig, RunConfig

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

VOCAB = 100  # padded to 128 in kvtrain: the export must cut the padding


def model_config(**over) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                ffn_hidden_size=64, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                max_position_embeddings=64, rotary_base=1000, attention="kv_shift")
    base.update(over)
    return ModelConfig(**base)


def run_config(model: ModelConfig, seed: int = 7) -> RunConfig:
    cfg = RunConfig(model=model)
    cfg.train.seed = seed
    cfg.data.eod_id = VOCAB - 1
    return cfg


def build(cfg: RunConfig, backend: str = "local", scramble: bool = True):
    """A TP=1 kvtrain model of ``cfg`` (shift coefficients away from their init,
    outside [0, 1] on some heads so that clamp matters), in eval mode."""
    from kvtrain.model.builder import build_gpt, transformer_config

    model = build_gpt(cfg.model, transformer_config(cfg.model), seed=cfg.train.seed,
                      backend=backend)
    if scramble:
        gen = torch.Generator().manual_seed(cfg.train.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "shift" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.8 + 0.3)
    return model.eval()


def tokens(b: int = 2, s: int = 11, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def kvtrain_logits(model, tok: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]`` logits of a whole kvtrain model (padding cut)."""
    pos = torch.arange(tok.shape[1])[None].expand_as(tok)
    with torch.no_grad():
        out = model(tok, pos, None, runtime_gather_output=True)
    return out[..., :VOCAB].float()


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        str(folder), trust_remote_code=True, output_loading_info=True, dtype=torch.float32)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    return model.eval()


def hf_logits(model, tok: torch.Tensor, mask=None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=tok, attention_mask=mask, use_cache=False).logits.float()
