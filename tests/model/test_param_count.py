"""Parameter counts of the paper's Table 16 shapes, built on the meta device.

KV shift adds (coefficients per KV head) × KV heads × layers parameters:
4 per KV head for the paper's default (α1, α2, β1, β2).
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, count_parameters, transformer_config
from kvtrain.model.kv_shift import KVShiftOptions

TABLE16 = {
    # name: hidden, layers, heads, kv heads, ffn, max length, vocab
    "2.9B": (2560, 32, 20, 4, 8704, 4096, 48000),
    "19B": (6144, 48, 48, 4, 16384, 12288, 48000),
}


def meta_model(shape, attention, kv_shift=None):
    hidden, layers, heads, kv, ffn, max_len, vocab = shape
    cfg = ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=kv,
        ffn_hidden_size=ffn, vocab_size=vocab, max_position_embeddings=max_len,
        attention=attention, kv_shift=kv_shift or KVShiftConfig(),
    )
    tc = transformer_config(cfg, use_cpu_initialization=True, perform_initialization=False)
    with torch.device("meta"):
        model = build_gpt(cfg, tc)
    assert all(p.device.type == "meta" for p in model.parameters())
    return cfg, model


def analytic(shape):
    """Llama-style count: embeddings + layers (QKV, O, SwiGLU, 2 norms) + final norm."""
    hidden, layers, heads, kv, ffn, _, vocab = shape
    head = hidden // heads
    vocab = -(-vocab // 128) * 128  # megatron pads the vocabulary
    per_layer = hidden * (heads + 2 * kv) * head + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return 2 * vocab * hidden + layers * per_layer + hidden


@pytest.mark.parametrize("name", sorted(TABLE16))
def test_table16_counts(mp1, name):
    shape = TABLE16[name]
    _, vanilla = meta_model(shape, "vanilla")
    cfg, shifted = meta_model(shape, "kv_shift")
    n_vanilla = count_parameters(vanilla)["total"]
    n_shift = count_parameters(shifted)["total"]
    assert n_vanilla == analytic(shape)
    per_head = KVShiftOptions().num_params()
    assert per_head == 4
    assert n_shift == n_vanilla + per_head * cfg.kv_heads * cfg.num_layers
    # The names of Table 16 are total parameters.
    assert abs(n_vanilla / float(name[:-1]) / 1e9 - 1) < 0.03


def test_variant_counts(mp1):
    shape = TABLE16["2.9B"]
    _, vanilla = meta_model(shape, "vanilla")
    base = count_parameters(vanilla)["total"]
    for ks, per_head in [
        (KVShiftConfig(shift=["q", "k", "v"]), 6),
        (KVShiftConfig(window=3), 8),
        (KVShiftConfig(mode="gate"), 2),
        (KVShiftConfig(shift=["k"]), 2),
    ]:
        cfg, model = meta_model(shape, "kv_shift", ks)
        assert count_parameters(model)["total"] == base + per_head * 4 * 32, ks
