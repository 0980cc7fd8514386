"""``checkpoint.load_optimizer: false`` (and ``load_rng: false``) start a fresh optimizer
(and LR schedule) from a checkpoint once: the run's own checkpoints, written under that
setting, carry the fresh optimizer on, so a crash of a run started from weights only is
resumed as exactly as any other. Before, every restart loaded weights only again: the
optimizer state and the schedule's progress were lost at each pre-emption."""

from __future__ import annotations

import pytest

from .conftest import by_iteration, metrics, run_driver, tiny_config, write_config

KEYS = ("lm_loss", "grad_norm", "lr")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    root = tmp_path_factory.mktemp("weights_only")
    base = dict(train={"max_steps": 2}, optimizer={"lr": 3.0e-3, "lr_warmup_steps": 3},
                checkpoint={"save_interval": 2})
    source = write_config(root / "source.yaml", tiny_config(None, cache_dir, **base))
    start = root / "source" / "checkpoints" / "iter_0000002"
    fresh = write_config(root / "fresh.yaml", tiny_config(None, cache_dir, **{
        **base, "train": {"max_steps": 6},
        "checkpoint": {"save_interval": 2, "resume": str(start), "load_optimizer": False,
                       "load_rng": False}}))
    jobs = [
        {"config": str(source), "run_dir": str(root / "source")},
        {"config": str(fresh), "run_dir": str(root / "straight")},
        {"config": str(fresh), "run_dir": str(root / "killed"), "faults": {"kill_after_save": 4},
         "expect": -9},
        {"config": str(fresh), "run_dir": str(root / "killed")},  # the same command again
        # the user's own run, its optimizer reset on purpose at its checkpoint of 2
        {"config": str(source), "run_dir": str(root / "reset")},
        {"config": str(source), "run_dir": str(root / "reset"),
         "overrides": ["train.max_steps=4", "checkpoint.load_optimizer=false"]},
    ]
    result = run_driver(jobs, root / "plan.json", timeout=400)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result.stdout


def test_a_run_started_from_weights_only_resumes_exactly_after_a_crash(runs):
    root, out = runs
    straight, killed = by_iteration(metrics(root / "straight")), by_iteration(metrics(root / "killed"))
    assert sorted(straight) == sorted(killed) == [3, 4, 5, 6]
    saved = root / "killed" / "checkpoints" / "iter_0000004"
    assert f"resumed from {saved} at iteration 4" in out
    assert (f"kvtrain: iter_0000004 was written under checkpoint.load_optimizer and load_rng: "
            f"false, so what that started afresh goes on from it (a new fresh start: "
            f"checkpoint.resume: {saved})") in out
    for it in (3, 4, 5, 6):
        assert [killed[it][k] for k in KEYS] == [straight[it][k] for k in KEYS], it
    # the schedule of the fresh optimizer goes on across the restart: warm-up 1, 2, 3 of 3
    assert [straight[it]["lr"] for it in (3, 4, 5, 6)] == pytest.approx(
        [1e-3, 2e-3, 3e-3, 3e-3])


def test_load_optimizer_false_still_resets_a_checkpoint_written_without_it(runs):
    """resume auto with load_optimizer false on the run's own checkpoint written with
    it true: the optimizer and schedule start over there (the user's choice), as the
    same setting does from a checkpoint path."""
    root, out = runs
    reset, straight = by_iteration(metrics(root / "reset")), by_iteration(metrics(root / "straight"))
    assert [reset[it]["lr"] for it in (3, 4)] == [straight[it]["lr"] for it in (3, 4)]
    assert [reset[it]["lm_loss"] for it in (3, 4)] == [straight[it]["lm_loss"] for it in (3, 4)]


def test_what_a_checkpoint_carries_on():
    """``carried_on``: only a checkpoint of the run's own history written under the
    setting; never the optimizer of a weights-only checkpoint (kvtrain import hf), nor
    where a change of train.precision makes the optimizer start afresh."""
    from pathlib import Path

    from kvtrain.train.integrity import carried_on

    path = Path("/runs/r/checkpoints/iter_0000004")
    fresh = {"config": {"checkpoint": {"load_optimizer": False, "load_rng": False}}}
    assert carried_on(path, fresh, False, False, False) == (False, False, None)  # resume: PATH
    assert carried_on(path, fresh, True, True, True) == (True, True, None)
    optimizer, rng, note = carried_on(path, fresh, True, False, False)
    assert (optimizer, rng) == (True, True) and note.startswith(
        "iter_0000004 was written under checkpoint.load_optimizer and load_rng: false")
    assert carried_on(path, fresh, True, False, False, optimizer_too=False)[:2] == (False, True)
    assert carried_on(path, {**fresh, "weights_only": True}, True, False, True)[:2] == (False, True)
    before = {"config": {"checkpoint": {"load_optimizer": True, "load_rng": True}}}
    assert carried_on(path, before, True, False, False) == (False, False, None)
    assert carried_on(path, {}, True, False, False) == (False, False, None)  # no record
