"""Paths of the KV shift a review found wrong (session 11), each test seen failing
before its fix: decoding a batch in micro batches (megatron's inference wrappers),
``mode: clamp`` at windows 2-3, the configured kernel under context parallelism,
and decoding under context parallelism (refused)."""

from __future__ import annotations

import pytest
import torch

from megatron.core.inference.contexts import StaticInferenceContext

from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config

VOCAB = 96


def _model(window=1, shift=("k", "v"), backend="torch"):
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, attention="kv_shift",
                      kv_shift=KVShiftConfig(shift=list(shift), window=window))
    return build_gpt(cfg, transformer_config(cfg), backend=backend).eval()


def test_decode_with_micro_batches_keeps_the_other_rows_tail(mp1):
    """megatron's static inference splits a large batch into micro batches
    (``batch_size_offset``, AbstractModelInferenceWrapper): each micro batch runs the
    prefill at sequence_len_offset 0. The KV cache keeps every row; the shift's raw
    tail must too."""
    model = _model()
    b, prompt, seq = 4, 4, 6
    tokens = torch.randint(0, VOCAB, (b, seq), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(seq)[None].expand_as(tokens)
    with torch.no_grad():
        full = model(tokens, pos, None, runtime_gather_output=True)  # [b, s, V]
        ctx = StaticInferenceContext(max_batch_size=b, max_sequence_length=seq)
        for step_start, step_end in [(0, prompt), (prompt, prompt + 1)]:
            out = []
            for rows in (slice(0, 2), slice(2, 4)):  # two micro batches of 2 rows
                ctx.batch_size_offset = rows.start
                out.append(model(tokens[rows, step_start:step_end], pos[rows, step_start:step_end],
                                 None, inference_context=ctx, runtime_gather_output=True))
            ctx.batch_size_offset = 0
            ctx.sequence_len_offset += step_end - step_start
        last = torch.cat(out, dim=0)[:, -1]  # the decode step's logits, all rows
    torch.testing.assert_close(last, full[:, prompt], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [2, 3])
def test_clamp_mode_longer_window_init_leaves_no_coefficient_dead(mp1, window):
    """mode clamp, window >= 2: footnote 10's init (first w ~ U(0,1), last = 1 - their
    sum) stores the oldest lag's coefficient below 0 for ~1/2 (w=2) or ~5/6 (w=3) of
    the heads; clamp(0, 1) then gives it the value 0 *and gradient 0*, so it can
    never learn: those heads silently lose the lag."""
    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=8,
                      vocab_size=VOCAB, max_position_embeddings=64, attention="kv_shift",
                      kv_shift=KVShiftConfig(window=window, mode="clamp"))
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(12)[None].expand_as(tokens)
    model(tokens, pos, None).float().pow(2).mean().backward()
    attn = model.decoder.layers[0].self_attention
    for name in ("shift_k", "shift_v"):
        grad = getattr(attn, name).grad  # [heads, w+1]
        dead = (grad[:, -1] == 0).nonzero().flatten().tolist()
        assert not dead, (f"{name}: heads {dead} have stored last coefficient "
                          f"{getattr(attn, name)[dead, -1].tolist()} and zero gradient")


def test_context_parallel_halo_shift_runs_the_configured_kernel(mp1, monkeypatch):
    """model.kv_shift.kernel: torch (e.g. the smoke verdict turned a kernel off) must
    hold under context parallelism too; shift_context_parallel calls fused_shift
    without ``impl``, so ``auto`` (native on the CPU, Triton on a GPU) runs instead.
    CP is faked with the one-rank world group (a CP group of 1 rank is exact)."""
    import torch.distributed as dist

    from kvtrain.model import kv_shift as kv_shift_module, native_shift

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=VOCAB, max_position_embeddings=64, attention="kv_shift",
                      kv_shift=KVShiftConfig(kernel="torch"))
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    assert model.decoder.layers[0].self_attention.kv_shift.kernel == "torch"
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(8)[None].expand_as(tokens)
    model(tokens, pos, None)  # without CP: the torch kernel, fine

    def refuse(*args, **kwargs):
        raise AssertionError("the native kernel ran, but model.kv_shift.kernel is torch")

    monkeypatch.setattr(native_shift, "shift", refuse)
    monkeypatch.setattr(kv_shift_module, "cp_group", lambda: dist.group.WORLD)
    model(tokens, pos, None)


def test_decoding_under_context_parallelism_is_refused(mp1, monkeypatch):
    """The shift's decoding cache holds each rank's own tokens only: refused in one
    line (the check used to sit behind the decoding branch, out of reach)."""
    import torch.distributed as dist
    from kvtrain.model import kv_shift as kv_shift_module

    model = _model()
    monkeypatch.setattr(kv_shift_module, "cp_group", lambda: dist.group.WORLD)
    tokens = torch.randint(0, VOCAB, (1, 4), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(4)[None]
    ctx = StaticInferenceContext(max_batch_size=1, max_sequence_length=8)
    with torch.no_grad(), pytest.raises(ValueError, match="^KV-shift decoding with context "
                                                          "parallelism is not supported$"):
        model(tokens, pos, None, inference_context=ctx)
