"""kvtrain/plan/params.py per rank against the parameters megatron builds and the
way each backend's spec shards them."""

from __future__ import annotations

import pytest

from kvtrain.config import load_config
from kvtrain.plan import stage_params

from ..launch.conftest import REPO

MLA = REPO / "configs" / "paper" / "mla_kv_shift.yaml"


def _per_rank_from_megatron(cfg, tensor: int, duplicated: tuple[str, ...]) -> int:
    """One TP rank's parameters at TP ``tensor``, from the TP 1 model built on the meta
    device: megatron marks what TP splits (``tensor_model_parallel``); the modules
    named in ``duplicated`` are kept whole on every rank."""
    import torch

    from kvtrain.config.schema import ParallelConfig
    from kvtrain.model.builder import build_gpt, transformer_config

    with torch.device("meta"):
        # initialised (on the meta device: no memory), as that marks the TP attributes
        tc = transformer_config(cfg.model, ParallelConfig())
        model = build_gpt(cfg.model, tc, seed=cfg.train.seed)
    total = 0
    for name, p in model.named_parameters():
        split = getattr(p, "tensor_model_parallel", False) and not any(
            d in name for d in duplicated)
        total += p.numel() // tensor if split else p.numel()
    return total


# megatron's MLA specs (gpt_layer_specs.py): the local spec makes the down projections
# ColumnParallelLinear (split over TP); the TE spec makes them TELinear, which
# MLASelfAttention builds with parallel_mode='duplicated' (multi_latent_attention.py).
@pytest.mark.parametrize("backend, duplicated", [
    ("torch", ()),
    ("local", ()),
    ("te", ("linear_q_down_proj", "linear_kv_down_proj")),
    ("auto", ("linear_q_down_proj", "linear_kv_down_proj")),  # planned as te
])
@pytest.mark.parametrize("q_lora_rank", ["null", "128"])
def test_mla_per_rank_params_follow_the_backends_spec(mp1, backend, duplicated, q_lora_rank):
    # a vocabulary padded alike at TP 1 and 2, so the TP 1 build's embedding halves
    cfg = load_config(MLA, ["model.num_layers=2", "model.vocab_size=50432",
                            f"model.mla.q_lora_rank={q_lora_rank}",
                            f"model.backend={backend}", "parallel.tensor=2"])
    expected = _per_rank_from_megatron(cfg, 2, duplicated)
    assert stage_params(cfg.model, cfg.parallel)[0].params == expected
