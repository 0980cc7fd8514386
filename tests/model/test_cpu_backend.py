"""The CPU backend: CUDA-only calls of megatron redirected, nothing else changed."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from kvtrain.backend import enable_cpu_backend
from kvtrain.testing import run_distributed


def test_idempotent_and_redirects(single_rank):
    assert enable_cpu_backend() is True
    assert enable_cpu_backend() is True
    assert torch.cuda.current_device() == 0
    for t in (torch.empty(2, device="cuda"), torch.zeros(2, device=torch.cuda.current_device()),
              torch.ones(2).to("cuda:0"), torch.ones(2).to(0), torch.ones(2).cuda(),
              torch.ones(2).new_zeros(3, device="cuda"),
              torch.tensor([1.0], device=torch.device("cuda"))):
        assert t.device.type == "cpu"
    assert torch.ones(2).type() == "torch.cuda.FloatTensor"
    assert torch.ones(2, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
    assert torch.ones(2).type(torch.float64).dtype == torch.float64
    # meta-device construction still works after wrapping the factories
    with torch.device("meta"):
        assert torch.empty(3).device.type == "meta"


def test_megatron_rng_tracker_forks_a_real_stream(mp1):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    torch.manual_seed(0)
    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        inside = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is restored
    torch.manual_seed(0)
    assert not torch.equal(torch.rand(4), inside)  # the forked stream is another one


def test_disabled_by_environment():
    code = ("import os; os.environ['KVTRAIN_CPU_BACKEND']='0';"
            "from kvtrain.backend import enable_cpu_backend; print(enable_cpu_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def reduce_scatter_worker(rank, world):
    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    out = torch.empty(8 // world)
    dist.reduce_scatter_tensor(out, x)
    return out


def test_gloo_reduce_scatter_tensor():
    a, b = run_distributed(reduce_scatter_worker, 2)
    full = torch.arange(8, dtype=torch.float32) * 3
    assert torch.equal(a, full[:4]) and torch.equal(b, full[4:])


@pytest.mark.gpu
def test_no_op_on_gpu():
    """With CUDA present the backend stays off and torch is untouched."""
    code = ("import torch; from kvtrain.backend import enable_cpu_backend;"
            "print(enable_cpu_backend(), torch.empty(1, device='cuda').device.type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "cuda"]
