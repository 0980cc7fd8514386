"""``kvtrain.train.main_grads``: the gradient norm and the clipping of megatron's
optimizers without their per-parameter Python, megatron's values bit for bit."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvtrain.config import RunConfig
from kvtrain.config.loader import from_dict

from .conftest import tiny_config


def _grads(opt) -> list[torch.Tensor]:
    return [p.grad.clone() for p in opt.get_parameters() if p.grad is not None]


@pytest.mark.parametrize("dist_opt, precision", [(True, "bf16"), (True, "fp32"),
                                                 (False, "bf16"), (False, "fp32")])
def test_norm_and_clipping_are_megatrons(single_rank, tmp_path, cache_dir, dist_opt,
                                         precision):
    """After a step's backward: the installed filter hands the norm megatron's tensors
    in megatron's order, the norm is megatron's ``get_grad_norm`` and the clipped
    gradients megatron's ``clip_grad_by_total_norm_fp32``'s, all exactly; and a step
    of the trainer with them trains."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from kvtrain.train import main_grads
    from kvtrain.train.loop import _data_iterators
    from kvtrain.train.setup import build_run
    from kvtrain.train.step import ForwardStep, train_step

    cfg = tiny_config(None, cache_dir, parallel={"distributed_optimizer": dist_opt},
                      train={"precision": precision, "max_steps": 3})
    run = build_run(from_dict(RunConfig, cfg), tmp_path)
    (opt,) = getattr(run.optimizer, "chained_optimizers", [run.optimizer])
    assert main_grads.installed(opt) is not None
    t = run.cfg.train
    iterators = _data_iterators(run, 0)
    step = train_step(run.forward_backward, ForwardStep(), iterators, run.model,
                      run.optimizer, run.scheduler, run.num_microbatches, t.seq_length,
                      t.micro_batch_size, (0.0, 0.0))
    assert step.outcome.updated and step.outcome.grad_norm > 0
    # the next step's gradients, up to the update
    for chunk in run.model:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    run.forward_backward(forward_step_func=ForwardStep(), data_iterator=iterators,
                         model=run.model, num_microbatches=run.num_microbatches,
                         seq_length=t.seq_length, micro_batch_size=t.micro_batch_size,
                         forward_only=False)
    run.optimizer.prepare_grads()
    ours = opt.get_main_grads_for_grad_norm()
    theirs = MegatronOptimizer.get_main_grads_for_grad_norm(opt)
    assert len(ours) == len(theirs) > 0 and all(a is b for a, b in zip(ours, theirs))
    norm = opt.get_grad_norm()
    assert norm == MegatronOptimizer.get_grad_norm(opt) and norm > 0
    before = _grads(opt)
    main_grads.clip(opt, norm / 3, norm)  # clips: the coefficient is ~1/3
    clipped = _grads(opt)
    for p, g in zip((p for p in opt.get_parameters() if p.grad is not None), before):
        p.grad.copy_(g)
    clip_grad_by_total_norm_fp32(opt.get_parameters(), max_norm=norm / 3, total_norm=norm)
    assert all(torch.equal(a, b) for a, b in zip(clipped, _grads(opt)))
    assert not all(torch.equal(a, b) for a, b in zip(clipped, before))
    main_grads.clip(opt, norm * 2, norm)  # above the norm: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(clipped, _grads(opt)))


class _Group:
    def __init__(self, rank: int):
        self._rank = rank

    def rank(self) -> int:
        return self._rank


def _param(**attrs) -> torch.Tensor:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 2.0)
    for k, v in attrs.items():
        setattr(p, k, v)
    return p


def test_the_norm_leaves_out_shared_and_duplicate_parameters_and_clipping_does_not():
    """megatron's filter, worked out once: a tied embedding's shared copy and, on TP
    rank 1, a parameter every TP rank holds are not in the norm (TP-split ones are),
    parameters without a gradient in neither; clipping scales every gradient. A new
    parameter list (another optimizer state's groups) is worked out again."""
    from kvtrain.train.main_grads import MainGrads

    split, shared, replica, no_grad = (_param(tensor_model_parallel=True),
                                       _param(tensor_model_parallel=True, shared=True),
                                       _param(tensor_model_parallel=False),
                                       _param(tensor_model_parallel=True))
    no_grad.grad = None
    groups = [{"params": [split, shared]}, {"params": [replica, no_grad]}]
    opt = SimpleNamespace(optimizer=SimpleNamespace(param_groups=groups), tp_group=_Group(1))
    grads = MainGrads(opt)
    assert [g is split.grad for g in grads.for_norm()] == [True]
    opt.tp_group = _Group(0)
    assert len(grads.for_norm()) == 1  # worked out once: the filter is the run's
    groups[1] = {"params": [replica]}
    assert [id(g) for g in grads.for_norm()] == [id(split.grad), id(replica.grad)]
    grads.clip(1.0, 3.0)
    assert all(torch.allclose(p.grad, torch.full((2,), 2.0 / (3.0 + 1e-6)))
               for p in (split, shared, replica))


def test_the_norm_of_a_rank_without_gradients_is_zero(single_rank):
    """megatron's empty norm (a rank whose parameters got no gradient), reduced over the
    group; and the L2 norm of the gradients otherwise."""
    from kvtrain.train.main_grads import MainGrads

    p, q = _param(tensor_model_parallel=True), _param(tensor_model_parallel=True)
    p.grad = q.grad = None
    opt = SimpleNamespace(optimizer=SimpleNamespace(param_groups=[{"params": [p, q]}]),
                          get_grad_stats_parallel_group=lambda: None)
    grads = MainGrads(opt)
    assert grads.norm() == 0.0
    p.grad, q.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    assert grads.norm() == pytest.approx(5.0)


def test_other_optimizers_keep_megatrons_code():
    """A subclass with its own norm, a precision-aware optimizer's decoupled
    gradients and FSDP's DTensors are left to megatron."""
    from megatron.core.optimizer.optimizer import MegatronOptimizer

    from kvtrain.train.main_grads import applies

    class Plain(MegatronOptimizer):
        def __init__(self, precision_aware=False, fsdp=False):
            p = _param()
            if fsdp:
                p.__fsdp_param__ = True
            self.optimizer = SimpleNamespace(param_groups=[{"params": [p]}])
            self.config = SimpleNamespace(
                use_precision_aware_optimizer_no_fp8_or_ds_fp8=precision_aware)

    class OwnNorm(Plain):
        def get_grad_norm(self):
            return 0.0

    for kind in (Plain, OwnNorm):  # the abstract methods a check does not call
        kind.__abstractmethods__ = frozenset()

    assert applies(Plain())
    assert not applies(Plain(precision_aware=True))
    assert not applies(Plain(fsdp=True))
    assert not applies(OwnNorm())
