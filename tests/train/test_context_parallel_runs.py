"""Context parallelism through the trainer (2 ranks, one launch; CP x PP on 4 ranks).

A KV-shift model with packed documents trains 4 steps at CP=2 (DP=1) and at
CP=1 (DP=2): the same global batches, so the same losses, validation losses
and gradient norms up to fp32 reduction order. Each saves at step 2; the CP=2
checkpoint resumes at CP=1 and the CP=1 checkpoint at CP=2, continuing like
the uninterrupted runs. Induction data validates at CP=1 and CP=2 with the same
accuracies (the masks are split per CP rank and their counts add up).
"""

from __future__ import annotations

import pytest

from .conftest import by_iteration, metrics, run_driver, tiny_config, write_config

pytestmark = pytest.mark.slow

N = 2
TOL = dict(rel=1e-5, abs=1e-5)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, cache_dir):
    root = tmp_path_factory.mktemp("context_parallel")
    base = tiny_config(corpus, cache_dir,
                       model={"backend": "torch", "kv_shift": {"window": 2}},
                       train={"max_steps": 2 * N, "eval_interval": N, "eval_iters": 1,
                              "dist_timeout_minutes": 2},
                       checkpoint={"save_interval": N, "keep_last": None})
    base["data"].update(reset_attention_mask=True, split="80,20,0")
    config = write_config(root / "base.yaml", base)
    induction = tiny_config(None, cache_dir, train={"max_steps": 2, "eval_interval": 2,
                                                    "eval_iters": 1},
                            checkpoint={"save_interval": None, "save_on_exit": False})
    induction["data"] = {"type": "induction", "num_workers": 0, "cache_dir": str(cache_dir),
                         "induction": {"max_val": 300}}
    induction_config = write_config(root / "induction.yaml", induction)

    def job(name, *overrides, cfg=config):
        return {"config": str(cfg), "run_dir": str(root / name), "overrides": list(overrides)}

    def resume(source):
        return f"checkpoint.resume={root / source}/checkpoints/iter_{N:07d}"

    jobs = [job("cp1"), job("cp2", "parallel.context=2"),
            job("cp2-to-cp1", resume("cp2")),
            job("cp1-to-cp2", "parallel.context=2", resume("cp1")),
            job("induction-cp1", cfg=induction_config),
            job("induction-cp2", "parallel.context=2", cfg=induction_config)]
    result = run_driver(jobs, root / "plan.json", nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # context and pipeline parallelism together (4 ranks: CP 2 x PP 2)
    four = run_driver([job("cp2-pp2", "parallel.context=2", "parallel.pipeline=2",
                           "checkpoint.save_interval=null")],
                      root / "plan4.json", nproc=4, timeout=600)
    assert four.returncode == 0, four.stdout[-4000:] + four.stderr[-4000:]
    return root, result


def assert_close_runs(a: dict, b: dict, iterations) -> None:
    for it in iterations:
        assert a[it]["lm_loss"] == pytest.approx(b[it]["lm_loss"], **TOL), it
        assert a[it]["grad_norm"] == pytest.approx(b[it]["grad_norm"], **TOL), it


def test_cp2_trains_like_cp1(runs):
    root, _ = runs
    cp1, cp2 = (by_iteration(metrics(root / name)) for name in ("cp1", "cp2"))
    assert sorted(cp1) == sorted(cp2) == list(range(1, 2 * N + 1))
    assert_close_runs(cp2, cp1, range(1, 2 * N + 1))
    assert cp2[2 * N]["lm_loss"] < cp2[1]["lm_loss"]  # it learns
    valid = [by_iteration(metrics(root / name, kind="valid")) for name in ("cp1", "cp2")]
    assert sorted(valid[0]) == sorted(valid[1]) == [N, 2 * N]
    for it in (N, 2 * N):
        assert valid[1][it]["val_loss"] == pytest.approx(valid[0][it]["val_loss"], **TOL)
        assert valid[1][it]["val_tokens"] == valid[0][it]["val_tokens"]


def test_cp2_with_pp2_trains_like_cp1(runs):
    root, _ = runs
    cp1, cp2_pp2 = (by_iteration(metrics(root / name)) for name in ("cp1", "cp2-pp2"))
    assert sorted(cp2_pp2) == list(range(1, 2 * N + 1))
    assert_close_runs(cp2_pp2, cp1, range(1, 2 * N + 1))
    valid = [by_iteration(metrics(root / name, kind="valid")) for name in ("cp1", "cp2-pp2")]
    for it in (N, 2 * N):
        assert valid[1][it]["val_loss"] == pytest.approx(valid[0][it]["val_loss"], **TOL)


@pytest.mark.parametrize("source, resumed", [("cp2", "cp2-to-cp1"), ("cp1", "cp1-to-cp2")])
def test_checkpoint_changes_context_parallel_size(runs, source, resumed):
    root, result = runs
    ckpt = root / source / "checkpoints" / f"iter_{N:07d}"
    assert f"resumed from {ckpt} at iteration {N}" in result.stdout
    assert "RNG states not restored: layout changed" in result.stdout
    after = by_iteration(metrics(root / resumed))
    assert sorted(after) == list(range(N + 1, 2 * N + 1))
    assert_close_runs(after, by_iteration(metrics(root / source)), after)


def test_induction_accuracy_under_cp(runs):
    root, _ = runs
    cp1, cp2 = (by_iteration(metrics(root / name, kind="valid"))
                for name in ("induction-cp1", "induction-cp2"))
    assert sorted(cp1) == sorted(cp2) == [2]
    keys = [k for k in cp1[2] if k.startswith("val_acc_")]
    assert keys
    for key in keys + ["val_loss"]:
        assert cp2[2][key] == pytest.approx(cp1[2][key], **TOL), key
