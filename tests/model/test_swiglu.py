"""kvtrain's SwiGLU (``kvtrain.model.swiglu``): megatron's eager SwiGLU bit for bit,
keeping only fc1's output for backward (3f per token in the MLP, not 5f)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrain.model.swiglu import SwiGLUFunction


def _megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """megatron's MLP without bias_activation_fusion (glu_linear_offset 0.0)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_values_and_gradients_are_megatrons_bit_for_bit(dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(16, 3, 2 * 40, generator=gen)).to(device, dtype)
    grad = torch.randn(16, 3, 40, generator=gen).to(device, dtype)
    outs, grads = [], []
    for fn in (SwiGLUFunction.apply, _megatron_glu):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        outs.append(out)
        grads.append(leaf.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def _kept_bytes(fn, *inputs) -> dict[int, int]:
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return kept


def test_an_mlp_keeps_its_input_fc1s_output_and_fc2s_input(mp1):
    """h + 2f + f elements per token (megatron's eager SwiGLU: h + 5f)."""
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import build_gpt, transformer_config

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                      vocab_size=128, make_vocab_size_divisible_by=64,
                      max_position_embeddings=32)
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    mlp = model.decoder.layers[0].mlp
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    tokens = 32 * 2
    hidden = torch.randn(32, 2, 64, requires_grad=True)
    kept = _kept_bytes(mlp, hidden)
    activations = sum(n for ptr, n in kept.items() if ptr not in params)
    assert activations == 4 * tokens * (64 + 2 * 96 + 96)
