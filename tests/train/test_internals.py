"""The trainer's pieces in-process: the checkpoint traps of megatron-core 0.16.1, weight
decay groups, and data-parallel gradient synchronisation.

Each trap test fails without its fix:
* shared AdamW ``step`` after a load (and the ``KeyError: 'step'``): steps are
  per parameter and count the updates after a resume;
* ``finalize_model_grads_func``: without it DP ranks drift apart (shown);
* weight decay: norms, biases and KV-shift coefficients are in wd_mult=0 groups.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvtrain.config import RunConfig
from kvtrain.config.loader import from_dict

from .conftest import tiny_config


def _run(cfg_dict: dict, run_dir: Path):
    from kvtrain.train.setup import build_run

    return build_run(from_dict(RunConfig, cfg_dict), run_dir)


def _steps(run, n: int, iterators=None):
    from kvtrain.train.loop import _data_iterators
    from kvtrain.train.step import ForwardStep, train_step

    t = run.cfg.train
    iterators = iterators or _data_iterators(run, 0)
    results = []
    for _ in range(n):
        results.append(train_step(run.forward_backward, ForwardStep(), iterators, run.model,
                                  run.optimizer, run.scheduler, run.num_microbatches,
                                  t.seq_length, t.micro_batch_size, (0.0, 0.0)))
    return results, iterators


def test_adam_steps_are_per_parameter_after_resume(single_rank, tmp_path, cache_dir):
    from kvtrain.config import to_dict
    from kvtrain.train.checkpoint import Checkpointer, TrainState
    from kvtrain.train.optimizer import adam_steps, inner_optimizers

    cfg = tiny_config(None, cache_dir)
    run = _run(cfg, tmp_path)
    _steps(run, 3)
    assert set(adam_steps(run.optimizer)) == {3.0}
    Checkpointer(tmp_path / "ckpt", run.model, run.optimizer, run.scheduler, to_dict(run.cfg)) \
        .save(TrainState(iteration=3, consumed_samples=24))

    fresh = _run(cfg, tmp_path)  # new model and optimizer (no state yet)
    ckpt = Checkpointer(tmp_path / "ckpt", fresh.model, fresh.optimizer, fresh.scheduler,
                        to_dict(fresh.cfg))
    state = ckpt.load(tmp_path / "ckpt" / "iter_0000003")  # KeyError 'step' without the fix
    assert state.iteration == 3 and state.consumed_samples == 24
    states = [s for inner in inner_optimizers(fresh.optimizer) for s in inner.state.values()]
    assert len(states) > 1
    assert len({id(s["step"]) for s in states}) == len(states)  # one tensor per parameter
    assert set(adam_steps(fresh.optimizer)) == {3.0}
    # the fused AdamW (see build_optimizer), kept through the load
    assert all(group["fused"] and not group["foreach"]
               for inner in inner_optimizers(fresh.optimizer) for group in inner.param_groups)
    _steps(fresh, 1)
    assert set(adam_steps(fresh.optimizer)) == {4.0}  # a shared tensor would jump by #params
    assert fresh.scheduler.num_steps == 4
    # the restored weights and moments are the saved ones: the next step agrees
    old = {n: p.detach().clone() for n, p in run.model[0].module.named_parameters()}
    _steps(run, 1)
    for name, p in run.model[0].module.named_parameters():
        torch.testing.assert_close(p, dict(fresh.model[0].module.named_parameters())[name],
                                   rtol=0, atol=0, msg=name)
    assert any(not torch.equal(old[n], p) for n, p in run.model[0].module.named_parameters())


@pytest.mark.parametrize("dist_opt", [True, False])
def test_a_resume_trains_with_the_configs_optimizer_values(single_rank, tmp_path, cache_dir,
                                                            dist_opt):
    """The config wins over the checkpoint's param groups (optimizer.build_scheduler,
    config/compat.py): a resume with a new lr, min lr, betas and eps trains with them,
    groups keep the run's wd_mult, and the change is recorded. ``load_state_dict``
    alone would bring the checkpoint's max_lr/min_lr/betas/eps back."""
    from kvtrain.config import to_dict
    from kvtrain.train.checkpoint import Checkpointer, TrainState
    from kvtrain.train.optimizer import current_lr

    def built(run_dir, **optimizer):
        cfg = tiny_config(None, cache_dir, parallel={"distributed_optimizer": dist_opt},
                          optimizer={"lr_warmup_steps": 0, "weight_decay": 0.1, **optimizer})
        run = _run(cfg, tmp_path / run_dir)
        return run, Checkpointer(tmp_path / "ckpt", run.model, run.optimizer, run.scheduler,
                                 to_dict(run.cfg))

    run, ckpt = built("a", lr=1e-3, min_lr=1e-4, adam_beta2=0.95, adam_eps=1e-8)
    _steps(run, 2)
    assert current_lr(run.optimizer) == pytest.approx(1e-3)
    ckpt.save(TrainState(iteration=2, consumed_samples=16))
    fresh, ckpt = built("b", lr=5e-4, min_lr=5e-5, adam_beta2=0.99, adam_eps=1e-6)
    wd_mults = [g["wd_mult"] for g in fresh.optimizer.param_groups]
    state = ckpt.load(tmp_path / "ckpt" / "iter_0000002")
    _steps(fresh, 1)
    groups = fresh.optimizer.param_groups
    assert {(g["lr"], g["max_lr"], g["min_lr"], tuple(g["betas"]), g["eps"]) for g in groups} \
        == {(5e-4, 5e-4, 5e-5, (0.9, 0.99), 1e-6)}
    assert [g["wd_mult"] for g in groups] == wd_mults
    assert {str(c) for c in state.extra["config_changes"]} == {
        "optimizer.lr: 0.001 -> 0.0005", "optimizer.min_lr: 0.0001 -> 5e-05",
        "optimizer.adam_beta2: 0.95 -> 0.99", "optimizer.adam_eps: 1e-08 -> 1e-06"}


