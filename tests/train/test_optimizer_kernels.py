"""torch's fused AdamW where megatron falls back to torch's AdamW
(``kvtrain.train.optimizer.use_fused_adamw``): every run takes it and records it,
its steps follow the foreach path's within rounding, its ``step`` tensors live where
the kernel reads them (after a load too), and TE's or apex's FusedAdam stay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvtrain.train.optimizer import (
    FOREACH, FUSED, adam_steps, inner_optimizers, use_fused_adamw,
)

from .conftest import tiny_config
from .test_internals import _flat, _run, _steps


def _kernel_calls(fn) -> dict[str, int]:
    """How often ``fn`` ran torch's fused AdamW kernel and the foreach path's lerp."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    counts = {e.key: e.count for e in prof.key_averages()}
    return {k: counts.get(k, 0) for k in ("aten::_fused_adamw_", "aten::_foreach_lerp_")}


def _groups(optimizer) -> list[dict]:
    return [g for inner in inner_optimizers(optimizer) for g in inner.param_groups]


def _use_foreach(optimizer) -> None:
    """The groups on torch's foreach path (what kvtrain ran before the fused kernel)."""
    for group in _groups(optimizer):
        group["fused"], group["foreach"] = False, True


@pytest.mark.parametrize("distributed", [True, False])
def test_every_run_takes_fused_adamw_and_records_it(single_rank, tmp_path, cache_dir,
                                                    distributed):
    run = _run(tiny_config(None, cache_dir, parallel={"distributed_optimizer": distributed}),
               tmp_path)
    assert run.backend.optimizer == FUSED  # no TE, no apex here
    assert run.backend.describe().endswith("; optimizer: torch fused AdamW (kvtrain))")
    assert run.resolved["backend"]["optimizer"] == FUSED
    assert all(type(inner) is torch.optim.AdamW for inner in inner_optimizers(run.optimizer))
    assert all(g["fused"] is True and g["foreach"] is False for g in _groups(run.optimizer))
    calls = _kernel_calls(lambda: _steps(run, 1))
    assert calls["aten::_fused_adamw_"] >= 1 and calls["aten::_foreach_lerp_"] == 0
    for inner in inner_optimizers(run.optimizer):
        for p, state in inner.state.items():
            assert state["step"].device == p.device and state["step"].dtype == torch.float32


