"""An experiment's results read back from its arms: the curve of an arm's
``metrics.jsonl`` and the summary of its rows."""

from __future__ import annotations

import json
import math

from kvtrain.experiments.results import curve_from_metrics


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