@pytest.mark.parametrize("decay_shift", [False, True])
def test_weight_decay_groups(single_rank, tmp_path, cache_dir, decay_shift):
    from kvtrain.model.kv_shift import is_kv_shift_param

    cfg = tiny_config(None, cache_dir, optimizer={"weight_decay": 0.1})
    cfg["model"]["kv_shift"] = {"weight_decay": decay_shift}
    run = _run(cfg, tmp_path)
    seen = set()
    for group in run.optimizer.param_groups:  # the scheduler applied each group's wd_mult
        if group["params"]:
            seen.add(group["wd_mult"])
        assert group["weight_decay"] == pytest.approx(0.1 * group["wd_mult"])
    assert seen == {0.0, 1.0}
    from kvtrain.train.optimizer import no_weight_decay_overrides

    (key,) = no_weight_decay_overrides(decay_shift)
    decayed = {n for n, p in run.model[0].module.named_parameters() if not key.matches(p, n)}
    no_decay = {n for n, p in run.model[0].module.named_parameters() if key.matches(p, n)}
    assert all("layernorm" in n or "final_layernorm" in n or "shift_" in n for n in no_decay)
    assert any("layernorm" in n for n in no_decay)
    shift = {n for n, p in run.model[0].module.named_parameters() if is_kv_shift_param(p)}
    assert shift and (shift <= decayed if decay_shift else shift <= no_decay)
    assert all(p.dim() == 2 for n, p in run.model[0].module.named_parameters() if n in decayed)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_coefficients_go_outside_autograd_where_no_hook_waits(single_rank, tmp_path,
                                                                  cache_dir, overlap):
    """The trainer marks the shift's coefficients for the nodes' untracked path
    (``coefficient_grads.untrack_coefficients``) where megatron's DDP does not overlap
    its reduction, and not where it does (its hook on them tells their bucket); a step
    trains either way."""
    from kvtrain.model.coefficient_grads import UNTRACKED
    from kvtrain.model.kv_shift import is_kv_shift_param

    cfg = tiny_config(None, cache_dir, parallel={"overlap_grad_reduce": overlap})
    run = _run(cfg, tmp_path)
    marks = [getattr(p, UNTRACKED, None) for p in run.model[0].module.parameters()
             if is_kv_shift_param(p)]
    assert len(marks) == 4 and marks == [not overlap] * 4
    assert not any(getattr(p, UNTRACKED, False) for p in run.model[0].module.parameters()
                   if not is_kv_shift_param(p))
    (result,), _ = _steps(run, 1)
    assert math.isfinite(result.loss) and result.outcome.updated