def test_fused_steps_follow_foreach_steps(single_rank, tmp_path, cache_dir):
    """Five fp32 steps of the fused kernel and of the foreach path from the same weights
    on the same batches (the profiler shows each arm on its own kernel). They are not
    bit-identical on the CPU (the kernel rounds its update differently). Measured on
    this model over these steps: the weights differ by at most 1.2e-7 (one fp32 ulp
    at |w| ~ 1, where the norm weights are), the moments by at most 6.3e-7 of their
    largest value, the losses not at all (by 2e-8 of theirs at step 6). The bounds
    are ~10x that: weights 1e-6, a 3000th of one update at lr 3e-3, which a missed
    weight decay (lr * 0.1 * |w|) or a bias correction off by a step exceeds;
    moments 1e-5; losses 1e-6."""
    cfg = tiny_config(None, cache_dir, train={"precision": "fp32"})  # bf16 rounds it away
    fused, foreach = _run(cfg, tmp_path / "fused"), _run(cfg, tmp_path / "foreach")
    _use_foreach(foreach.optimizer)
    assert torch.equal(_flat(fused), _flat(foreach))
    (ours, batches), (theirs, other_batches) = _steps(fused, 4), _steps(foreach, 4)
    calls = _kernel_calls(lambda: ours.extend(_steps(fused, 1, batches)[0]))
    assert calls["aten::_fused_adamw_"] >= 1 and calls["aten::_foreach_lerp_"] == 0
    calls = _kernel_calls(lambda: theirs.extend(_steps(foreach, 1, other_batches)[0]))
    assert calls["aten::_fused_adamw_"] == 0 and calls["aten::_foreach_lerp_"] >= 1
    for a, b in zip(ours, theirs, strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-6, abs=0)
    torch.testing.assert_close(_flat(fused), _flat(foreach), rtol=0, atol=1e-6)
    for inner, other in zip(inner_optimizers(fused.optimizer), inner_optimizers(foreach.optimizer)):
        for p, q in zip(inner.state, other.state, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                a, b = inner.state[p][key], other.state[q][key]
                assert (a - b).abs().max() <= 1e-5 * b.abs().max(), key
            assert inner.state[p]["step"].item() == other.state[q]["step"].item() == 5


def _checkpointer(run, root):
    from kvtrain.config import to_dict
    from kvtrain.train.checkpoint import Checkpointer

    return Checkpointer(root, run.model, run.optimizer, run.scheduler, to_dict(run.cfg))


def test_a_foreach_checkpoint_resumes_on_the_fused_kernel(single_rank, tmp_path, cache_dir):
    """torch's ``load_state_dict`` takes the param groups from the checkpoint, flags and
    all: a checkpoint of a foreach run (kvtrain before the fused kernel) would put the
    resumed run back on foreach. The run's own flags stay; the steps are the fused
    kernel's (fp32, on the parameter's device), and the next update is the one the
    saving run makes."""
    from kvtrain.train.checkpoint import TrainState

    cfg = tiny_config(None, cache_dir)
    run = _run(cfg, tmp_path)
    _steps(run, 3)
    _use_foreach(run.optimizer)
    _checkpointer(run, tmp_path / "ckpt").save(TrainState(iteration=3, consumed_samples=24))
    use_fused_adamw(run.optimizer)

    fresh = _run(cfg, tmp_path)
    _checkpointer(fresh, tmp_path / "ckpt").load(tmp_path / "ckpt" / "iter_0000003")
    assert all(g["fused"] is True and g["foreach"] is False for g in _groups(fresh.optimizer))
    for inner in inner_optimizers(fresh.optimizer):
        for p, state in inner.state.items():
            assert state["step"].device == p.device and state["step"].dtype == torch.float32
    assert set(adam_steps(fresh.optimizer)) == {3.0}
    assert _kernel_calls(lambda: _steps(fresh, 1))["aten::_fused_adamw_"] >= 1
    _steps(run, 1)
    assert torch.equal(_flat(fresh), _flat(run))


def _plain(params, **kwargs) -> SimpleNamespace:
    """torch's AdamW in megatron's place (a wrapper with ``.optimizer``)."""
    return SimpleNamespace(optimizer=torch.optim.AdamW(params, lr=1e-2, **kwargs))


def test_steps_go_where_the_fused_kernel_reads_them(single_rank):
    """``_fix_adam_steps`` rebuilds each step for the group's kernel, not on the device
    of the step it replaces: the parameter's (here ``meta``, a device that is not the
    CPU without a GPU) in fp32 for fused and capturable groups, a CPU scalar else."""
    from kvtrain.train.checkpoint import Checkpointer

    fused = torch.nn.Parameter(torch.zeros(3, device="meta"))
    plain = torch.nn.Parameter(torch.zeros(3, device="meta"))
    wrapper = _plain([{"params": [fused]}, {"params": [plain], "fused": False}], fused=True)
    inner = wrapper.optimizer
    for p in (fused, plain):  # as megatron's load leaves them: one shared CPU tensor
        inner.state[p] = {"step": torch.tensor(2.0, dtype=torch.float64)}
    Checkpointer._fix_adam_steps(SimpleNamespace(optimizer=wrapper,
                                                 scheduler=SimpleNamespace(num_steps=7)))
    step = inner.state[fused]["step"]
    assert step.device.type == "meta" and step.dtype == torch.float32
    step = inner.state[plain]["step"]
    assert step.device.type == "cpu" and step.dtype == torch.float64 and step.item() == 7


def test_a_step_from_before_is_moved_to_the_fused_kernel(single_rank):
    """State that exists when the kernel is chosen (megatron's build makes none) keeps
    its count, in a tensor of its own where the kernel reads it."""
    p = torch.nn.Parameter(torch.ones(4))
    wrapper = _plain([p], foreach=True)
    p.grad = torch.ones(4)
    wrapper.optimizer.step()
    old = wrapper.optimizer.state[p]["step"]
    wrapper.optimizer.state[p]["step"] = old.double()  # a float64 default dtype's step
    assert use_fused_adamw(wrapper) == FUSED
    step = wrapper.optimizer.state[p]["step"]
    assert step.dtype == torch.float32 and step.item() == 1.0
    assert _kernel_calls(wrapper.optimizer.step)["aten::_fused_adamw_"] == 1
    assert step.item() == 2.0


@pytest.mark.parametrize("group,why", [
    ({"params": [torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))]},
     "requires all the params to be floating point Tensors of supported devices"),
    ({"params": [torch.nn.Parameter(torch.ones(2))], "differentiable": True},
     "`fused` does not support `differentiable`"),
])
def test_where_torch_refuses_fused_every_group_takes_foreach(single_rank, group, why):
    """torch's own rules decide (``_device_dtype_check_for_fused``, ``Adam.__init__``);
    its reason is recorded. One group it refuses puts every group on foreach."""
    other = torch.nn.Parameter(torch.ones(3))
    wrapper = _plain([{"params": [other]}, group])
    kernel = use_fused_adamw(wrapper)
    assert kernel.startswith(f"{FOREACH}: ") and why in kernel
    assert all(g["fused"] is False and g["foreach"] is True
               for g in wrapper.optimizer.param_groups)
    if not group.get("differentiable"):
        for p in (other, *group["params"]):
            p.grad = torch.ones_like(p)
        wrapper.optimizer.step()  # complex parameters: foreach takes them, fused would not
        with pytest.raises(RuntimeError, match="floating point Tensors"):
            torch.optim.AdamW(group["params"], fused=True).step()


@pytest.mark.parametrize("module,name", [
    ("transformer_engine.pytorch.optimizers.fused_adam", "transformer_engine FusedAdam"),
    ("apex.optimizers.fused_adam", "apex FusedAdam")])
