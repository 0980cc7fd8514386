"""kvtrain's multi-tensor ops in the place of megatron's fallbacks without TE or apex
(``kvtrain.train.multi_tensor``): the same values as megatron's, no host sync per
tensor, installed by every run and recorded with its backend."""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from kvtrain.train import multi_tensor


def _tensors(dtypes=(torch.float32,)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (3, 5), (64, 33), (1,), (2, 3, 4), (129,)]
    return [torch.randn(shape, generator=gen).to(dtypes[i % len(dtypes)]) * (i + 1)
            for i, shape in enumerate(shapes)]


def test_the_norm_is_megatrons(single_rank):
    from megatron.core.utils import local_multi_tensor_l2_norm

    tensors = _tensors()
    flag = torch.zeros(1, dtype=torch.int)
    want, _ = local_multi_tensor_l2_norm(2048, flag, [tensors], False)
    got, per_tensor = multi_tensor.foreach_l2_norm(2048, flag, [tensors], False)
    assert got.shape == (1,) and got.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(got, want.to(got.device), rtol=1e-6, atol=0)
    empty, _ = multi_tensor.foreach_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]


def test_low_precision_tensors_are_normed_in_fp32(single_rank):
    """bf16 tensors are summed in fp32, as TE's and apex's kernels do: within fp32
    rounding of the exact norm (megatron's fallback rounds each tensor's norm to
    bf16, ~1e-3 off)."""
    tensors = _tensors((torch.float32, torch.bfloat16))
    flag = torch.zeros(1, dtype=torch.int)
    exact = torch.linalg.vector_norm(torch.cat([t.double().flatten() for t in tensors]))
    got, _ = multi_tensor.foreach_l2_norm(2048, flag, [tensors], False)
    torch.testing.assert_close(got.double(), exact.reshape(1), rtol=1e-6, atol=0)


def test_scale_in_place_copy_and_cast_are_megatrons(single_rank):
    from megatron.core.utils import local_multi_tensor_scale

    flag = torch.zeros(1, dtype=torch.int)
    for scale, cast in ((0.25, None), (1.0, torch.bfloat16), (3.0, torch.bfloat16)):
        src = _tensors()
        ours, theirs = ([t.to(cast or t.dtype).zero_() for t in src] for _ in range(2))
        local_multi_tensor_scale(2048, flag, [src, theirs], scale)
        multi_tensor.foreach_scale(2048, flag, [src, ours], scale)
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b)
    grads, want = _tensors(), [t * 0.5 for t in _tensors()]  # clipping: [grads, grads]
    multi_tensor.foreach_scale(2048, flag, [grads, grads], 0.5)
    assert all(torch.equal(a, b) for a, b in zip(grads, want))


def _host_reads(fn) -> int:
    """Scalars read back by the host (``.item()``: a device sync on a GPU) during ``fn``."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_local_scalar_dense")


def test_the_norm_reads_nothing_back_per_tensor(single_rank):
    """megatron's fallback reads every tensor's norm back (one sync each on a GPU)."""
    from megatron.core.utils import local_multi_tensor_l2_norm

    tensors, flag = _tensors(), torch.zeros(1, dtype=torch.int)
    assert _host_reads(lambda: local_multi_tensor_l2_norm(2048, flag, [tensors], False)) \
        > len(tensors)
    assert _host_reads(lambda: multi_tensor.foreach_l2_norm(2048, flag, [tensors], False)) == 0


def test_every_run_installs_them_and_clipping_uses_them(single_rank, tmp_path, cache_dir):
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.utils import local_multi_tensor_l2_norm

    from .test_internals import _run, _steps
    from .conftest import tiny_config

    run = _run(tiny_config(None, cache_dir, optimizer={"clip_grad": 1e-3}), tmp_path)
    assert run.backend.multi_tensor == multi_tensor.FOREACH  # no TE, no apex here
    assert clip_grads.l2_norm_impl is multi_tensor.foreach_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert optimizer.multi_tensor_scale_impl is multi_tensor.foreach_scale
    assert multi_tensor.install() == multi_tensor.FOREACH  # idempotent
    # the step's gradient norm is megatron's, and the clipped step reads nothing back
    # per tensor (the trainer's own reads are a fixed few per step)
    grads = [p.main_grad for p in run.model[0].module.parameters()]
    reads = _host_reads(lambda: _steps(run, 1))
    flag = torch.zeros(1, dtype=torch.int)
    torch.testing.assert_close(multi_tensor.foreach_l2_norm(2048, flag, [grads], False)[0],
                               local_multi_tensor_l2_norm(2048, flag, [grads], False)[0],
                               rtol=1e-6, atol=0)
    clip_grads.l2_norm_impl = local_multi_tensor_l2_norm
    try:
        assert _host_reads(lambda: _steps(run, 1)) >= reads + len(grads)
    finally:
        multi_tensor.install()


@pytest.mark.gpu
def test_on_a_gpu_the_norm_and_the_scale_never_sync():
    from megatron.core.utils import local_multi_tensor_l2_norm

    tensors = [t.cuda() for t in _tensors()]
    flag = torch.zeros(1, dtype=torch.int, device="cuda")
    want, _ = local_multi_tensor_l2_norm(2048, flag, [tensors], False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
    try:
        got, _ = multi_tensor.foreach_l2_norm(2048, flag, [tensors], False)
        multi_tensor.foreach_scale(2048, flag, [tensors, tensors], 0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("module,kind", [
    ("transformer_engine.pytorch.optimizers", "transformer_engine"), ("amp_C", "apex")])
def test_with_te_or_apex_their_kernels_stay(module, kind):
    """Where megatron found TE's or apex's kernels, install leaves them in place and
    says whose they are (stand-ins here: neither installs on these machines)."""
    from megatron.core.optimizer import clip_grads, optimizer

    def fused(*args):
        raise AssertionError("not called here")

    fused.__module__ = module
    saved = (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
             optimizer.multi_tensor_scale_impl)
    clip_grads.l2_norm_impl = clip_grads.multi_tensor_scale_impl = fused
    optimizer.multi_tensor_scale_impl = fused
    try:
        assert multi_tensor.install() == kind
        assert clip_grads.l2_norm_impl is fused and clip_grads.multi_tensor_scale_impl is fused
        assert optimizer.multi_tensor_scale_impl is fused
    finally:
        (clip_grads.l2_norm_impl, clip_grads.multi_tensor_scale_impl,
         optimizer.multi_tensor_scale_impl) = saved
