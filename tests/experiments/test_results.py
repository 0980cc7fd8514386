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
from kvtrain.experiments.results import ArmResult, curve_from_metrics, summarize, training_time


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


def test_training_time_counts_each_attempt_from_its_start():
    """Records at 5 and 7 before any known start (an attempt the runner did
    not record: from its first record), an attempt at 10 with records at 12 and
    15, one at 20 that wrote none (its records dropped), one at 30 with a record
    at 31; a record without a time is NaN."""
    times = [5.0, 7.0, 12.0, 15.0, math.nan, 31.0]
    out = training_time(times, [30.0, 10.0, 20.0])
    assert out[:4] + out[5:] == [0.0, 2.0, 4.0, 7.0, 8.0] and math.isnan(out[4])
    assert training_time([12.0, 15.0]) == [0.0, 3.0]


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


def fake_trainer(monkeypatch, code: int, text: str, records: list[dict] = ()) -> None:
    """Arms "trained" by a python that prints ``text``, appends ``records`` to
    the run's metrics.jsonl (stamped with the time it writes them) and exits ``code``."""
    def command(cfg_path, run_dir, nproc=1):
        script = (f"import json, pathlib, time; print({text!r}); "
                  f"run = pathlib.Path({str(run_dir)!r}); run.mkdir(exist_ok=True); "
                  f"f = open(run / 'metrics.jsonl', 'a'); "
                  f"[f.write(json.dumps({{**r, 'time': time.time()}}) + '\\n') "
                  f"for r in {list(records)!r}]; f.close(); raise SystemExit({code})")
        return [sys.executable, "-c", script]
    monkeypatch.setattr(runner, "arm_command", command)


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


def test_a_resumed_arm_counts_the_time_of_its_earlier_attempts(tmp_path, monkeypatch):
    """An arm whose first attempt (started at t=100, 1000 s, steps 2 and 4
    evaluated at 102 and 104) failed, trained again: the resumed attempt
    continues its metrics.jsonl. The first attempt's rows keep their elapsed_s
    (not counted from the second attempt's start: negative), the second
    attempt's rows count on from 4 s, and the arm's wall time is both attempts'."""
    job = an_arm(tmp_path)
    (job.run_dir).mkdir(parents=True)
    write_metrics(job.run_dir / "metrics.jsonl", [valid(2, 102.0), valid(4, 104.0)])
    (job.folder / "result.json").write_text(json.dumps({"exit_code": 1, "wall_s": 1000.0,
                                                        "started": 100.0}))
    fake_trainer(monkeypatch, 0, "resumed", [valid(6, 0.0), valid(8, 0.0)])
    result = runner.run_arms([job])[0]
    elapsed = [r["elapsed_s"] for r in result.rows]
    assert [r["step"] for r in result.rows] == [2, 4, 6, 8]
    assert elapsed[:2] == [2.0, 4.0] and 4.0 <= elapsed[2] <= elapsed[3], elapsed
    assert result.wall_s >= 1000.0
    saved = json.loads((job.folder / "result.json").read_text())
    assert saved["exit_code"] == 0 and saved["wall_s"] == round(result.wall_s, 1)
    again = runner.arm_jobs([(job.arm, job.cfg)], tmp_path, [])[0].earlier  # read back
    assert [r["elapsed_s"] for r in again.rows] == elapsed and again.wall_s == saved["wall_s"]


def test_a_damaged_result_json_is_one_line(tmp_path):
    """An arm's result.json that is not a JSON object (a bad edit, a damaged disk):
    one line naming the file, not a traceback from the runner."""
    import pytest

    from kvtrain.config import ConfigError

    for text in ("{not json", "[1, 2]"):
        (tmp_path / runner.RESULT).write_text(text)
        with pytest.raises(ConfigError) as e:
            runner._record(tmp_path)
        assert str(tmp_path / runner.RESULT) in str(e.value) and "\n" not in str(e.value)