def test_te_or_apex_fused_adam_is_left_alone_and_named(single_rank, monkeypatch, module, name):
    """Where megatron built TE's or apex's FusedAdam (stand-ins: neither installs on
    these machines), kvtrain changes none of its groups and names it; a rank without an
    inner optimizer names the class megatron builds."""
    from megatron.core import optimizer as megatron_optimizer

    stand_in = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": module})
    p = torch.nn.Parameter(torch.ones(2))
    inner = stand_in([p], {"lr": 1e-3, "adam_w_mode": True})
    before = [dict(g) for g in inner.param_groups]
    assert use_fused_adamw(SimpleNamespace(optimizer=inner)) == name
    assert inner.param_groups == before and "fused" not in inner.param_groups[0]
    chained = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=inner)] * 2)
    assert use_fused_adamw(chained) == name
    assert use_fused_adamw(SimpleNamespace(optimizer=None)) == FUSED  # torch's, here
    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", False)
    monkeypatch.setattr(megatron_optimizer, "Adam", stand_in)
    assert use_fused_adamw(SimpleNamespace(optimizer=None)) == name


@pytest.mark.gpu
def test_on_a_gpu_fused_adamw_steps_on_the_gpu_and_resumes(single_rank, tmp_path, cache_dir,
                                                           monkeypatch):
    """bf16 on CUDA, megatron on its torch fallback (as without TE and apex): the fused
    kernel, its steps on the GPU, before and after a resume, from a checkpoint of its
    own and from one of a foreach run (whose CPU steps a fused update on a GPU cannot
    read); the resumed update is the saving run's, bit for bit."""
    from megatron.core import optimizer as megatron_optimizer
    from megatron.core.optimizer import distrib_optimizer

    from kvtrain.train.checkpoint import TrainState

    monkeypatch.setattr(megatron_optimizer, "USING_PYTORCH_OPTIMIZER", True)
    for flag, value in (("HAVE_APEX_OR_TE", False), ("USING_TE_OPTIMIZER", False),
                        ("USING_APEX_OPTIMIZER", False)):
        monkeypatch.setattr(distrib_optimizer, flag, value)
    cfg = tiny_config(None, cache_dir, train={"precision": "bf16"})
    run = _run(cfg, tmp_path)
    assert run.device == "cuda" and run.backend.optimizer == FUSED
    assert _kernel_calls(lambda: _steps(run, 3))["aten::_fused_adamw_"] >= 3
    for inner in inner_optimizers(run.optimizer):
        assert all(s["step"].device.type == "cuda" for s in inner.state.values())
    _checkpointer(run, tmp_path / "own").save(TrainState(iteration=3, consumed_samples=24))
    _use_foreach(run.optimizer)
    for inner in inner_optimizers(run.optimizer):
        for state in inner.state.values():
            state["step"] = state["step"].cpu()  # where torch's foreach path keeps them
    _checkpointer(run, tmp_path / "foreach").save(TrainState(iteration=3, consumed_samples=24))
    use_fused_adamw(run.optimizer)
    _steps(run, 1)
    for root in ("own", "foreach"):
        fresh = _run(cfg, tmp_path)
        _checkpointer(fresh, tmp_path / root).load(tmp_path / root / "iter_0000003")
        assert all(g["fused"] and not g["foreach"] for g in _groups(fresh.optimizer))
        for inner in inner_optimizers(fresh.optimizer):
            for p, state in inner.state.items():
                assert state["step"].device == p.device and state["step"].dtype == torch.float32
        _steps(fresh, 1)
        assert set(adam_steps(fresh.optimizer)) == {4.0}
        assert torch.equal(_flat(fresh), _flat(run)), root


def test_torchs_adamw_is_recognised_where_it_is_not_an_adam(single_rank, tmp_path, cache_dir,
                                                           monkeypatch):
    """Before torch 2.7 ``AdamW`` was no subclass of ``Adam``: its optimizers must still
    take the fused kernel (seen as torch's own, not as a foreign FusedAdam left alone).
    Simulated by an ``Adam`` that AdamW does not derive from."""
    run = _run(tiny_config(None, cache_dir), tmp_path)
    _use_foreach(run.optimizer)
    monkeypatch.setattr(torch.optim, "Adam", type("Adam", (torch.optim.Optimizer,), {}))
    assert not isinstance(inner_optimizers(run.optimizer)[0], torch.optim.Adam)
    assert use_fused_adamw(run.optimizer) == FUSED
    assert all(g["fused"] is True and g["foreach"] is False for g in _groups(run.optimizer))


def test_a_torch_without_the_fused_check_stays_on_foreach(monkeypatch):
    """torch < 2.4 has no ``_device_dtype_check_for_fused``: foreach, with the reason."""
    from kvtrain.train import optimizer

    monkeypatch.setattr(optimizer, "_device_dtype_check_for_fused", None)
    group = {"params": [torch.zeros(2)]}
    assert optimizer.fused_refusal([group]) == "this torch has no fused AdamW check (torch < 2.4)"
