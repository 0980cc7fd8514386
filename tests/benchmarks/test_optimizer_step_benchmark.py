"""``benchmarks/optimizer_step.py``: torch's foreach AdamW against its fused kernel in
the trainer's optimizer. The numbers are measured by hand (docs/performance.md); here
it runs two rounds on the tiny config and its lines are checked."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from ..scripts import script_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "optimizer_step.py"


def test_two_rounds_time_both_kernels(tmp_path):
    from kvtrain.train.optimizer import FUSED, adam_kernel, megatron_adam_class

    env = script_env()
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(REPO / "configs" / "tiny.yaml"), "--rounds", "2",
         "--warmup", "1", "--set", "train.global_batch_size=4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    if adam_kernel(megatron_adam_class()) != FUSED:  # TE's or apex's FusedAdam: refused
        assert done.returncode != 0 and "nothing to compare" in done.stderr
        return
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"tiny\.yaml: [\d,]+ parameters in \d+ tensors, (cpu|cuda), \d+ threads, "
                     r"median of 2\n", done.stdout), done.stdout
    for what in ("inner", "train"):
        line = re.search(rf"^{what} step: foreach ([\d.]+) ms, fused ([\d.]+) ms \(([\d.]+)x\)$",
                         done.stdout, re.M)
        assert line, done.stdout
        foreach, fused, ratio = map(float, line.groups())
        assert foreach > 0 and fused > 0 and ratio > 0
