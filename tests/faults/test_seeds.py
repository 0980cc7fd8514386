"""Item 9: pipeline stages draw their initial weights from their own streams.

Each transformer layer is drawn from a stream seeded by (seed, global layer
number), so the two stages of PP=2 start from different weights, and a PP=2
model is the PP=1 model cut in two (same seed, same weights, embedding and
output layer included). The same seed and layout give the same model.
"""

from __future__ import annotations

import torch

from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.testing import run_distributed

LAYERS = 4


def _model_config() -> ModelConfig:
    return ModelConfig(num_layers=LAYERS, hidden_size=32, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=64, vocab_size=128,
                       make_vocab_size_divisible_by=64, max_position_embeddings=64,
                       attention="kv_shift")


def _build(pipeline: int, seed: int, virtual: int | None = None) -> dict:
    """This rank's model (all its virtual chunks), state by global parameter name."""
    from kvtrain.backend import init_model_parallel, set_seed
    from kvtrain.model.builder import build_gpt, transformer_config

    init_model_parallel(pipeline=pipeline, virtual_pipeline=virtual)
    set_seed(seed)
    cfg = _model_config()
    tconfig = transformer_config(cfg, ParallelConfig(pipeline=pipeline, virtual_pipeline=virtual))
    out = {}
    for vp_stage in range(virtual or 1):
        model = build_gpt(cfg, tconfig, seed=seed, vp_stage=vp_stage if virtual else None)
        numbers = [layer.layer_number - 1 for layer in model.decoder.layers]  # global
        for name, p in model.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(numbers[int(parts[2])])
            out[".".join(parts)] = p.detach().clone()
    return out


def _worker(rank: int, world: int) -> dict:
    built = {"pp1": _build(1, 1234), "vpp": _build(2, 1234, virtual=2),
             "pp2": _build(2, 1234), "pp2_again": _build(2, 1234)}
    return {**built, "rng_after": torch.rand(4)}  # the PP=2 stages' runtime streams


def test_pipeline_stages_draw_their_own_weights():
    stage0, stage1 = run_distributed(_worker, 2)
    qkv = "decoder.layers.{}.self_attention.linear_qkv.weight"
    first0, first1 = stage0["pp2"][qkv.format(0)], stage1["pp2"][qkv.format(2)]
    assert not torch.equal(first0.flatten()[:16], first1.flatten()[:16])
    # no tensor of stage 1 starts with the draws of a tensor of stage 0 (with one
    # stream per rank, stage 1's first layer repeated stage 0's embedding draws)
    heads0 = {n: v.flatten()[:16] for n, v in stage0["pp2"].items() if v.numel() >= 16}
    for name, value in stage1["pp2"].items():
        if value.numel() >= 16 and value.std() > 0:
            same = [n for n, h in heads0.items() if torch.equal(h, value.flatten()[:16])]
            assert not same, f"stage 1 {name} repeats the draws of stage 0 {same}"
    for stage in (stage0, stage1):
        # the same seed and layout give the same model
        assert stage["pp2"].keys() == stage["pp2_again"].keys()
        for name, value in stage["pp2"].items():
            assert torch.equal(value, stage["pp2_again"][name]), name
            # ... and the PP=2 stages are the PP=1 model cut in two
            assert torch.equal(value, stage["pp1"][name]), name
        for name, value in stage["vpp"].items():  # interleaved stages too
            assert torch.equal(value, stage["pp1"][name]), name
    assert {n for s in (stage0, stage1) for n in s["pp2"]} == set(stage0["pp1"])
    # the stages' runtime streams (dropout) differ too
    assert not torch.equal(stage0["rng_after"], stage1["rng_after"])
