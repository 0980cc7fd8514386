"""KVShiftSelfAttention against an independent reference written from the paper.

The reference below is plain PyTorch from the paper's equations (4)-(6) with
the footnote-10 window and the App. F.1 coefficient modes, GQA and RoPE; it
shares no code with kvtrain. It loads the megatron layer's weights and must
give the same output and the same input, weight and α/β gradients (fp32, 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from tests.asserts import assert_close_to_scale

SEQ, BATCH = 12, 2


# ----------------------------------------------------------------------------- reference
def ref_coefficients(param: torch.Tensor, mode: str) -> torch.Tensor:
    """[G, n] stored -> [G, w+1] coefficients (index i = i tokens back)."""
    if mode == "free":
        return param
    if mode == "clamp":
        return torch.minimum(torch.maximum(param, torch.zeros_like(param)), torch.ones_like(param))
    # gate: window 1 -> (sigmoid(a), 1 - sigmoid(a)); longer -> softmax with a 0 logit last.
    if param.shape[1] == 1:
        a1 = torch.sigmoid(param[:, 0])
        return torch.stack([a1, 1 - a1], dim=1)
    z = torch.cat([param, torch.zeros(param.shape[0], 1)], dim=1)
    return torch.exp(z) / torch.exp(z).sum(dim=1, keepdim=True)


def ref_shift(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """x [b, s, h, d]; x̂_t = Σ_i coef[h, i] x_{t-i}, with x_{<0} = 0 (explicit loops)."""
    b, s, h, d = x.shape
    out = torch.zeros_like(x)
    for t in range(s):
        for i in range(coef.shape[1]):
            if t - i >= 0:
                out[:, t] = out[:, t] + coef[:, i].view(1, h, 1) * x[:, t - i]
    return out


def ref_rope(x: torch.Tensor, base: float) -> torch.Tensor:
    """x [b, s, h, d]: rotate (x_j, x_{j+d/2}) pairs by angle t·base^(-2j/d)."""
    b, s, h, d = x.shape
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # [d/2]
    ang = torch.arange(s, dtype=torch.float32)[:, None] * inv[None]  # [s, d/2]
    cos, sin = ang.cos()[None, :, None], ang.sin()[None, :, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def ref_attention_block(x, w_qkv, w_o, heads, groups, base, coefs):
    """x [b, s, D] -> [b, s, D]: Q,K,V = xW; shift; RoPE(Q, K̂); causal softmax; O."""
    b, s, D = x.shape
    d = D // heads
    per = heads // groups
    # megatron's fused QKV weight rows are grouped: [q_1..q_per, k, v] per KV group
    w = w_qkv.view(groups, per + 2, d, D)
    q = torch.einsum("bsD,gpdD->bsgpd", x, w[:, :per]).reshape(b, s, heads, d)
    k = torch.einsum("bsD,gdD->bsgd", x, w[:, per])
    v = torch.einsum("bsD,gdD->bsgd", x, w[:, per + 1])
    if "q" in coefs:
        q = ref_shift(q, coefs["q"].repeat_interleave(per, dim=0))
    if "k" in coefs:
        k = ref_shift(k, coefs["k"])
    if "v" in coefs:
        v = ref_shift(v, coefs["v"])
    q, k = ref_rope(q, base), ref_rope(k, base)
    k = k.repeat_interleave(per, dim=2)  # GQA: each query head reads its group's K/V
    v = v.repeat_interleave(per, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    ctx = torch.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, D)
    return ctx @ w_o.T


# ----------------------------------------------------------------------------- the test
VARIANTS = [
    # (shift, window, mode)
    (["k", "v"], 1, "free"),
    (["k"], 1, "free"),
    (["v"], 1, "free"),
    (["q", "k", "v"], 1, "free"),
    (["k", "v"], 2, "free"),
    (["k", "v"], 3, "free"),
    (["k", "v"], 1, "gate"),
    (["k", "v"], 2, "gate"),
    (["k", "v"], 1, "clamp"),
]


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("shift,window,mode", VARIANTS, ids=lambda v: str(v))
def test_layer_matches_reference(mp1, groups, shift, window, mode):
    heads, hidden = 4, 32
    model_cfg = ModelConfig(
        num_layers=1, hidden_size=hidden, num_attention_heads=heads, num_query_groups=groups,
        vocab_size=64, max_position_embeddings=64, rotary_base=100000, attention="kv_shift",
        kv_shift=KVShiftConfig(shift=shift, window=window, mode=mode),
    )
    model = build_gpt(model_cfg, transformer_config(model_cfg), seed=7)
    attn = model.decoder.layers[0].self_attention
    if mode == "clamp":
        # Put some coefficients outside [0, 1] so the clamp (and its zero gradient) matters.
        with torch.no_grad():
            attn.shift_k[0, 0] = 1.7
            attn.shift_k[-1, -1] = -0.4

    x = torch.randn(SEQ, BATCH, hidden, requires_grad=True)  # [s, b, h] megatron layout
    rope = model.rotary_pos_emb(SEQ)
    out, bias = attn(x, attention_mask=None, rotary_pos_emb=rope)
    assert bias is None
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    # The reference, on copies of the same weights.
    w_qkv = attn.linear_qkv.weight.detach().clone().requires_grad_()
    w_o = attn.linear_proj.weight.detach().clone().requires_grad_()
    params = {t: getattr(attn, f"shift_{t}").detach().clone().requires_grad_() for t in shift}
    coefs = {t: ref_coefficients(p, mode) for t, p in params.items()}
    xr = x.detach().clone().transpose(0, 1).requires_grad_()  # [b, s, h]
    ref = ref_attention_block(xr, w_qkv, w_o, heads, groups, 100000.0, coefs)
    ref.backward(grad_out.transpose(0, 1))

    torch.testing.assert_close(out.transpose(0, 1), ref, atol=1e-5, rtol=1e-5)
    # gradients to their own scale: a fixed 1e-5 would pass a halved small one
    assert_close_to_scale(x.grad.transpose(0, 1), xr.grad)
    assert_close_to_scale(attn.linear_qkv.weight.grad, w_qkv.grad)
    assert_close_to_scale(attn.linear_proj.weight.grad, w_o.grad)
    for t, p in params.items():
        got = getattr(attn, f"shift_{t}").grad
        assert got is not None and got.shape == p.shape
        assert_close_to_scale(got, p.grad, msg=f"shift_{t}")
    if mode == "clamp":
        assert attn.shift_k.grad[0, 0] == 0 and attn.shift_k.grad[-1, -1] == 0


def test_vanilla_layer_matches_reference(mp1):
    """The same reference with no shift is megatron's vanilla attention (sanity of the reference)."""
    model_cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            num_query_groups=2, vocab_size=64, max_position_embeddings=64)
    model = build_gpt(model_cfg, transformer_config(model_cfg), seed=7)
    attn = model.decoder.layers[0].self_attention
    x = torch.randn(SEQ, BATCH, 32)
    out, _ = attn(x, attention_mask=None, rotary_pos_emb=model.rotary_pos_emb(SEQ))
    ref = ref_attention_block(x.transpose(0, 1), attn.linear_qkv.weight.detach(),
                              attn.linear_proj.weight.detach(), 4, 2, 100000.0, {})
    torch.testing.assert_close(out.detach().transpose(0, 1), ref, atol=1e-5, rtol=1e-5)
