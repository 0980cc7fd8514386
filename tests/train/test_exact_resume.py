"""Exact resume, and resume into another layout (2 ranks, torchrun).

For DP=2, TP=2 and PP=2, vanilla and KV shift: train 2N steps in one go;
separately train N steps, SIGKILL the process right after the checkpoint at N
(a fault the test injects), resume to 2N. The losses and gradient norms of steps N+1..2N in
metrics.jsonl must be bit-identical (CPU, fp32).

All runs share one torchrun launch to keep the test fast: the test driver
(tests/train/driver.py) forks a child process per run on every rank, so each
first half is a real process killed by SIGKILL right after its checkpoint,
and its resume is a fresh process. Two more layouts, the plain
(non-distributed) optimizer at DP=2 and the interleaved pipeline (PP=2 x 2
virtual stages, also with overlapped gradient reduce / parameter gather), stop
gracefully at N and resume; TP=2 with sequence
parallelism, and DP=2 with overlapped gradient reduce / parameter gather, must
match the plain layouts, and PP=2 with tied embeddings DP=2 with them.

Then checkpoints saved at TP=2, DP=2 (distributed optimizer state), PP=2 and PP=2
with tied embeddings are resumed by one process (TP=PP=DP=1): the next losses must match the
uninterrupted 2-rank runs to 1e-5.
"""

from __future__ import annotations

import json

import pytest

from .conftest import by_iteration, latest, metrics, run_driver, tiny_config, write_config

pytestmark = pytest.mark.slow

N = 3
LAYOUTS = {
    "dp2": [],
    "tp2": ["parallel.tensor=2"],
    "pp2": ["parallel.pipeline=2"],
    "dp2-ddp": ["parallel.distributed_optimizer=false"],
    "pp2-vpp2": ["parallel.pipeline=2", "parallel.virtual_pipeline=2", "model.num_layers=4"],
    "tp2-sp": ["parallel.tensor=2", "parallel.sequence_parallel=true"],
    "dp2-overlap": ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"],
    "dp2-bf16": ["train.precision=bf16"],  # bf16 weights, fp32 main params and moments
    "pp2-vpp2-overlap": ["parallel.pipeline=2", "parallel.virtual_pipeline=2",
                         "model.num_layers=4", "parallel.overlap_grad_reduce=true",
                         "parallel.overlap_param_gather=true"],
    # tied embeddings: under PP the last stage holds a copy of the first's embedding,
    # kept equal by megatron's all-reduce of their gradients
    "dp2-tied": ["model.untie_embeddings=false"],
    "pp2-tied": ["parallel.pipeline=2", "model.untie_embeddings=false"],
}
# KV shift in every layout (its scalars are the extra state); vanilla once, at DP=2.
# The overlapped layouts (deferred param all-gather) save on a kill's interval and on a stop.
KILLED = [("dp2", "vanilla"), ("dp2", "kv_shift"), ("tp2", "kv_shift"), ("pp2", "kv_shift"),
          ("dp2-overlap", "kv_shift")]
STOPPED = [("dp2-ddp", "kv_shift"), ("pp2-vpp2", "kv_shift"), ("dp2-bf16", "kv_shift"),
           ("pp2-vpp2-overlap", "kv_shift")]
LAYOUT_SOURCES = [("tp2", "kv_shift"), ("dp2", "vanilla"), ("pp2", "kv_shift"),
                  ("pp2-tied", "kv_shift")]
MATCHED = [("tp2-sp", "tp2"), ("dp2-overlap", "dp2"), ("pp2-tied", "dp2-tied")]


