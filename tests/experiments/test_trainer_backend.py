"""The experiment runner driving ``kvtrain train`` (``--backend trainer``).

The end-to-end test trains both fig1b arms with ``kvtrain train`` (``data.type:
induction``) and reads the accuracies from its validation records."""

from __future__ import annotations

import json

import pytest

from kvtrain.cli import main
from kvtrain.experiments.induction import experiment_spec
from kvtrain.experiments.trainer_backend import (
    arm_config,
    curve_from_metrics,
)

from .test_experiment_cli import TINY, check_outputs


def test_arm_config_carries_the_settings():
    settings, arms = experiment_spec("fig1b", "cpu")
    cfg = arm_config(settings, arms[0], "x", "g", wandb=False)
    assert cfg["model"]["attention"] == "kv_shift" and cfg["model"]["num_layers"] == 1
    assert cfg["model"]["hidden_size"] == 8
    assert cfg["train"]["global_batch_size"] == settings.batch_size
    assert cfg["train"]["eval_iters"] * settings.batch_size >= settings.eval_samples
    assert cfg["optimizer"]["lr"] == settings.lr
    assert cfg["data"]["type"] == "induction"
    assert cfg["data"]["induction"] == dict(settings.task_options)
    assert cfg["data"]["eval_seed"] == settings.eval_seed


def test_curve_from_metrics(tmp_path):
    records = [
        {"kind": "train", "iteration": 2, "lm_loss": 5.0, "lr": 0.1},
        {"kind": "valid", "iteration": 2, "val_loss": 4.5, "val_acc_induction_first": 0.25,
         "val_acc_induction_all": 0.5},
        {"kind": "kv_shift", "iteration": 2},
        {"kind": "train", "iteration": 4, "lm_loss": 4.0, "lr": 0.2},
        {"kind": "valid", "iteration": 4, "val_loss": 3.5, "val_acc_induction_first": 1.0,
         "val_acc_induction_all": 0.75},
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = curve_from_metrics(path, "arm", "induction")
    assert [(r["step"], r["accuracy"], r["accuracy_all"], r["loss"], r["train_loss"])
            for r in rows] == [(2, 0.25, 0.5, 4.5, 5.0), (4, 1.0, 0.75, 3.5, 4.0)]


@pytest.mark.slow
def test_fig1b_tiny_with_kvtrain_train(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "disabled")
    run_dir = tmp_path / "fig1b"
    rc = main(["experiment", "induction", "--preset", "fig1b", "--run-dir", str(run_dir),
               "--backend", "trainer", "--set", "task.max_val=128", *TINY])
    assert rc == 0
    check_outputs(run_dir, ["kv_shift-1L", "vanilla-2L"], steps=(2, 4))
    for arm in ("kv_shift-1L", "vanilla-2L"):
        records = [json.loads(x) for x in
                   (run_dir / "arms" / arm / "run" / "metrics.jsonl").read_text().splitlines()]
        valid = [r for r in records if r["kind"] == "valid"]
        assert [r["iteration"] for r in valid] == [2, 4]
        assert all("val_acc_induction_first" in r and "val_acc_induction_all" in r
                   for r in valid)
