"""Item 12: the train record of a window holding a skipped step tells the truth.

A step can be skipped with a finite loss (a non-finite gradient norm, an fp16
overflow) or with a non-finite loss. The record's ``lm_loss`` is the mean over
the window's steps whose loss was finite (skipped or not), its ``grad_norm``
is the last step's own (``"nan"``/``"inf"`` when non-finite), and
``skipped_in_window`` counts the window's skipped steps.
"""

from __future__ import annotations

import math

import pytest

from kvtrain.records import unrecorded
from tests.train.conftest import by_iteration, metrics, run_driver, tiny_config, write_config


def test_skipped_steps_records(tmp_path, corpus, cache_dir):
    cfg = tiny_config(corpus, cache_dir, train={"max_steps": 6, "log_interval": 1},
                      checkpoint={"save_interval": None, "save_on_exit": False})
    config = write_config(tmp_path / "c.yaml", cfg)
    run_dir = tmp_path / "run"
    jobs = [{"config": str(config), "run_dir": str(run_dir),
             "faults": {"nonfinite_steps": [3], "nonfinite_grad_steps": [5]}}]
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    train = by_iteration(metrics(run_dir))
    # step 3: NaN loss, hence NaN gradients; its own grad norm, not step 2's
    assert train[3]["lm_loss"] == "nan"
    assert train[3]["grad_norm"] in ("nan", "inf") and train[3]["skipped_in_window"] == 1
    # step 5: a finite loss whose gradients are non-finite: the loss is reported
    assert math.isfinite(train[5]["lm_loss"]), train[5]
    assert train[5]["grad_norm"] in ("nan", "inf") and train[5]["skipped_in_window"] == 1
    for it in (1, 2, 4, 6):
        assert math.isfinite(train[it]["grad_norm"]) and train[it]["skipped_in_window"] == 0
    assert train[6]["skipped_steps"] == 2


