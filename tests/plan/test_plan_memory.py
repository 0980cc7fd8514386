"""kvtrain/plan/memory.py against megatron's schedules and model, in-process."""

from __future__ import annotations

import pytest

from kvtrain.config import load_config
from kvtrain.plan.memory import activation_bytes

from ..launch.conftest import REPO

PAPER = REPO / "configs" / "paper"


@pytest.mark.parametrize("p, v, m, expected", [
    # megatron's get_pp_rank_microbatches (schedules.py ~765): stage s runs
    # 2(p-s-1) + (v-1)p warm-up chunk micro batches (groups of p), so keeps that + 1
    # (at most all m·v) chunks of L/(p·v) layers: (that + 1)/v in units of L/p layers
    (4, 2, 8, [5.5, 4.5, 3.5, 2.5]),
    (4, 2, 4, [4.0, 4.0, 3.5, 2.5]),  # every micro batch in warm-up on stages 0, 1
    (2, 3, 2, [2.0, 5 / 3]),
    (4, None, 8, [4, 3, 2, 1]),  # 1F1B: p - s
    (4, None, 2, [2, 2, 2, 1]),
])
def test_in_flight_micro_batches_follow_megatrons_schedule(p, v, m, expected):
    sets = [f"parallel.pipeline={p}"] + ([f"parallel.virtual_pipeline={v}"] if v else [])
    cfg = load_config(PAPER / "19b_kv_shift.yaml", sets)
    got = [activation_bytes(cfg.model, cfg.parallel, 2048, 1, m, "none", stage=s)["in_flight"]
           for s in range(p)]
    assert got == pytest.approx(expected)
