"""Whole-model properties of the KV-shift GPT: identity shift, document resets, specs, errors."""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.kv_shift import KVShiftSelfAttention, is_kv_shift_param
from kvtrain.model.specs import layer_spec


def tiny(attention="vanilla", **kw):
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                vocab_size=96, max_position_embeddings=64, attention=attention)
    base.update(kw)
    return ModelConfig(**base)


def logits(model, tokens, mask=None):
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    return model(tokens, pos, mask)  # [b, s, vocab]


def test_identity_shift_equals_vanilla(mp1):
    """α = (1, 0), β = (1, 0) makes KV shifting attention vanilla attention."""
    vanilla_cfg, shift_cfg = tiny("vanilla"), tiny("kv_shift")
    vanilla = build_gpt(vanilla_cfg, transformer_config(vanilla_cfg))
    shifted = build_gpt(shift_cfg, transformer_config(shift_cfg))
    missing, unexpected = shifted.load_state_dict(vanilla.state_dict(), strict=False)
    assert unexpected == []
    assert sorted(missing) == sorted(
        f"decoder.layers.{i}.self_attention.shift_{t}" for i in range(2) for t in "kv"
    )
    tokens = torch.randint(0, 96, (2, 16))
    assert not torch.allclose(logits(vanilla, tokens), logits(shifted, tokens), atol=1e-3)
    with torch.no_grad():
        for name, p in shifted.named_parameters():
            if is_kv_shift_param(p):
                p.copy_(torch.tensor([1.0, 0.0]).expand_as(p))
    torch.testing.assert_close(logits(shifted, tokens), logits(vanilla, tokens), atol=1e-6, rtol=0)


def test_shift_resets_at_document_boundary_in_packed_sequence(mp1):
    """With a reset_attention_mask-style mask, a document packed after another
    gives the same logits as the document alone (RoPE is relative, the shift resets)."""
    cfg = tiny("kv_shift")
    model = build_gpt(cfg, transformer_config(cfg))
    a, b = torch.randint(0, 96, (1, 5)), torch.randint(0, 96, (1, 7))
    packed = torch.cat([a, b], dim=1)
    s = packed.shape[1]
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    allowed[5:, :5] = False  # the second document cannot see the first
    mask = ~allowed[None, None]  # megatron: True = masked
    out = logits(model, packed, mask)
    torch.testing.assert_close(out[:, 5:], logits(model, b), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[:, :5], logits(model, a), atol=1e-5, rtol=1e-5)

    # Vanilla attention with the same mask does too; KV shift without the reset would not.
    leaky = logits(model, packed, ~torch.ones(s, s, dtype=torch.bool).tril()[None, None])
    assert not torch.allclose(leaky[:, 5:], out[:, 5:], atol=1e-4)


def test_spec_swaps_only_self_attention():
    vanilla, shifted = layer_spec("vanilla", backend="local"), layer_spec("kv_shift", backend="local")
    assert shifted.submodules.self_attention.module is KVShiftSelfAttention
    assert vanilla.submodules.self_attention.module is not KVShiftSelfAttention
    for field in ("input_layernorm", "pre_mlp_layernorm", "mlp", "self_attn_bda", "mlp_bda"):
        assert getattr(shifted.submodules, field) == getattr(vanilla.submodules, field), field
    assert (shifted.submodules.self_attention.submodules
            == vanilla.submodules.self_attention.submodules)
    with pytest.raises(ValueError, match="unknown attention"):
        layer_spec("nope", backend="local")


def test_shift_params_marked_and_named(mp1):
    cfg = tiny("kv_shift", kv_shift=KVShiftConfig(shift=["q", "k", "v"], window=2))
    model = build_gpt(cfg, transformer_config(cfg))
    shift = {n: p for n, p in model.named_parameters() if is_kv_shift_param(p)}
    assert len(shift) == 2 * 3
    for name, p in shift.items():
        assert name.split(".")[-1] in {"shift_q", "shift_k", "shift_v"}
        assert p.shape == (2, 3)  # [KV heads, window + 1]
        assert p.tensor_model_parallel and p.partition_dim == 0
        assert not getattr(p, "sequence_parallel", False)
    others = [p for p in model.parameters() if not is_kv_shift_param(p)]
    assert others and not any(is_kv_shift_param(p) for p in others)


def test_same_seed_same_coefficients_other_seed_other(mp1):
    cfg = tiny("kv_shift")
    tc = transformer_config(cfg)
    a, b, c = build_gpt(cfg, tc, seed=5), build_gpt(cfg, tc, seed=5), build_gpt(cfg, tc, seed=6)
    ka = a.decoder.layers[0].self_attention.shift_k
    assert torch.equal(ka, b.decoder.layers[0].self_attention.shift_k)
    assert not torch.equal(ka, c.decoder.layers[0].self_attention.shift_k)
    # Different layers draw different values.
    assert not torch.equal(ka, a.decoder.layers[1].self_attention.shift_k)


def test_unsupported_layouts_give_clear_errors(mp1):
    cfg = tiny("kv_shift")
    tc = transformer_config(cfg)
    tc.fused_single_qkv_rope = True
    with pytest.raises(ValueError, match="fused_single_qkv_rope"):
        build_gpt(cfg, tc)


def test_thd_packed_sequences_reset_at_cu_seqlens(mp1):
    """THD packing (which needs TE attention to run end to end): the Q/K/V the
    attention sees reset at each cu_seqlens boundary, as if each sequence were alone."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cfg = tiny("kv_shift")
    attn = build_gpt(cfg, transformer_config(cfg)).decoder.layers[0].self_attention
    seen = {}

    def capture(query, key, value, *args, **kwargs):  # stands in for core attention
        seen["k"], seen["v"] = key, value
        raise StopIteration

    attn.core_attention.forward = capture
    x = torch.randn(9, 1, 32)  # [t, 1, h]: three packed sequences of 3, 2 and 4 tokens
    cu = torch.tensor([0, 3, 5, 9], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=4, max_seqlen_kv=4)
    with pytest.raises(StopIteration):
        attn(x, attention_mask=None, packed_seq_params=params)
    packed = seen["k"]  # [t, g, d] after megatron squeezes the THD batch dim
    for a, b in [(0, 3), (3, 5), (5, 9)]:
        with pytest.raises(StopIteration):
            attn(x[a:b], attention_mask=None)
        torch.testing.assert_close(packed[a:b], seen["k"][:, 0])


def test_fused_softmax_only_with_its_kernels(monkeypatch):
    """A GPU without apex's softmax kernels must get megatron's unfused softmax: the
    fused one import-fails at the first bf16 forward (seen on an H200)."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert transformer_config(tiny()).masked_softmax_fusion is False
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert transformer_config(tiny()).masked_softmax_fusion is True
