"""The CPU backend: CUDA-only calls of megatron redirected, nothing else changed."""

from __future__ import annotations

import subprocess
import sys
import types

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



def test_forked_stream_draws_do_not_warn(mp1, caplog):
    """Dropout inside megatron's TP fork draws from the forked stream, which on the
    CPU backend is the CPU generator: megatron's check that the CPU generator was
    left alone there is meaningless and warned once per layer and micro batch."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    with caplog.at_level("WARNING"):
        with get_cuda_rng_tracker().fork():
            torch.nn.functional.dropout(torch.ones(8), 0.5)
    assert "CPU RNG state changed" not in caplog.text

def test_cuda_streams_and_events_are_refused_in_one_line(single_rank):
    """No path kvtrain runs on the CPU creates a CUDA stream or event (the whole suite
    was run with them recording their callers: none did); megatron's paths that do
    (partial distributed optimizers, activation offloading, dynamic inference, its
    a2a-overlap schedule) are refused in one line instead of running untested on
    inert stand-ins. ``synchronize``, which the pipeline schedules call, stays."""
    from kvtrain.cli import error_line
    from kvtrain.config import ConfigError

    assert enable_cpu_backend() is True
    torch.cuda.synchronize()
    calls = {"torch.cuda.Stream": lambda: torch.cuda.Stream(device=0),
             "torch.cuda.ExternalStream": lambda: torch.cuda.ExternalStream(0),
             "torch.cuda.Event": lambda: torch.cuda.Event(enable_timing=True),
             "torch.cuda.current_stream": torch.cuda.current_stream,
             "torch.cuda.default_stream": torch.cuda.default_stream,
             "torch.cuda.stream": lambda: torch.cuda.stream(None),
             "torch.cuda.set_stream": lambda: torch.cuda.set_stream(None)}
    # names in annotations evaluated at import (transformers' continuous batching:
    # `torch.cuda.Stream | None`) and in isinstance: classes still
    assert isinstance(torch.cuda.Stream | None, types.UnionType)
    assert not isinstance(object(), (torch.cuda.Stream, torch.cuda.Event))
    for name, call in calls.items():
        with pytest.raises(ConfigError) as refused:
            call()
        assert error_line(refused.value) == (
            f"kvtrain: CPU backend: {name} was called, which only GPU paths use "
            f"(megatron's overlapped communication on a side stream, activation offloading, "
            f"CUDA-graph and dynamic inference): kvtrain's CPU backend runs none of them")


def test_disabled_by_environment():
    code = ("import os; os.environ['KVTRAIN_CPU_BACKEND']='0';"
            "from kvtrain.backend import enable_cpu_backend; print(enable_cpu_backend())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def reduce_scatter_worker(rank, world):
    """A plain reduce_scatter_tensor, then what megatron's DDP does for the
    distributed optimizer: several issued inside torch's _coalescing_manager,
    waited on together."""
    from torch.distributed.distributed_c10d import _coalescing_manager

    x = torch.arange(8, dtype=torch.float32) * (rank + 1)
    plain = torch.empty(8 // world)
    dist.reduce_scatter_tensor(plain, x)

    grads = [torch.arange(8, dtype=torch.float32) * (rank + 1),
             torch.arange(4, dtype=torch.float32) * 10 * (rank + 1)]
    coalesced = [torch.empty(g.numel() // world) for g in grads]
    with _coalescing_manager(async_ops=True) as cm:
        for out, g in zip(coalesced, grads):
            dist.reduce_scatter_tensor(out, g, async_op=True)
    cm.wait()
    return plain, coalesced


def test_gloo_reduce_scatter_tensor():
    """Each rank gets its slice of the *reduced* tensor, also inside the coalescing
    manager (a fallback that slices before the deferred all-reduce ran would
    return this rank's own gradients there)."""
    (a, a_co), (b, b_co) = run_distributed(reduce_scatter_worker, 2)
    full = torch.arange(8, dtype=torch.float32) * 3
    assert torch.equal(a, full[:4]) and torch.equal(b, full[4:])
    full = [torch.arange(8, dtype=torch.float32) * 3, torch.arange(4, dtype=torch.float32) * 30]
    assert torch.equal(a_co[0], full[0][:4]) and torch.equal(b_co[0], full[0][4:])
    assert torch.equal(a_co[1], full[1][:2]) and torch.equal(b_co[1], full[1][2:])


@pytest.mark.gpu
def test_no_op_on_gpu():
    """With CUDA present the backend stays off and torch is untouched."""
    code = ("import torch; from kvtrain.backend import enable_cpu_backend;"
            "print(enable_cpu_backend(), torch.empty(1, device='cuda').device.type)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "cuda"]


def test_reinitialising_model_parallel_releases_the_old_groups(single_rank):
    """megatron's destroy_model_parallel forgets its gloo groups without destroying
    them (three threads each): re-initialising must not pile them up (the suite's
    process reached 7930 threads and crawled)."""
    import os

    from kvtrain.backend import init_model_parallel

    def counts() -> tuple[int, int]:
        return (len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task")))

    init_model_parallel(1, 1)
    groups, threads = counts()
    for _ in range(4):
        init_model_parallel(1, 1)
    assert counts()[0] == groups
    assert counts()[1] <= threads + 2  # a stray helper thread at most, not 3 per group


def test_a_model_run_before_reinitialising_keeps_no_old_group_alive(single_rank):
    """megatron's RotaryEmbedding.forward is ``lru_cache``d on the module (32 entries),
    and the module holds its context-parallel group: every model a process ran kept a
    destroyed gloo group, and its three threads, alive. The suite's workers reached
    1,200 threads whose wake-ups took a fifth of the suite's CPU."""
    import gc
    import weakref

    from kvtrain.backend import init_model_parallel
    from kvtrain.backend.distributed import _MEGATRON_GROUPS
    from tests.model.test_torch_backend import batch, both, model_config, run

    init_model_parallel(1, 1)
    local = both(model_config("kv_shift", 2))[0]
    run(local, *batch())
    old = [weakref.ref(group) for group in _MEGATRON_GROUPS]
    del local
    init_model_parallel(1, 1)
    gc.collect()
    assert [ref() for ref in old if ref() is not None] == []


def hung_peer_worker(rank, world):
    """Rank 0 all-reduces over megatron's data-parallel group, rank 1 never joins."""
    import time

    from megatron.core import parallel_state

    from kvtrain.backend import init_distributed

    init_distributed(seed=1, timeout_minutes=0.03)  # 1.8 s
    waited = None
    if rank == 0:
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=parallel_state.get_data_parallel_group())
        except RuntimeError:
            waited = time.monotonic() - started
    dist.barrier()  # over the world group: rank 1 waits for rank 0's verdict
    return waited


def test_megatron_groups_time_out_after_the_configured_minutes():
    """train.dist_timeout_minutes bounds the wait on a hung rank in megatron's groups
    too (they were made with megatron's default, 30 minutes)."""
    waited, _ = run_distributed(hung_peer_worker, 2, timeout=300)
    assert waited is not None and waited < 10


def test_a_one_process_group_takes_another_port_when_its_port_is_taken_meanwhile():
    """A run of one process picks a free port for its store, then binds it: another
    process (a sweep's cell, the demo's other arm) may bind it in between. The
    group takes another port instead of failing the run with EADDRINUSE."""
    code = """
import os, socket
import kvtrain.backend.distributed as d
busy = socket.socket(); busy.bind(("127.0.0.1", 0)); busy.listen()
ports = [busy.getsockname()[1]]  # the first port picked is taken before the bind
real = d.free_port
d.free_port = lambda: ports.pop() if ports else real()
for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK"):
    os.environ.pop(k, None)
env = d.init_process_group(0.5)
print("world", env.world_size, os.environ["MASTER_PORT"] != str(busy.getsockname()[1]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-3:] == ["world", "1", "True"], \
        out.stdout + out.stderr[-2000:]


def test_a_leftover_master_addr_without_a_port_is_a_one_process_group():
    """A shell of a cluster job exports MASTER_ADDR (its sbatch script did) and a run
    of one process starts in it (kvtrain train, the demo's or a sweep's runs): with
    no WORLD_SIZE and no MASTER_PORT it is a group of its own on this host, not
    torch's `environment variable MASTER_PORT expected` traceback."""
    code = """
import os
import kvtrain.backend.distributed as d
for k in ("MASTER_PORT", "WORLD_SIZE", "RANK"):
    os.environ.pop(k, None)
os.environ["MASTER_ADDR"] = "node-of-another-job"
env = d.init_process_group(0.5)
print("world", env.world_size, os.environ["MASTER_ADDR"])
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split()[-3:] == ["world", "1", "127.0.0.1"], \
        out.stdout + out.stderr[-2000:]