def test_a_run_ending_between_intervals_logs_validates_and_measures_its_last_steps(
        tmp_path, corpus, cache_dir):
    """``train.max_steps`` need not be a multiple of the intervals: the steps after the
    last full logging window get a record of their own, and the final weights are
    validated and their α/β statistics taken, as at every interval."""
    cfg = tiny_config(corpus, cache_dir,
                      train={"max_steps": 5, "log_interval": 2, "eval_interval": 3,
                             "eval_iters": 1, "kv_shift_stats_interval": 3},
                      checkpoint={"save_interval": None, "save_on_exit": False})
    config = write_config(tmp_path / "c.yaml", cfg)
    run_dir = tmp_path / "run"
    result = run_driver([{"config": str(config), "run_dir": str(run_dir)}], tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    train = by_iteration(metrics(run_dir))
    assert sorted(train) == [2, 4, 5]
    assert [train[i]["steps_in_window"] for i in (2, 4, 5)] == [2, 2, 1]
    assert [r["iteration"] for r in metrics(run_dir, "valid")] == [3, 5]
    assert [r["iteration"] for r in metrics(run_dir, "kv_shift")] == [3, 5]


def test_a_stopped_run_logs_its_last_partial_window_and_ends_a_finished_run(
        tmp_path, corpus, cache_dir):
    """A stop (a signal here; the time limit and the non-finite limit leave the loop
    the same way) writes the record of the steps since the last log line; a stop on
    the run's last step also validates and measures the final weights, which the
    resume that follows cannot (it has nothing to do). A run killed after a checkpoint
    taken inside a window (step 3 of the window 3-4) logs, once resumed, the record of
    the whole window, the steps before the checkpoint included: the same as the run
    that was not interrupted, no step missing from metrics.jsonl; a stop on a save's
    step (9) logs its partial window once, not again after the resume. A stop saves
    before anything else: the validation and α/β statistics due at its step (9) are
    not taken (they ate into the time the signal leaves for the save), except on the
    run's last step (6 in "last"), which no resume takes again."""
    def job(name, max_steps, save_interval=None, **extra):
        cfg = tiny_config(corpus, cache_dir,
                          train={"max_steps": max_steps, "log_interval": 2, "eval_interval": 3,
                                 "eval_iters": 1, "kv_shift_stats_interval": 3},
                          checkpoint={"save_interval": save_interval})
        return {"config": str(write_config(tmp_path / f"{name}.yaml", cfg)),
                "run_dir": str(tmp_path / name), **extra}

    jobs = [job("mid", 20, faults={"stop_after": 7}),  # stopped between two windows
            job("last", 6, faults={"stop_after": 6}),  # stopped on its last step
            job("last", 6),  # ... and resumed: nothing to do
            job("killed", 20, 3, faults={"kill_after_save": 3}, expect=-9),
            job("killed", 20, 3, faults={"stop_after": 9}),  # resumed at 3, stopped at 9
            job("killed", 20, 3, faults={"stop_after": 10})]  # resumed at 9, stopped at 10
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    mid, last = by_iteration(metrics(tmp_path / "mid")), by_iteration(metrics(tmp_path / "last"))
    assert (sorted(mid), mid[7]["steps_in_window"]) == ([2, 4, 6, 7], 1)
    assert [r["iteration"] for r in metrics(tmp_path / "mid", "valid")] == [3, 6]
    assert sorted(last) == [2, 4, 6]
    for kind in ("valid", "kv_shift"):
        assert [r["iteration"] for r in metrics(tmp_path / "last", kind)] == [3, 6], kind
        assert [r["iteration"] for r in metrics(tmp_path / "killed", kind)] == [3, 6], kind
    killed = by_iteration(metrics(tmp_path / "killed"))
    assert sorted(killed) == [2, 4, 6, 8, 9, 10], killed
    assert [killed[i]["steps_in_window"] for i in (4, 9, 10)] == [2, 1, 1]
    assert killed[4]["lm_loss"] == mid[4]["lm_loss"]  # steps 3 and 4, bit-identical
    for name in ("mid", "last", "killed"):  # no resume here passed over a step unrecorded
        records = metrics(tmp_path / name, kind=None)
        assert unrecorded(records, named_too=True) == [], name
        assert not [r for r in records if "missing_iterations" in r], name


@pytest.mark.parametrize("distributed", [True, False])
def test_a_save_before_the_first_update_resumes_as_the_uninterrupted_run(
        tmp_path, corpus, cache_dir, distributed):
    """Every step up to a save skipped (NaN losses here; fp16's dynamic loss scale,
    backing off from megatron's 2**32, skips tens of first steps the same way): the
    optimizer has no state yet. megatron's distributed optimizer refused to save it
    (``assert len(steps) == 1`` in its ``state_dict``: seen on an H200 in fp16, the run
    dead at its first save); the save holds the state AdamW's first update starts
    from, and the resumed run is the uninterrupted one, bit for bit."""
    cfg = tiny_config(corpus, cache_dir, train={"max_steps": 4, "log_interval": 1},
                      checkpoint={"save_interval": 2, "save_on_exit": False},
                      parallel={"distributed_optimizer": distributed})
    config = str(write_config(tmp_path / "c.yaml", cfg))
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    faults = {"nonfinite_steps": [1, 2]}
    jobs = [{"config": config, "run_dir": whole, "faults": faults},
            {"config": config, "run_dir": cut, "faults": faults,
             "overrides": ["train.max_steps=2"]},
            {"config": config, "run_dir": cut}]
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    a, b = by_iteration(metrics(whole)), by_iteration(metrics(cut))
    assert a[2]["skipped_steps"] == 2 and a[4]["skipped_steps"] == 2, a
    for it in (3, 4):
        assert b[it]["lm_loss"] == a[it]["lm_loss"] and b[it]["grad_norm"] == a[it]["grad_norm"]
