"""Overlapped parameter all-gather (issue 10, item 1).

With the distributed optimizer and ``parallel.overlap_param_gather``, megatron
defers the all-gather of updated parameters to the next forward pass: between
an update and that forward, a DP rank holds fresh values only for the shard it
owns. Everything that reads the weights in that window (a checkpoint save at
an interval or on a stop signal, validation, the α/β statistics) must see the
updated weights. All runs here share one 2-rank launch (DP=2).
"""

from __future__ import annotations

import pytest
import torch

from tests.train.conftest import by_iteration, metrics, run_driver, tiny_config, write_config

pytestmark = pytest.mark.slow

OVERLAP = ["parallel.overlap_grad_reduce=true", "parallel.overlap_param_gather=true"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus, cache_dir):
    root = tmp_path_factory.mktemp("param_gather")
    config = write_config(root / "c.yaml", tiny_config(
        corpus, cache_dir,
        train={"max_steps": 6, "eval_interval": 2, "eval_iters": 1, "kv_shift_stats_interval": 3,
               "dist_timeout_minutes": 2},
        checkpoint={"save_interval": 3, "keep_last": None}))

    def job(name, overrides=(), **extra):
        return {"config": str(config), "run_dir": str(root / name), "overrides": list(overrides),
                **extra}

    bf16 = ["train.precision=bf16", *OVERLAP]
    no_saves = ["checkpoint.save_interval=null", "checkpoint.save_on_exit=false"]
    jobs = [
        job("plain"),
        # saves at 3 (interval) and at 5 (the stop request, as on SIGTERM/SIGUSR1)
        job("overlap", OVERLAP, faults={"stop_after": 5}),
        # weights only from the overlapped run's step-3 checkpoint: step 4's loss is a
        # forward pass of the saved weights before any update
        job("weights_only", ["checkpoint.load_optimizer=false", "train.max_steps=4",
                             f"checkpoint.resume={root / 'overlap' / 'checkpoints' / 'iter_0000003'}"]),
        # bf16: the model's weights and the fp32 main params are different tensors
        job("bf16_reference", bf16 + no_saves),
        job("bf16_resumed", bf16, faults={"stop_after": 5}),
        job("bf16_resumed", bf16),
    ]
    result = run_driver(jobs, root / "plan.json", nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return root


def _flat(checkpoint) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint, by its dotted key (no process group)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = checkpoint.parent / f"{checkpoint.name}.flat.pt"
    dcp_to_torch_save(str(checkpoint), str(target))
    out: dict[str, torch.Tensor] = {}

    def walk(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif torch.is_tensor(v):
                out[prefix + k] = v

    walk(torch.load(target, weights_only=False))
    target.unlink()
    return out


@pytest.mark.parametrize("run,iteration", [("overlap", 3), ("overlap", 5), ("bf16_resumed", 5)])
def test_saved_weights_equal_the_optimizer_main_params(runs, run, iteration):
    tensors = _flat(runs / run / "checkpoints" / f"iter_{iteration:07d}")
    compared = 0
    for key, weight in tensors.items():
        main = tensors.get(f"optimizer.state.param.{key}")
        if main is None:
            continue
        stale = (main.to(weight.dtype) != weight).float().mean().item()
        assert stale == 0.0, f"{key}: {stale:.0%} of the saved weights are not the updated ones"
        compared += 1
    assert compared >= 8  # every weight of the tiny model has main params


def test_weights_only_resume_continues_with_the_saved_weights(runs):
    reference = by_iteration(metrics(runs / "overlap"))
    resumed = by_iteration(metrics(runs / "weights_only"))
    assert sorted(resumed) == [4]
    assert resumed[4]["lm_loss"] == reference[4]["lm_loss"]


def test_bf16_full_resume_is_bit_identical(runs):
    reference = by_iteration(metrics(runs / "bf16_reference"))
    resumed = by_iteration(metrics(runs / "bf16_resumed"))
    assert sorted(resumed) == sorted(reference) == list(range(1, 7))
    for it in (6,):
        assert resumed[it]["lm_loss"] == reference[it]["lm_loss"], it
        assert resumed[it]["grad_norm"] == reference[it]["grad_norm"], it


def test_validation_and_statistics_see_the_updated_weights(runs):
    """Overlap changes when parameters travel, not the numbers (as in
    tests/train/test_exact_resume.py, 1e-6): validation after steps 2 and 4 and
    the α/β statistics of step 3 must match the run without overlap."""
    for kind, it in (("valid", 2), ("valid", 4), ("kv_shift", 3)):
        plain = by_iteration(metrics(runs / "plain", kind))[it]
        overlap = by_iteration(metrics(runs / "overlap", kind))[it]
        keys = [k for k, v in plain.items() if isinstance(v, float)]
        assert keys, plain
        for key in keys:
            assert overlap[key] == pytest.approx(plain[key], rel=1e-6, abs=1e-6), (kind, it, key)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="DP=2 over NCCL needs two GPUs (NCCL refuses two ranks on one GPU)")
def test_bf16_overlapped_gather_save_and_resume_on_gpus(tmp_path, cache_dir):
    """On GPUs (NCCL, bf16, async save): the checkpoint saved on a stop holds the
    updated weights, and the resumed run continues bit-identically."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 8, "precision": "bf16"},
        checkpoint={"save_interval": None, "async_save": True}))
    overlap = ["train.precision=bf16", *OVERLAP]
    jobs = [{"config": str(config), "run_dir": str(tmp_path / "reference"),
             "overrides": overlap + ["checkpoint.save_on_exit=false"]},
            {"config": str(config), "run_dir": str(tmp_path / "resumed"), "overrides": overlap,
             "faults": {"stop_after": 5}},
            {"config": str(config), "run_dir": str(tmp_path / "resumed"), "overrides": overlap}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    tensors = _flat(tmp_path / "resumed" / "checkpoints" / "iter_0000005")
    for key, weight in tensors.items():
        main = tensors.get(f"optimizer.state.param.{key}")
        if main is not None:
            assert torch.equal(main.to(weight.dtype), weight), key
    reference = by_iteration(metrics(tmp_path / "reference"))
    resumed = by_iteration(metrics(tmp_path / "resumed"))
    for it in (6, 7, 8):
        assert resumed[it]["lm_loss"] == reference[it]["lm_loss"], it
