"""``kvtrain experiment induction`` end to end, tiny: results.csv, accuracy.png,
loss.png and summary.json are written and well-formed, every arm present."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrain.cli import main
from kvtrain.experiments.induction import _arms, experiment_spec, preset_settings

PNG = b"\x89PNG\r\n\x1a\n"
TINY = ["--steps", "4", "--eval-interval", "2", "--eval-samples", "8", "--threads", "1",
        "--set", "batch_size=4", "--set", "micro_batch_size=2", "--set", "seq_length=32",
        "--set", "vocab_size=128", "--set", "hidden_size=16", "--set", "warmup_steps=2"]


def check_outputs(run_dir: Path, arms: list[str], steps=(0, 2, 4)) -> None:
    with open(run_dir / "results.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
    assert reader.fieldnames[:4] == ["arm", "step", "accuracy", "accuracy_all"]
    assert {"arm", "step", "accuracy", "loss"} <= set(reader.fieldnames)
    assert [r["arm"] for r in rows] == [a for a in arms for _ in steps]
    for arm in arms:
        assert [int(r["step"]) for r in rows if r["arm"] == arm] == list(steps)
    for r in rows:
        assert 0.0 <= float(r["accuracy"]) <= 1.0 and 0.0 <= float(r["accuracy_all"]) <= 1.0
        assert 0.0 < float(r["loss"]) < 20.0
    for png in ("accuracy.png", "loss.png"):
        data = (run_dir / png).read_bytes()
        assert data[:8] == PNG and len(data) > 1000
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["arms"]) == arms
    for a in summary["arms"].values():
        assert a["final_step"] == steps[-1] and "steps_to_95" in a and a["wall_s"] >= 0
    for arm in arms:
        assert (run_dir / "arms" / arm / "curve.csv").exists()


def test_fig1a_tiny_in_process(mp1, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "fig1a"
    rc = main(["experiment", "induction", "--preset", "fig1a", "--run-dir", str(run_dir),
               "--set", "task.max_val=128", *TINY])
    assert rc == 0
    arms = ["kv_shift-1L", "vanilla-1L", "vanilla-2L", "vanilla-4L"]
    check_outputs(run_dir, arms)
    out = capsys.readouterr().out
    assert "steps->95%" in out and "vanilla-4L" in out
    spec = json.loads((run_dir / "spec.json").read_text())
    assert spec["settings"]["steps"] == 4 and spec["preset"] == "fig1a"
    try:
        import wandb  # noqa: F401
    except ImportError:
        return
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == len(arms)  # one wandb run per arm


def test_same_initial_weights_and_data_for_every_arm(mp1, tmp_path, monkeypatch):
    """KV shift 1L and vanilla 1L start from the same weights (KV-shift
    coefficients aside) and see the same data: with the shift set to the
    identity they would be the same model, so their step-0 evaluations differ
    only through the shift."""
    monkeypatch.setenv("KVTRAIN_NO_WANDB", "1")
    from kvtrain.experiments.standalone import datasets, model_config

    settings, arms = experiment_spec("fig1a", "cpu", steps=2, eval_samples=4, seq_length=32,
                                     vocab_size=128, hidden_size=16, **{"task.max_val": 128})
    a, b = datasets(settings), datasets(settings)
    assert (a[0].batch(range(4))["tokens"] == b[0].batch(range(4))["tokens"]).all()
    from kvtrain.backend import set_seed
    from kvtrain.model.builder import build_gpt, transformer_config

    weights = []
    for arm in arms[:2]:
        set_seed(settings.seed)
        cfg = model_config(settings, arm)
        model = build_gpt(cfg, transformer_config(cfg), seed=settings.seed)
        weights.append({k: v for k, v in model.state_dict().items()
                        if "shift" not in k and "_extra_state" not in k})
    assert weights[0].keys() == weights[1].keys()
    for k in weights[0]:
        assert (weights[0][k] == weights[1][k]).all(), k


def test_presets_and_scales():
    for preset in ("fig1a", "fig1b", "ngram"):
        for scale in ("cpu", "paper"):
            s = preset_settings(preset, scale)
            assert s.vocab_size >= 128 and s.batch_size % s.micro_batch_size == 0
    paper = preset_settings("fig1a", "paper")
    assert (paper.hidden_size, paper.vocab_size, paper.seq_length) == (1024, 8000, 512)
    assert (paper.lr, paper.warmup_steps) == (2e-4, 1000)
    assert preset_settings("fig1b", "cpu").hidden_size == 8
    assert [a.name for a in _arms("fig1b")] == ["kv_shift-1L", "vanilla-2L"]
    assert {a.attention for a in _arms("ngram")} == {"vanilla", "kv_shift"}
    assert len({a.num_layers for a in _arms("ngram")}) == 1


def test_bad_options_are_one_line_errors(capsys):
    assert main(["experiment", "induction", "--preset", "fig1a", "--set", "lr_typo=1"]) == 2
    assert "unknown experiment setting 'lr_typo'" in capsys.readouterr().err
    assert main(["experiment", "induction", "--preset", "fig1b", "--arms", "nope"]) == 2
    assert "unknown arm" in capsys.readouterr().err


@pytest.mark.slow
def test_ngram_tiny_two_workers_subprocess(tmp_path):
    """The command line itself, arms side by side in two processes."""
    run_dir = tmp_path / "ngram"
    env = {**os.environ, "WANDB_MODE": "disabled"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvtrain.cli", "experiment", "induction", "--preset", "ngram",
         "--run-dir", str(run_dir), "--workers", "2", *TINY, "--set", "seq_length=30"],
        capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_outputs(run_dir, ["kv_shift-2L", "vanilla-2L"])


def test_set_values_are_typed():
    from kvtrain.commands.experiment import _parse_value

    assert _parse_value("1e-2") == 0.01 and _parse_value("3") == 3
    assert _parse_value("true") is True and _parse_value("null") is None
    assert _parse_value("strict") == "strict"
