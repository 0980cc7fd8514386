"""A KV-shift model saved with megatron dist_checkpointing at TP=2 loads at TP=1 (and back).

The shift coefficients are per KV head and TP-sharded: if they were saved as
replicated (megatron's default for a module's own parameters), only TP rank
0's heads would survive and the logits would differ.
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.testing import run_distributed

pytestmark = pytest.mark.slow

SEQ, VOCAB = 12, 128


def model_config():
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                       max_position_embeddings=64, attention="kv_shift")


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def gathered_logits(model):
    tok = tokens()
    with torch.no_grad():
        return model(tok, torch.arange(SEQ)[None].expand_as(tok), None, runtime_gather_output=True)


def save(model, path):
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(path))


def load(model, path):
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(model.sharded_state_dict(), str(path))
    model.load_state_dict(state)


def tp_model(tp, seed):
    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(tensor=tp)
    set_seed(seed)
    cfg = model_config()
    return build_gpt(cfg, transformer_config(cfg, ParallelConfig(tensor=tp)), seed=seed)


def save_worker(rank, world, path):
    model = tp_model(world, seed=21)
    gen = torch.Generator().manual_seed(100 + rank)
    with torch.no_grad():  # coefficients away from init, different on every head
        for name, p in model.named_parameters():
            if "shift" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    save(model, path)
    coefs = {n: p.detach().clone() for n, p in model.named_parameters() if "shift" in n}
    return gathered_logits(model), coefs


def load_worker(rank, world, path):
    model = tp_model(world, seed=99)  # different init: everything must come from the checkpoint
    load(model, path)
    return gathered_logits(model)


def test_tp2_checkpoint_loads_at_tp1(mp1, tmp_path):
    results = run_distributed(save_worker, 2, tmp_path / "ckpt")
    (logits_tp2, coefs0), (_, coefs1) = results
    # the two ranks hold different heads
    assert not torch.equal(coefs0["decoder.layers.0.self_attention.shift_k"],
                           coefs1["decoder.layers.0.self_attention.shift_k"])
    model = tp_model(1, seed=5)
    load(model, tmp_path / "ckpt")
    full = model.decoder.layers[0].self_attention.shift_k.detach()
    torch.testing.assert_close(
        full, torch.cat([coefs0["decoder.layers.0.self_attention.shift_k"],
                         coefs1["decoder.layers.0.self_attention.shift_k"]]))
    torch.testing.assert_close(gathered_logits(model), logits_tp2, atol=1e-5, rtol=1e-5)


def test_tp1_checkpoint_loads_at_tp2(mp1, tmp_path):
    model = tp_model(1, seed=8)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "shift" in name:
                p.copy_(torch.randn_like(p))
    save(model, tmp_path / "ckpt")
    expected = gathered_logits(model)
    for logits in run_distributed(load_worker, 2, tmp_path / "ckpt"):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