def _flat(run) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in run.model[0].module.parameters()])


def _kernel_worker(rank: int, world: int, cfgs: list, run_dir: str):
    """Two steps of each config; this rank's weights (its TP shard), the losses, and
    whether its coefficients were marked for the untracked path."""
    from kvtrain.model.coefficient_grads import UNTRACKED
    from kvtrain.model.kv_shift import is_kv_shift_param

    out = []
    for i, cfg in enumerate(cfgs):
        run = _run(cfg, Path(run_dir) / str(i))
        results, _ = _steps(run, 2)
        marked = [getattr(p, UNTRACKED) for p in run.model[0].module.parameters()
                  if is_kv_shift_param(p)]
        out.append((_flat(run), [r.loss for r in results], marked))
    return out


@pytest.mark.slow
def test_untracked_coefficients_train_as_megatrons_hook_path(single_rank, tmp_path, cache_dir):
    """The shift on torch ops (``QKVShift``: the coefficients outside autograd, their
    gradients added into main_grad by the node) against the native operators (a C++
    node: autograd, megatron's hook) on 2 ranks, TP=2 with sequence parallelism (each
    rank its KV heads' coefficients) and DP=2 with the distributed optimizer: the same
    losses and weights after two steps (fp32, 1e-5)."""
    from kvtrain.testing import run_distributed

    layouts = [{"tensor": 2, "sequence_parallel": True}, {}]
    cfgs = [tiny_config(None, cache_dir, parallel=layout, model={"kv_shift": {"kernel": kernel}})
            for layout in layouts for kernel in ("torch", "native")]
    ranks = run_distributed(_kernel_worker, 2, cfgs, str(tmp_path))
    for rank in ranks:
        for untracked, hooked in (rank[0:2], rank[2:4]):
            assert untracked[2] == [True] * 4  # 2 layers x K, V (the native node ignores it)
            assert untracked[1] == pytest.approx(hooked[1], rel=1e-5)
            assert torch.allclose(untracked[0], hooked[0], rtol=1e-5, atol=1e-6)
    assert not torch.equal(ranks[0][0][0], ranks[1][0][0])  # TP: each rank its shard



def _dp_worker(rank: int, world: int, cfgs: list, run_dir: str):
    """For each config: two steps at DP=2, then one more without megatron's
    finalize_model_grads (without it DDP never reduces); this replica's weights after each."""
    from megatron.core.utils import get_model_config

    out = []
    for i, cfg in enumerate(cfgs):
        run = _run(cfg, Path(run_dir) / str(i))
        results, iterators = _steps(run, 2)
        after_two = _flat(run)
        get_model_config(run.model[0]).finalize_model_grads_func = None
        _steps(run, 1, iterators)
        out.append((after_two, _flat(run), [r.loss for r in results]))
    return out


