"""Run a function on N ranks of a gloo group (tests, benchmarks, analysis scripts).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` processes,
initialises torch.distributed in each (gloo on CPU), calls
``fn(rank, world_size, *args)`` and returns the list of the ranks' return
values. An exception on any rank is re-raised in the caller with that rank's
traceback. ``fn`` must be importable (a module-level function).

``one_gpu=True`` puts every rank on GPU 0 over gloo (NCCL refuses two ranks on
one device; gloo stages CUDA tensors through the host): collectives of CUDA
tensors tested on a machine with one GPU.

Where no CUDA device is visible the ranks fork from a server that imported
torch, megatron and kvtrain once; where one is, they are spawned: on a GPU
machine with Triton those imports initialise CUDA (torch asks the device
whether Triton can use it), and a process forked after that cannot use CUDA
("Cannot re-initialize CUDA in forked subprocess", seen on the lent H200).
"""

from __future__ import annotations

import io
import os
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def _init(one_gpu: bool) -> None:
    """The ranks' process group: kvtrain's choice, or gloo with every rank on GPU 0."""
    if not one_gpu:
        from kvtrain.backend import init_process_group

        init_process_group(timeout_minutes=5)
        return
    import datetime

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))


def cuda_visible() -> bool:
    """Whether torch sees a CUDA device, asked through NVML: a plain
    ``torch.cuda.is_available()`` initialises the driver, after which no child
    this process forks can use CUDA."""
    import torch

    saved = os.environ.get(_NVML_CHECK)
    os.environ[_NVML_CHECK] = "1"  # read by torch at each call
    try:
        return torch.cuda.is_available()
    finally:
        if saved is None:
            del os.environ[_NVML_CHECK]
        else:
            os.environ[_NVML_CHECK] = saved


_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
            one_gpu: bool, env: dict, cwd: str) -> None:
    os.environ.clear()  # the caller's, not the fork server's, as a spawned rank had them
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    # One thread per rank: ranks share the machine's cores.
    import torch

    from kvtrain.train.processes import freeze_imports

    freeze_imports()  # the fork server's imports, as a rank of `kvtrain train` does

    torch.set_num_threads(1)
    try:
        from kvtrain.backend import destroy_distributed

        _init(one_gpu)
        result = fn(rank, world_size, *args)
        # Serialise to bytes: tensors sent as-is go through shared-memory file
        # descriptors that vanish when this process exits before the parent reads.
        buf = io.BytesIO()
        torch.save(result, buf)
        queue.put((rank, True, buf.getvalue()))
    except BaseException:  # report everything, including SystemExit
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            destroy_distributed()
        except Exception:
            pass


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 600,
                    one_gpu: bool = False) -> list:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` ranks (see above)."""
    # Without CUDA, ranks fork from a server that imported torch, megatron and kvtrain
    # once (a fresh interpreter per rank costs ~10 s of CPU in imports). It holds no
    # process group and no threads; the caller's environment and working directory are
    # passed on. torch._dynamo too: torch.optim imports it at a process's first
    # optimizer (~1 s). With CUDA those imports would leave the server unable to fork
    # a rank that uses it: fresh interpreters then.
    if cuda_visible():
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["kvtrain.train.loop", "torch._dynamo"])
    for _ in range(3):
        results, failures, codes = _start(ctx, fn, world_size, args, timeout, one_gpu)
        if not any(_port_taken(text) for text in failures):
            break
    if failures:
        raise RuntimeError("\n".join(failures))
    if len(results) < world_size:
        raise RuntimeError(f"distributed run incomplete: got {sorted(results)}, exit codes {codes}")
    return [results[r] for r in range(world_size)]


def _port_taken(failure: str) -> bool:
    """Rank 0's store could not listen on the port found free in the caller: another
    process took it in between (no rank ran ``fn``: a new start is safe)."""
    return "EADDRINUSE" in failure and "in _init" in failure


def _start(ctx, fn: Callable, world_size: int, args: tuple, timeout: float,
           one_gpu: bool) -> tuple[dict[int, Any], list[str], list]:
    """One start of the ranks on a fresh port: (results by rank, failures, exit codes)."""
    import time

    import torch

    from kvtrain.backend import free_port

    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, one_gpu,
                                          dict(os.environ), os.getcwd()), daemon=False)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    deadline = time.monotonic() + timeout
    while len(results) + len(failures) < world_size:
        if time.monotonic() > deadline:
            break
        if queue.empty():
            if not any(p.is_alive() for p in procs) and queue.empty():
                break
            time.sleep(0.05)
            continue
        rank, ok, value = queue.get()
        if ok:
            results[rank] = torch.load(io.BytesIO(value), weights_only=False)
        else:
            failures.append(f"rank {rank} failed:\n{value}")
            break  # the other ranks are likely stuck in a collective
    for p in procs:
        p.join(timeout=5 if failures or len(results) < world_size else 60)
        if p.is_alive():
            p.kill()
            p.join()
    return results, failures, [p.exitcode for p in procs]
