"""GPU-only checks: the Transformer Engine spec is picked automatically and gives
the local spec's results (fp32), vanilla and KV shift; bf16 forward/backward runs.

Skipped without a CUDA device (see tests/conftest.py); run them when one is lent.
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ModelConfig
from kvtrain.model.builder import Numerics, build_gpt, transformer_config
from kvtrain.model.specs import resolve_backend, transformer_engine_available

pytestmark = pytest.mark.gpu

# local-spec name -> TE-spec name (TE fuses the pre-attention/pre-MLP norms into the linears)
TE_NAMES = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_te_name(name: str) -> str:
    for local, te in TE_NAMES.items():
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def tiny(attention):
    return ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                       vocab_size=128, make_vocab_size_divisible_by=64,
                       max_position_embeddings=128, attention=attention)


@pytest.fixture
def te():
    if not transformer_engine_available():
        pytest.fail("a GPU machine for kvtrain must have Transformer Engine (docker/Dockerfile)")
    return True


@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
def test_te_spec_matches_local_spec(mp1, te, attention):
    assert resolve_backend("auto") == "te"
    cfg = tiny(attention)
    tc = transformer_config(cfg)
    local = build_gpt(cfg, tc, backend="local").cuda()
    fused = build_gpt(cfg, tc, backend="te").cuda()
    te_params = dict(fused.named_parameters())
    with torch.no_grad():
        for name, p in local.named_parameters():
            te_params[to_te_name(name)].copy_(p)
    tokens = torch.randint(0, 128, (2, 32), device="cuda")
    pos = torch.arange(32, device="cuda")[None].expand_as(tokens)
    out_local = local(tokens, pos, None, runtime_gather_output=True)
    out_te = fused(tokens, pos, None, runtime_gather_output=True)
    torch.testing.assert_close(out_te, out_local, atol=2e-4, rtol=2e-4)


def test_bf16_kv_shift_forward_backward(mp1):
    cfg = tiny("kv_shift")
    model = build_gpt(cfg, transformer_config(cfg, numerics=Numerics.from_precision("bf16"))).cuda()
    tokens = torch.randint(0, 128, (2, 64), device="cuda")
    pos = torch.arange(64, device="cuda")[None].expand_as(tokens)
    loss = model(tokens, pos, None, labels=tokens)
    loss.float().mean().backward()
    grads = [p.grad for n, p in model.named_parameters() if "shift" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
