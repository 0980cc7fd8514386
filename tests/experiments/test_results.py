"""An experiment's results read back from its arms: the curve of an arm's
``metrics.jsonl`` and the summary of its rows."""

from __future__ import annotations

import json
import math

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
