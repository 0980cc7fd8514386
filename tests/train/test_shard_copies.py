"""The distributed optimizer's shard copies batched (``kvtrain.train.shard_copies``):
every run takes them, their steps are megatron's bit for bit (fp32 and bf16, one
process and DP=2), and nothing runs per parameter on the host but an attribute set."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvtrain.train import shard_copies

from .conftest import tiny_config
from .test_internals import _flat, _run, _steps

METHODS = ("_copy_model_grads_to_main_grads", "_copy_main_params_to_model_params")


def _distributed(run) -> list:
    return list(getattr(run.optimizer, "chained_optimizers", [run.optimizer]))


def _megatrons(run):
    """The run with megatron's own copy methods back (the instance's override removed)."""
    for opt in _distributed(run):
        for name in METHODS:
            opt.__dict__.pop(name, None)
    return run


def _main_state(run) -> torch.Tensor:
    """Every main shard and its optimizer moments, flat."""
    parts = []
    for opt in _distributed(run):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                parts.append(p.detach().reshape(-1))
                parts += [v.reshape(-1) for k, v in opt.optimizer.state[p].items() if k != "step"]
    return torch.cat(parts)


def _pair(cfg: dict, root: Path) -> tuple:
    ours, theirs = _run(cfg, root / "ours"), _megatrons(_run(cfg, root / "theirs"))
    assert torch.equal(_flat(ours), _flat(theirs))
    return ours, theirs


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batched_copies_are_megatrons_bit_for_bit(single_rank, tmp_path, cache_dir, precision):
    """Three steps on the same batches: the model's weights, the main shards and
    the moments are identical to megatron's per-parameter loops'. bf16 has distinct
    fp32 main shards (copied back with a cast); fp32's are the parameters' memory."""
    ours, theirs = _pair(tiny_config(None, cache_dir, train={"precision": precision}), tmp_path)
    assert all(name in opt.__dict__ for opt in _distributed(ours) for name in METHODS)
    assert not any(name in opt.__dict__ for opt in _distributed(theirs) for name in METHODS)
    (_, batches), (_, other) = _steps(ours, 3), _steps(theirs, 3)
    assert torch.equal(_flat(ours), _flat(theirs))
    assert torch.equal(_main_state(ours), _main_state(theirs))
    assert not torch.equal(_flat(ours), _flat(_run(tiny_config(
        None, cache_dir, train={"precision": precision}), tmp_path / "fresh")))  # it trained
    copies = [shard_copies.ShardCopies(opt) for opt in _distributed(ours)]
    if precision == "bf16":  # one copy per parameter tensor, in one multi-tensor call
        assert sum(len(c.dst) for c in copies) == sum(1 for _ in ours.model[0].parameters())
    else:
        assert all(not c.dst for c in copies)


def test_a_step_copies_in_one_call_not_one_per_parameter(single_rank, tmp_path, cache_dir):
    """bf16, where main shards are copied back: megatron's loop runs a copy per parameter
    tensor; the batched copy one multi-tensor copy."""
    ours, theirs = _pair(tiny_config(None, cache_dir, train={"precision": "bf16"}), tmp_path)
    tensors = sum(1 for _ in ours.model[0].parameters())

    def calls(run) -> dict:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for opt in _distributed(run):
                opt._copy_main_params_to_model_params()
        counts = {e.key: e.count for e in prof.key_averages()}
        return {k: counts.get(k, 0) for k in ("aten::copy_", "aten::_foreach_copy_")}

    assert calls(theirs)["aten::copy_"] >= tensors and calls(theirs)["aten::_foreach_copy_"] == 0
    assert calls(ours)["aten::_foreach_copy_"] == 1


def test_other_optimizers_keep_megatrons_copies(single_rank, tmp_path, cache_dir):
    """The plain (non-distributed) optimizer is not touched: it has no shard loops."""
    run = _run(tiny_config(None, cache_dir, parallel={"distributed_optimizer": False}), tmp_path)
    assert shard_copies.install(run.optimizer) == 0
    assert not any(name in opt.__dict__ for opt in _distributed(run) for name in METHODS)


def _dp_worker(rank: int, world: int, cfg: dict, run_dir: str):
    ours, theirs = _pair(cfg, Path(run_dir) / str(rank))
    _steps(ours, 3), _steps(theirs, 3)
    return torch.equal(_flat(ours), _flat(theirs)), torch.equal(_main_state(ours),
                                                                _main_state(theirs))


@pytest.mark.slow
def test_at_dp2_each_rank_copies_its_own_shards_as_megatron(single_rank, tmp_path, cache_dir):
    """DP=2 with the distributed optimizer: each rank owns half of every bucket; after
    three bf16 steps both ranks' weights and main shards equal megatron's loops'."""
    from kvtrain.testing import run_distributed

    cfg = tiny_config(None, cache_dir, train={"precision": "bf16"})
    assert run_distributed(_dp_worker, 2, cfg, str(tmp_path)) == [(True, True), (True, True)]


@pytest.mark.parametrize("case", ["fsdp", "precision_aware", "bf16_grad_buffers"])
def test_cases_it_does_not_cover_keep_megatrons_copies(single_rank, tmp_path, cache_dir,
                                                       monkeypatch, case):
    """Megatron FSDP, the precision-aware optimizer and gradient buffers not in fp32
    (a main shard's gradient would be a cast, not a view) keep megatron's methods."""
    run = _megatrons(_run(tiny_config(None, cache_dir, train={"precision": "bf16"}), tmp_path))
    (opt,) = _distributed(run)
    assert shard_copies.applies(opt)
    if case == "fsdp":
        monkeypatch.setattr(opt.ddp_config, "use_megatron_fsdp", True)
    elif case == "precision_aware":
        monkeypatch.setattr(type(opt.config), "use_precision_aware_optimizer_no_fp8_or_ds_fp8",
                            property(lambda self: True), raising=False)
    else:
        param = opt.model_float16_groups[0][0]
        monkeypatch.setattr(param, "main_grad", param.main_grad.bfloat16())
    assert not shard_copies.applies(opt)
    assert shard_copies.install(run.optimizer) == 0
