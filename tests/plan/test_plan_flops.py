"""kvtrain/plan/flops.py: the hardware FLOPs of each recompute mode."""

from __future__ import annotations

import pytest

from kvtrain.config import load_config
from kvtrain.plan.flops import step_flops

from ..launch.conftest import REPO


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_hardware_flops_add_what_each_recompute_mode_reruns(recompute):
    cfg = load_config(REPO / "configs" / "paper" / "1.5b_vanilla.yaml")
    m, s, b = cfg.model, 2048, 8
    h, layers = m.hidden_size, m.num_layers
    flops = step_flops(m, s, b, recompute=recompute)
    # one forward of causal core attention (QK^T and A.V over (s+1)/2 keys per query)
    core_attention = b * layers * 2 * 2 * h * s * (s + 1) / 2
    # one forward of every layer (full recompute, one layer per checkpoint): the
    # vanilla layer's matmuls (Q, K, V, output; SwiGLU) and its core attention
    layer_matmuls = b * layers * s * 2 * (4 * h * h + 3 * h * m.ffn_size)
    extra = {"none": 0.0,
             # megatron's selective recompute (recompute_modules core_attn) reruns it
             "selective": core_attention,
             "full": layer_matmuls + core_attention}[recompute]
    assert flops.hardware - flops.model == pytest.approx(extra, rel=1e-12)


@pytest.mark.parametrize("precision, backend, peak", [
    ("bf16", "auto", 312.0),  # dense 16-bit tensor cores
    ("fp16", "torch", 312.0),
    ("fp32", "auto", 156.0),  # planned as te: TE's GEMMs run fp32 as TF32
    ("fp32", "te", 156.0),
    ("fp32", "torch", 19.5),  # PyTorch leaves TF32 off: FP32 cores
    ("fp32", "local", 19.5),
])
def test_wall_time_uses_the_peak_of_the_runs_precision(precision, backend, peak):
    from kvtrain.plan import make_plan

    cfg = load_config(REPO / "configs" / "paper" / "1.5b_vanilla.yaml",
                      [f"train.precision={precision}", f"model.backend={backend}",
                       "parallel.recompute=full"])
    plan = make_plan(cfg, nodes=8, gpu="a100", mfu=0.5)
    assert plan.step_seconds == pytest.approx(plan.flops.model / (64 * peak * 1e12 * 0.5))
