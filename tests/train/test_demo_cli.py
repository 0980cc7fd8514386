"""``kvtrain demo`` in-process: a --config that does not exist, an arm that fails,
--fresh clearing an earlier run's outputs (and nothing else), and --workers
above the number of arms. The arms' ``kvtrain train`` commands are replaced by
short Python processes (``arm_command``): the demo's own handling is under test,
not the trainer (tests/train/test_runs.py::test_demo_command runs that)."""

from __future__ import annotations

import sys

from kvtrain.cli import main
from kvtrain.commands import demo


def test_a_config_that_does_not_exist_is_one_line(tmp_path, capsys):
    """``kvtrain demo --config`` naming no file: one line and exit 2, before any
    data is built."""
    missing = tmp_path / "missing.yaml"
    assert main(["demo", "--config", str(missing), "--run-dir", str(tmp_path / "demo")]) == 2
    assert capsys.readouterr().err == f"kvtrain demo: config {missing} not found (use --config)\n"
    assert not (tmp_path / "demo").exists()


def _earlier_demo(root):
    """A demo folder as an earlier run left it: the data (reused, so not rebuilt),
    both arms' outputs, results of their checkpoints (``kvtrain eval`` and
    ``perplexity`` write them into ``eval/``, where ``kvtrain compare`` reads them),
    and a file of the user's in an arm's folder."""
    synthetic = root / "data" / "synthetic"
    synthetic.mkdir(parents=True)
    (synthetic / "corpus.idx").write_text("")
    for arm in demo.ARMS:
        run = root / arm
        (run / "checkpoints" / "iter_0000003").mkdir(parents=True)
        (run / "checkpoints" / "latest").write_text("iter_0000003")
        (run / "wandb").mkdir()
        for name in ("config.yaml", "metrics.jsonl", "wandb_run_id"):
            (run / name).write_text("x")
        (run / "eval").mkdir()
        (run / "eval" / "perplexity-held-iter_0000003-n64.json").write_text("{}")
        (run / "notes.txt").write_text("mine")


def _fake_arms(monkeypatch, codes: dict):
    """Each arm a Python process printing its OMP_NUM_THREADS, exiting with its code."""
    def command(config, run_dir, arm, overrides, nproc):
        return [sys.executable, "-c", "import os, sys; print('threads', "
                f"os.environ['OMP_NUM_THREADS']); sys.exit({codes[arm]})"]

    monkeypatch.setattr(demo, "arm_command", command)


def test_a_failed_arm_is_named_after_fresh_cleared_only_the_run_outputs(tmp_path, capsys,
                                                                        monkeypatch):
    """``kvtrain demo --fresh`` whose kv_shift arm fails (the trainer refused it):
    exit 1 and one line naming the arm and its exit code, no comparison written.
    --fresh removed both arms' earlier outputs, but not the data nor other files. The
    earlier checkpoints' eval/ results went with them: kept, the comparison of the
    fresh arms showed them as the new runs' (same task, same iteration)."""
    root = tmp_path / "demo"
    _earlier_demo(root)
    _fake_arms(monkeypatch, {"vanilla": 0, "kv_shift": 3})
    assert main(["demo", "--run-dir", str(root), "--synthetic", "--fresh"]) == 1
    out, err = capsys.readouterr()
    assert err == ("kvtrain demo: the kv_shift arm failed (exit 3); its output is above "
                   "(kvtrain demo --fresh starts the arms over)\n")
    assert "[kv_shift] threads" in out and "[ vanilla] threads" in out
    assert not (root / "compare").exists()
    for arm in demo.ARMS:
        assert sorted(p.name for p in (root / arm).iterdir()) == ["notes.txt"]
    assert (root / "data" / "synthetic" / "corpus.idx").exists()


def test_workers_above_the_number_of_arms_run_the_two_arms_side_by_side(tmp_path, capsys,
                                                                         monkeypatch):
    """--workers 5 for the demo's 2 arms: 2 side by side, each with half of the
    cores (4 here), not a fifth; --workers 1: one at a time with all of them."""
    root = tmp_path / "demo"
    _earlier_demo(root)
    _fake_arms(monkeypatch, {"vanilla": 1, "kv_shift": 1})
    monkeypatch.setattr(demo.os, "cpu_count", lambda: 4)
    for workers, threads in (("5", 2), ("1", 4)):
        assert main(["demo", "--run-dir", str(root), "--synthetic", "--fresh",
                     "--workers", workers]) == 1
        out, err = capsys.readouterr()
        assert out.count(f"] threads {threads}\n") == 2, out
        assert err.startswith("kvtrain demo: both arms failed (vanilla exit 1, kv_shift exit "
                              "1); their output is above"), err


def test_a_run_folder_that_cannot_be_made_is_one_line(capsys):
    """A --run-dir the system will not make (here /proc's): one line before the
    data is built, not mkdir's traceback."""
    assert main(["demo", "--run-dir", "/proc/kvtrain-demo", "--synthetic"]) == 2
    assert capsys.readouterr().err == ("kvtrain: config error: --run-dir /proc/kvtrain-demo "
                                       "cannot be made: No such file or directory\n")
