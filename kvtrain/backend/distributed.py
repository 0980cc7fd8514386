"""Process groups and seeds: gloo on CPU, NCCL on GPU, megatron's parallel state.

Works as one plain process (a single-rank group on a free local port) or
under ``torchrun``/SLURM (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT`` in the environment).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import weakref
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .cpu import enable_cpu_backend


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits."""

    rank: int
    world_size: int
    local_rank: int
    backend: str


PORT_ATTEMPTS = 5  # ports a one-process group tries for its store (free_port races)


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(timeout_minutes: float = 10.0, device: str = "auto") -> DistEnv:
    """Initialises torch.distributed from the environment (idempotent).

    Turns on the CPU backend first when there is no GPU (``device`` is
    ``train.device``: a process given GPUs torch cannot see is refused there).
    Without ``WORLD_SIZE`` this is a one-process group, so the same code path
    runs everywhere.
    """
    enable_cpu_backend(device=device)
    backend = default_backend()
    if not dist.is_initialized():
        rank = int(os.environ.get("RANK", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
        # a group of its own on this host: no launcher's address, or one left over
        # without a port (a cluster job's shell exports MASTER_ADDR) and no WORLD_SIZE
        own_port = "MASTER_ADDR" not in os.environ or (
            "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ)
        if own_port:
            if world != 1:
                raise RuntimeError("WORLD_SIZE > 1 but MASTER_ADDR is not set (use torchrun)")
            os.environ["MASTER_ADDR"] = "127.0.0.1"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        for attempt in range(PORT_ATTEMPTS if own_port else 1):
            if own_port:
                os.environ["MASTER_PORT"] = str(free_port())
            try:
                dist.init_process_group(backend=backend, rank=rank, world_size=world,
                                        timeout=timeout)
                break
            except dist.DistNetworkError as e:
                # the free port was taken between its pick and the store's bind (another
                # process starting beside this one): a one-process group takes another
                if not own_port or "EADDRINUSE" not in str(e) or attempt == PORT_ATTEMPTS - 1:
                    raise
    return DistEnv(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        backend=dist.get_backend(),
    )


def init_model_parallel(tensor: int = 1, pipeline: int = 1, virtual_pipeline: Optional[int] = None,
                        context: int = 1, timeout_minutes: float = 10.0) -> None:
    """megatron's parallel state (TP/PP/CP/DP groups) over the default group.

    ``timeout_minutes`` bounds every collective in these groups: megatron's own
    default (30 minutes) would leave a hung rank's peers waiting that long in
    the gradient reduce or a TP all-reduce, whatever the default group's says.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _release_megatron_groups()
    before = set(_process_groups())
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor,
        pipeline_model_parallel_size=pipeline,
        virtual_pipeline_model_parallel_size=virtual_pipeline,
        context_parallel_size=context,
        distributed_timeout_minutes=timeout_minutes,
    )
    _MEGATRON_GROUPS.extend(g for g in _process_groups() if g not in before)


# The groups the last init_model_parallel created. megatron's destroy_model_parallel
# forgets its groups without destroying them, and every gloo group keeps three
# threads: a process that re-initialises (the tests, hundreds of times) piled up
# thousands of threads and slowed to a crawl.
_MEGATRON_GROUPS: list = []


def _process_groups() -> list:
    return list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []


def _release_megatron_groups() -> None:
    """Destroys the groups of the previous init_model_parallel (this process only)."""
    alive = set(_process_groups())
    for group in _MEGATRON_GROUPS:
        if group in alive:
            dist.destroy_process_group(group)
    _MEGATRON_GROUPS.clear()
    _forget_cached_rotary_tables()


def _forget_cached_rotary_tables() -> None:
    """megatron's rotary embeddings cache ``forward`` with ``lru_cache`` on the module
    itself (32 entries), and the module holds its context-parallel group: the cache
    keeps every model run so far, and its destroyed gloo group with three live
    threads, in memory. The tables are rebuilt on the next forward."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn

    rope.RotaryEmbedding.forward.cache_clear()
    yarn.YarnRotaryEmbedding.forward.cache_clear()


# megatron's DistributedDataParallel wrappers this process built (see release_models).
_DDP_WRAPPERS: weakref.WeakSet = weakref.WeakSet()


def register_ddp(wrapper) -> None:
    """Lets release_models free ``wrapper``."""
    _DDP_WRAPPERS.add(wrapper)


def release_models() -> None:
    """Frees every model built so far once nothing else holds it; for a process that
    builds many (tests, notebooks). Their gradients are no longer reduced after this.

    megatron's DDP registers a hook on every parameter's AccumulateGrad node, a
    closure over the wrapper; the parameter keeps its node alive, the wrapper keeps
    its parameters: a cycle through C++ that gc cannot see, so each model, its
    optimizer and its groups (three threads each) outlived its run. Emptying the
    nodes' hook dicts breaks it. megatron keeps no handles: a no-op hook's handle
    reaches the node's one dict."""
    for wrapper in list(_DDP_WRAPPERS):
        for node in wrapper.grad_accs:
            hooks = node.register_hook(_no_hook).hooks_dict_ref()
            if hooks is not None:
                hooks.clear()
        wrapper.grad_accs.clear()
    _DDP_WRAPPERS.clear()


def _no_hook(*_grads) -> None:
    return None


def set_seed(seed: int) -> None:
    """Seeds Python, NumPy, torch and megatron's model-parallel RNG tracker.

    As Megatron-LM: each pipeline stage runs on seed + 100 * pp_rank, so the
    stages' dropout differs; TP-region dropout also differs per TP rank through
    megatron's tracker (seed + 2718 + tp_rank). The initial weights do not come
    from these streams (``kvtrain.model.init_streams``).
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if parallel_state.model_parallel_is_initialized():
        seed += 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def init_distributed(tensor: int = 1, pipeline: int = 1, virtual_pipeline: Optional[int] = None,
                     context: int = 1, seed: int = 1234,
                     timeout_minutes: float = 10.0, device: str = "auto") -> DistEnv:
    """Process group + megatron parallel state + seeds, in that order."""
    env = init_process_group(timeout_minutes, device)
    init_model_parallel(tensor, pipeline, virtual_pipeline, context, timeout_minutes)
    set_seed(seed)
    return env


def destroy_distributed() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _MEGATRON_GROUPS.clear()
    release_models()
    if dist.is_initialized():
        dist.destroy_process_group()