@pytest.mark.slow
def test_data_parallel_gradients_are_synchronised(single_rank, tmp_path, cache_dir):
    """DP=2 trains exactly like one process on the same global batches, with the
    distributed optimizer and with the plain one; without finalize_model_grads it
    would not (each replica would follow its own half of the batch)."""
    from kvtrain.testing import run_distributed

    cfgs = [tiny_config(None, cache_dir, parallel={"distributed_optimizer": flag})
            for flag in (True, False)]
    replicas = run_distributed(_dp_worker, 2, cfgs, str(tmp_path / "dp2"))
    for i, cfg in enumerate(cfgs):
        single = _run(cfg, tmp_path / f"dp1-{i}")
        results, iterators = _steps(single, 2)
        ref_two = _flat(single)
        _steps(single, 1, iterators)
        ref_three = _flat(single)
        for rank_results in replicas:
            after_two, after_three, losses = rank_results[i]
            assert losses == pytest.approx([r.loss for r in results], rel=1e-6)
            torch.testing.assert_close(after_two, ref_two, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(after_three, ref_three, rtol=1e-5, atol=1e-6)


def test_a_resume_that_moves_the_schedules_end_checks_the_wsd_decay_again(cache_dir):
    """train.train_tokens of 10 steps of 8 x 32 with a wsd decay of 6 after a warmup
    of 2: it fits. A checkpoint of 2 steps of 32 x 32 leaves 2 steps of 8 x 32: the
    schedule ends at 4, where the decay would start inside the warmup; before the fix
    the horizon moved silently (the LR dropped right after the warmup)."""
    from types import SimpleNamespace

    from kvtrain.config import ConfigError
    from kvtrain.config.layout import derive_layout
    from kvtrain.train.checkpoint import TrainState
    from kvtrain.train.setup import fit_token_budget

    cfg = from_dict(RunConfig, tiny_config(
        None, cache_dir, train={"max_steps": None, "train_tokens": 10 * 8 * 32},
        optimizer={"lr_schedule": "wsd", "wsd_decay_steps": 6, "lr_warmup_steps": 2}))
    cfg.validate(world_size=1)
    layout = derive_layout(cfg, 1)
    run = SimpleNamespace(cfg=cfg, layout=layout, total_steps=layout.total_steps,
                          scheduler=SimpleNamespace())
    state = TrainState(iteration=2, consumed_samples=64, consumed_tokens=2 * 32 * 32)
    with pytest.raises(ConfigError, match=r"optimizer.wsd_decay_steps \(6\) must fit after the "
                       r"warmup in the schedule \(4 steps, warmup 2\), its end moved by this "
                       r"resume \(train.train_tokens after the checkpoint's 2048 tokens"):
        fit_token_budget(run, state)


def test_released_runs_are_freed(single_rank, tmp_path, cache_dir):
    """megatron's DDP hooks each parameter's AccumulateGrad node with a closure over the
    wrapper: a cycle through C++ that gc cannot see. Every run a process built (its
    model, optimizer and gloo groups, three threads each) stayed alive; the suite's
    workers spent a fifth of a core on those threads. release_models breaks it."""
    import gc
    import weakref

    from kvtrain.backend import init_model_parallel, release_models
    from kvtrain.backend.distributed import _MEGATRON_GROUPS

    run = _run(tiny_config(None, cache_dir), tmp_path)
    _steps(run, 1)
    model, groups = weakref.ref(run.model[0]), [weakref.ref(g) for g in _MEGATRON_GROUPS]
    del run
    release_models()
    init_model_parallel(1, 1)
    gc.collect()
    assert model() is None
    assert [ref() for ref in groups if ref() is not None] == []


FREEZE = """
import gc, sys
import kvtrain.train.loop
from kvtrain.train.processes import freeze_imports
freeze_imports()
print(gc.get_freeze_count(), len(gc.get_objects()), "torch._dynamo" in sys.modules)
"""


def test_a_rank_freezes_its_imports_and_unfreezes_them_at_exit():
    """``freeze_imports`` (``kvtrain train`` and the test driver call it after their
    imports): the collector's passes skip the imports' objects (megatron's
    distributed optimizer runs one per checkpoint save and load), and at exit they
    are unfrozen again: frozen, Triton's bindings print "leaked" lines on stderr."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    frozen, tracked, dynamo = done.stdout.split()
    assert int(frozen) > 100_000 and int(tracked) < 1_000 and dynamo == "True"
    assert "leaked" not in done.stderr, done.stderr[-2000:]
