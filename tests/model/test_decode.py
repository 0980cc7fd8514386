"""Incremental decoding with megatron's static inference context equals the full forward.

The KV cache stores shifted keys/values; the next token needs the previous
token's raw k/v (the paper's Appendix M keeps `last_k`/`last_v`).
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.inference.contexts import StaticInferenceContext

from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config

VOCAB, SEQ, PROMPT = 96, 10, 4


@pytest.mark.parametrize("backend", ["torch", "local"])
@pytest.mark.parametrize("shift,window", [(["k", "v"], 1), (["q", "k", "v"], 2)])
def test_prefill_then_decode_equals_full_forward(mp1, shift, window, backend):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, attention="kv_shift",
                      kv_shift=KVShiftConfig(shift=shift, window=window))
    model = build_gpt(cfg, transformer_config(cfg), backend=backend).eval()
    tokens = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    with torch.no_grad():
        full = model(tokens, pos, None, runtime_gather_output=True)  # [b, s, V]

        ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=SEQ)
        ctx.materialize_only_last_token_logits = False  # compare every position
        steps = [model(tokens[:, :PROMPT], pos[:, :PROMPT], None, inference_context=ctx,
                       runtime_gather_output=True)]
        ctx.sequence_len_offset += PROMPT
        for t in range(PROMPT, SEQ):
            steps.append(model(tokens[:, t:t + 1], pos[:, t:t + 1], None,
                               inference_context=ctx, runtime_gather_output=True))
            ctx.sequence_len_offset += 1
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)

    # A new prompt after reset starts from a zero tail again.
    ctx.reset()
    with torch.no_grad():
        again = model(tokens[:, :PROMPT], pos[:, :PROMPT], None, inference_context=ctx,
                      runtime_gather_output=True)
    torch.testing.assert_close(again, full[:, :PROMPT], atol=1e-5, rtol=1e-5)


def test_beam_reorder_moves_the_tail_with_the_cache(mp1):
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB,
                      max_position_embeddings=64, attention="kv_shift")
    model = build_gpt(cfg, transformer_config(cfg)).eval()
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(6)[None].expand_as(tokens)
    with torch.no_grad():
        ctx = StaticInferenceContext(max_batch_size=2, max_sequence_length=6)
        model(tokens[:, :5], pos[:, :5], None, inference_context=ctx, runtime_gather_output=True)
        ctx.sequence_len_offset = 5
        ctx.swap_key_value_dict([1, 0])  # beams swap rows
        nxt = model(tokens[[1, 0], 5:], pos[:, 5:], None, inference_context=ctx,
                    runtime_gather_output=True)
        full = model(tokens[[1, 0]], pos, None, runtime_gather_output=True)
    torch.testing.assert_close(nxt[:, 0], full[:, 5], atol=1e-5, rtol=1e-5)



class _Given(torch.nn.Module):
    """A QKV projection that hands on its input: the test gives the raw Q/K/V."""

    def forward(self, x):
        return x, None


@pytest.mark.parametrize("dtype,kernel", [(torch.bfloat16, "auto"), (torch.float32, "auto"),
                                          (torch.float32, "torch")])
@pytest.mark.parametrize("shift,window", [(["k", "v"], 1), (["q", "k", "v"], 2)])
def test_decode_shifts_bit_for_bit_as_the_full_forward(mp1, dtype, kernel, shift, window):
    """From the same raw Q/K/V, a prefill then one-token steps give the shifted Q/K/V
    of the full forward to the bit (bf16 too): greedy generation then picks what a
    teacher-forced forward predicts. (The projections and attention over the cache
    run other matmul shapes, so the logits may still differ in the last bits.)"""
    from kvtrain.model.builder import Numerics

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, attention="kv_shift",
                      kv_shift=KVShiftConfig(shift=shift, window=window, kernel=kernel))
    numerics = Numerics(params_dtype=dtype, bf16=dtype == torch.bfloat16)
    model = build_gpt(cfg, transformer_config(cfg, numerics=numerics), backend="torch").eval()
    attn = model.decoder.layers[0].self_attention
    attn.linear_qkv = _Given()
    raw = torch.randn(SEQ, 3, 32 + 2 * 2 * 8, generator=torch.Generator().manual_seed(0))
    raw = raw.to(dtype)  # [s, b, q + k + v]
    with torch.no_grad():
        full = attn.get_query_key_value_tensors(raw)[:3]
        ctx = StaticInferenceContext(max_batch_size=3, max_sequence_length=SEQ)
        attn._call.inference = ctx  # what the layer's forward notes while decoding
        steps = []
        for start, end in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, SEQ)]:
            steps.append(attn.get_query_key_value_tensors(raw[start:end])[:3])
            ctx.sequence_len_offset += end - start
    for n, name in enumerate("qkv"):
        decoded = torch.cat([step[n] for step in steps])
        assert decoded.dtype == full[n].dtype == dtype
        assert torch.equal(decoded, full[n]), f"{name}: decode differs from the full forward"