def case_id(case) -> str:
    return f"{case[0]}-{case[1]}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, cache_dir):
    """All runs, in one 2-rank launch; every run is a child process of the driver."""
    root = tmp_path_factory.mktemp("exact_resume")
    config = write_config(root / "base.yaml", tiny_config(
        corpus, cache_dir, train={"max_steps": 2 * N, "dist_timeout_minutes": 2},
        checkpoint={"save_interval": N, "keep_last": None}))

    def job(case, kind, **extra):
        layout, attention = case
        return {"config": str(config), "run_dir": str(root / case_id(case) / kind),
                "overrides": LAYOUTS[layout] + [f"model.attention={attention}"], **extra}

    # References save nothing (so a save with side effects on training would show),
    # except at N for the sources of the layout-change test.
    no_saves = ["checkpoint.save_interval=null", "checkpoint.save_on_exit=false"]
    jobs = [job(c, "reference") if c in LAYOUT_SOURCES else
            dict(job(c, "reference"), overrides=job(c, "reference")["overrides"] + no_saves)
            for c in KILLED + STOPPED + [(v, "kv_shift") for m in MATCHED for v in m
                                         if (v, "kv_shift") not in KILLED + STOPPED]]
    for case in KILLED:  # first half dies by SIGKILL right after its checkpoint at N
        jobs += [job(case, "interrupted", faults={"kill_after_save": N}, expect=-9),
                 job(case, "interrupted")]
    for case in STOPPED:  # first half stops at N as if signalled
        jobs += [job(case, "interrupted", faults={"stop_after": N}), job(case, "interrupted")]
    result = run_driver(jobs, root / "plan.json", nproc=2, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root, result


def assert_same_continuation(root, case):
    reference = by_iteration(metrics(root / case_id(case) / "reference"))
    resumed = by_iteration(metrics(root / case_id(case) / "interrupted"))
    assert sorted(reference) == sorted(resumed) == list(range(1, 2 * N + 1))
    for it in range(N + 1, 2 * N + 1):
        assert resumed[it]["lm_loss"] == reference[it]["lm_loss"], it
        assert resumed[it]["grad_norm"] == reference[it]["grad_norm"], it
        assert resumed[it]["consumed_samples"] == reference[it]["consumed_samples"] == it * 8
    assert latest(root / case_id(case) / "interrupted") == f"iter_{2 * N:07d}"


@pytest.mark.parametrize("case", KILLED, ids=case_id)
def test_resume_after_sigkill_is_bit_identical(runs, case):
    root, result = runs
    interrupted = str(root / case_id(case) / "interrupted")
    assert sorted(result.job_codes[interrupted]) == [-9, -9, 0, 0], \
        f"first halves must die by SIGKILL, resumes exit 0: see {root}/plan.log"
    ckpt = root / case_id(case) / "interrupted" / "checkpoints" / f"iter_{N:07d}"
    assert f"resumed from {ckpt} at iteration {N}" in result.stdout, f"see {root}/plan.log"
    assert_same_continuation(root, case)


@pytest.mark.parametrize("case", STOPPED, ids=case_id)
def test_resume_is_bit_identical_other_layouts(runs, case):
    root, result = runs
    ckpt = root / case_id(case) / "interrupted" / "checkpoints" / f"iter_{N:07d}"
    assert f"resumed from {ckpt} at iteration {N}" in result.stdout
    assert_same_continuation(root, case)


@pytest.mark.parametrize("variant,base", MATCHED)
def test_sequence_parallel_overlap_and_tied_pipeline_match(runs, variant, base):
    """Sequence parallelism (norms on sequence shards), overlapped DP communication
    and a pipeline of tied embeddings (the last stage's copy of the embedding)
    change where and when things run, not the numbers (1e-6)."""
    root, _ = runs
    a = by_iteration(metrics(root / f"{variant}-kv_shift" / "reference"))
    b = by_iteration(metrics(root / f"{base}-kv_shift" / "reference"))
    assert sorted(a) == sorted(b) == list(range(1, 2 * N + 1))
    for it in a:
        assert a[it]["lm_loss"] == pytest.approx(b[it]["lm_loss"], rel=1e-6, abs=1e-6)


def test_layouts_change_on_resume(runs, tmp_path):
    """TP=2 / DP=2 / PP=2 checkpoints continue at TP=PP=DP=1 like the 2-rank runs (1e-5)."""
    root, _ = runs
    config = str(root / "base.yaml")
    sources = LAYOUT_SOURCES
    jobs = [{"config": config, "run_dir": str(tmp_path / case_id(c)),
             "overrides": [f"model.attention={c[1]}",  # the model as saved, one process
                           *(o for o in LAYOUTS[c[0]] if o.startswith("model.")),
                           f"checkpoint.resume={root / case_id(c) / 'reference'}"
                           f"/checkpoints/iter_{N:07d}"]}
            for c in sources]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "RNG states not restored: layout changed" in result.stdout
    for case in sources:
        reference = by_iteration(metrics(root / case_id(case) / "reference"))
        resumed = by_iteration(metrics(tmp_path / case_id(case)))
        assert sorted(resumed) == list(range(N + 1, 2 * N + 1)), case
        for it in resumed:
            assert resumed[it]["lm_loss"] == pytest.approx(reference[it]["lm_loss"], rel=1e-5,
                                                           abs=1e-5), (case, it)
            assert resumed[it]["grad_norm"] == pytest.approx(reference[it]["grad_norm"],
                                                             rel=1e-5, abs=1e-5), (case, it)


def test_checkpoint_contents(runs):
    """The checkpoint names its layout and iteration; the distributed optimizer's
    state is in the fully_reshardable format (the only one that changes TP)."""
    import torch

    root, _ = runs
    ckpt = root / "tp2-kv_shift" / "reference" / "checkpoints" / f"iter_{N:07d}"
    marker = json.loads((ckpt / "kvtrain_checkpoint.json").read_text())
    assert marker["iteration"] == N
    assert marker["layout"] == {"tensor": 2, "pipeline": 1, "context": 1, "data": 1, "world": 2}
    common = torch.load(ckpt / "common.pt", weights_only=False)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert common["kvtrain"]["state"]["consumed_samples"] == N * 8
    assert common["kvtrain"]["config"]["model"]["attention"] == "kv_shift"


def test_resume_with_dropout_is_bit_exact(tmp_path, cache_dir):
    """With dropout the global RNG state matters: the checkpoint restores it, and
    the resumed run's data iterator (made after the restore, where the
    uninterrupted run made it before step 1) must not draw from it."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, model={"hidden_dropout": 0.1, "attention_dropout": 0.1},
        train={"max_steps": 2 * N}, checkpoint={"save_interval": N, "keep_last": None}))
    jobs = [{"config": str(config), "run_dir": str(tmp_path / "ref"),
             "overrides": ["checkpoint.save_interval=null", "checkpoint.save_on_exit=false"]},
            {"config": str(config), "run_dir": str(tmp_path / "cut"),
             "faults": {"kill_after_save": N}, "expect": -9},
            {"config": str(config), "run_dir": str(tmp_path / "cut")}]
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ref, cut = by_iteration(metrics(tmp_path / "ref")), by_iteration(metrics(tmp_path / "cut"))
    assert sorted(ref) == sorted(cut) == list(range(1, 2 * N + 1))
    for it in ref:
        assert cut[it]["lm_loss"] == ref[it]["lm_loss"], it
        assert cut[it]["grad_norm"] == ref[it]["grad_norm"], it


def test_data_iterators_draw_nothing_from_the_global_rng():
    """Training and validation iterators (validation makes new ones at every
    evaluation) leave torch's global RNG where it was: dropout masks do not
    depend on when, or how often, iterators are made."""
    import torch

    from kvtrain.data import fixed_batches, micro_batches

    data = [{"tokens": torch.tensor([i])} for i in range(16)]
    torch.manual_seed(7)
    before = torch.get_rng_state()
    next(micro_batches(data, 4, 2, 0, 1))
    next(fixed_batches(data, 8, 2, 0, 1))
    assert torch.equal(torch.get_rng_state(), before)
