"""Run-time paths an audit of the config's choices found neither tested nor refused:
a degenerate layout value that trained into a traceback, and dropout in the regions
megatron draws per tensor-parallel rank (its RNG tracker, on the CPU backend's
generator), which no multi-rank run had exercised: TP, TP with sequence
parallelism and CP, under recompute and across a resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtrain.config import ConfigError, load_config

from .conftest import by_iteration, metrics, run, run_driver, tiny_config, write_config
from .test_step_semantics import _losses_and_norms, _run

ONE_VIRTUAL_STAGE = ["model.num_layers=2", "parallel.pipeline=2", "parallel.virtual_pipeline=1"]


def test_one_virtual_stage_is_refused_in_one_line():
    """``parallel.virtual_pipeline: 1`` (one model chunk per rank: no interleaving)
    passed every check and `kvtrain plan`, then chose megatron's interleaved schedule
    with a single chunk, which the trainer hands over bare: the first step died on
    every rank in `TypeError: 'DistributedDataParallel' object is not subscriptable`."""
    with pytest.raises(ConfigError) as e:
        load_config(None, ONE_VIRTUAL_STAGE)
    assert str(e.value) == (
        "parallel.virtual_pipeline 1 is one model chunk per pipeline rank, no interleaving: "
        "set it to null (or to 2 or more for the interleaved schedule)")


@pytest.mark.slow
def test_one_virtual_stage_stops_the_trainer_in_one_line(tmp_path, cache_dir):
    config = write_config(tmp_path / "c.yaml", tiny_config(None, cache_dir))
    args = ["train", str(config), "--run-dir", str(tmp_path / "run")]
    for override in ONE_VIRTUAL_STAGE:
        args += ["--set", override]
    done = run(args, nproc=2, timeout=300)
    out = done.stdout + done.stderr
    # bare torchrun ends with its own ChildFailedError traceback (docs/reliability.md);
    # no rank's traceback: the ranks stopped at the check, before any step
    assert done.returncode != 0 and "[rank" not in out and "TypeError" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("kvtrain: ")]
    assert lines == ["kvtrain: config error: parallel.virtual_pipeline 1 is one model chunk "
                     "per pipeline rank, no interleaving: set it to null (or to 2 or more "
                     "for the interleaved schedule)"], out[-3000:]


# dropout on both kinds of region: megatron's tracker stream (attention dropout outside
# SP, the residual dropout under SP) and the default stream (the residual dropout
# outside SP, which every TP rank of a replica must draw alike)
DROPOUT = {"hidden_dropout": 0.1, "attention_dropout": 0.1}
DROPOUT_LAYOUTS = {
    "tp2": {"tensor": 2},
    "tp2-sp": {"tensor": 2, "sequence_parallel": True},
    "cp2-documents": {"context": 2},
}


def _dropout_config(cache_dir, layout: str, recompute: str, dropout: dict) -> dict:
    data = {"num_workers": 0, "reset_attention_mask": layout.endswith("documents")}
    return tiny_config(None, cache_dir, model=dropout, data=data,
                       parallel={**DROPOUT_LAYOUTS[layout], "recompute": recompute})


def _replicas(run) -> dict:
    """The bytes of every parameter this rank holds whole, as a replica of the other
    ranks' (all of them under CP; the TP-replicated ones under TP)."""
    out = {}
    for name, p in run.model[0].module.named_parameters():
        if not getattr(p, "tensor_model_parallel", False):
            out[name] = p.detach().cpu().numpy().tobytes()
    return out


def _dropout_worker(rank: int, world: int, cfgs: dict, run_dir: str) -> dict:
    out = {}
    for key, cfg in cfgs.items():
        run = _run(cfg, Path(run_dir) / key)
        out[key] = (*_losses_and_norms(run, 3), _replicas(run))
    return out


@pytest.mark.slow
def test_dropout_under_tensor_and_context_parallelism(tmp_path, cache_dir):
    """Three steps with dropout (0.1 on residuals and attention) at TP 2, TP 2 with SP,
    and CP 2 with packed documents: recompute full gives the losses and gradient norms
    of no recompute exactly (the backward draws the forward's masks again, on the CPU
    backend's generator), every rank reports the same, the parameters each rank holds
    as a replica stay bit-identical (a rank drawing other residual masks than its TP
    peer would drift its norms away from theirs, silently), and dropout is on."""
    from kvtrain.testing import run_distributed

    cfgs = {}
    for layout in DROPOUT_LAYOUTS:
        for recompute in ("none", "full"):
            cfgs[f"{layout}/{recompute}"] = _dropout_config(cache_dir, layout, recompute, DROPOUT)
        cfgs[f"{layout}/off"] = _dropout_config(cache_dir, layout, "none", {})
    ranks = run_distributed(_dropout_worker, 2, cfgs, str(tmp_path))
    for layout in DROPOUT_LAYOUTS:
        none, full, off = (f"{layout}/{kind}" for kind in ("none", "full", "off"))
        for got in ranks:
            assert got[full][:2] == got[none][:2] == ranks[0][none][:2], layout
            assert got[none][0] != got[off][0], layout  # dropout changed the losses
        for key in (none, full):
            first, second = (r[key][2] for r in ranks)
            assert first and first.keys() == second.keys(), key
            assert [n for n in first if first[n] != second[n]] == [], key


@pytest.mark.slow
def test_a_resume_with_dropout_under_tp_and_cp_is_bit_exact(tmp_path, cache_dir):
    """The resume of a run with dropout restores megatron's tracker states too (they
    draw the dropout of TP regions and of CP's attention): at TP 2 and at CP 2 with
    documents, a run killed after its checkpoint of step 3 continues with the losses
    and gradient norms of the run never stopped. Only one process had been resumed
    with dropout before (tests/train/test_exact_resume.py)."""
    steps = 3
    jobs = []
    for layout in ("tp2", "cp2-documents"):
        cfg = _dropout_config(cache_dir, layout, "none", DROPOUT)
        cfg["train"]["max_steps"] = 2 * steps
        cfg["checkpoint"] = {"save_interval": steps, "keep_last": None}
        config = write_config(tmp_path / f"{layout}.yaml", cfg)
        jobs += [{"config": str(config), "run_dir": str(tmp_path / layout / "ref"),
                  "overrides": ["checkpoint.save_interval=null",
                                "checkpoint.save_on_exit=false"]},
                 {"config": str(config), "run_dir": str(tmp_path / layout / "cut"),
                  "faults": {"kill_after_save": steps}, "expect": -9},
                 {"config": str(config), "run_dir": str(tmp_path / layout / "cut")}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for layout in ("tp2", "cp2-documents"):
        ref = by_iteration(metrics(tmp_path / layout / "ref"))
        cut = by_iteration(metrics(tmp_path / layout / "cut"))
        assert sorted(ref) == sorted(cut) == list(range(1, 2 * steps + 1)), layout
        for it in ref:
            assert (cut[it]["lm_loss"], cut[it]["grad_norm"]) == \
                (ref[it]["lm_loss"], ref[it]["grad_norm"]), (layout, it)
