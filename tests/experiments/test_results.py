"""An experiment's results read back from its arms: the curve of an arm's
``metrics.jsonl``, the summary of its rows, and what an arm trained again in
its folder keeps of its earlier attempts (the trainer replaced by a python
that prints and exits)."""

from __future__ import annotations

import json
import math
import sys

from kvtrain.experiments import runner
from kvtrain.experiments.presets import arm_configs
from kvtrain.experiments.results import ArmResult, curve_from_metrics, summarize


def write_metrics(path, records: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def valid(step: int, time: float, acc: float = 0.5) -> dict:
    return {"kind": "valid", "iteration": step, "val_loss": 4.0, "val_acc_induction_first": acc,
            "val_acc_induction_all": acc, "time": time}


def test_an_lr_of_zero_is_zero_not_unknown(tmp_path):
    """The first warm-up step (or the end of a decay to 0) logs lr 0.0: the
    curve keeps 0.0; only a record without an lr gives NaN."""
    path = write_metrics(tmp_path / "metrics.jsonl", [
        {"kind": "train", "iteration": 1, "lm_loss": 5.0, "lr": 0.0, "time": 1.0}, valid(1, 2.0),
        {"kind": "train", "iteration": 2, "lm_loss": 5.0, "time": 3.0}, valid(2, 4.0)])
    lrs = [r["lr"] for r in curve_from_metrics(path, "arm", "induction")]
    assert lrs[0] == 0.0 and math.isnan(lrs[1])


def test_max_accuracy_ignores_a_nan_wherever_it_is(tmp_path):
    """An evaluation without an accuracy (NaN) does not decide the maximum:
    first or last in the rows, the maximum is that of the finite accuracies."""
    rows = curve_from_metrics(write_metrics(tmp_path / "metrics.jsonl", [
        {**valid(2, 1.0), "val_acc_induction_first": "nan"}, valid(4, 2.0, 0.25),
        valid(6, 3.0, 0.5)]), "arm", "induction")
    for order in (rows, rows[::-1]):
        summary = summarize([ArmResult("arm", order, 1.0, 0)], 1.0)
        assert summary["arms"]["arm"]["max_accuracy"] == 0.5
    nothing = summarize([ArmResult("arm", rows[:1], 1.0, 0)], 1.0)
    assert math.isnan(nothing["arms"]["arm"]["max_accuracy"])


def fake_trainer(monkeypatch, code: int, text: str) -> None:
    """Arms "trained" by a python that prints ``text`` and exits ``code``."""
    command = [sys.executable, "-c", f"print({text!r}); raise SystemExit({code})"]
    monkeypatch.setattr(runner, "arm_command", lambda cfg_path, run_dir, nproc=1: command)


def an_arm(tmp_path) -> runner.ArmJob:
    arm, cfg = arm_configs("fig1a", "cpu", ["wandb.enabled=false"])[0]
    return runner.ArmJob(arm, cfg, tmp_path / "arms" / arm.name)


def test_a_rerun_arm_keeps_the_log_of_its_failure(tmp_path, monkeypatch):
    """The same command continues a failed arm: its train.log keeps the failed
    attempt's output, and each attempt starts with a line naming it."""
    job = an_arm(tmp_path)
    fake_trainer(monkeypatch, 1, "the first attempt failed")
    assert runner.run_arms([job])[0].exit_code == 1
    fake_trainer(monkeypatch, 0, "the second attempt finished")
    assert runner.run_arms([job])[0].exit_code == 0
    log = (job.folder / "train.log").read_text().splitlines()
    assert log[1::2] == ["the first attempt failed", "the second attempt finished"], log
    assert [line.split(",")[0] for line in log[::2]] == ["===== attempt 1", "===== attempt 2"]
