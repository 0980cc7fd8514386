"""Every rank's random states in a checkpoint: Python, NumPy, torch, CUDA and
megatron's tensor-parallel tracker, so that a resume draws what an uninterrupted
run would (dropout, data order). Restored only on the layout and the kind of
device they were saved from (``Checkpointer.load``)."""

from __future__ import annotations

import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject


def rng_state() -> dict:
    """This rank's RNG states (Python, NumPy, torch, CUDA, megatron's TP tracker)."""
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def restore_rng_state(state: dict) -> Optional[str]:
    """Restores ``state`` (this rank's, from :func:`rng_state`); or, when it was saved
    on another kind of device, says so and keeps this process's states: a GPU's
    generator states (16 bytes) cannot seed the CPU's (5056), nor the reverse, and
    megatron's tracker would fail at its first fork (dropout in a TP region)."""
    saved_on_gpu = state.get("cuda") is not None  # rng_state() saves None on the CPU
    if saved_on_gpu != torch.cuda.is_available():
        return f"saved on {'a GPU' if saved_on_gpu else 'the CPU'}"
    set_rng_state(state)
    return None


def rng_sharded_object() -> ShardedObject:
    """Every rank's RNG state: one object per (PP, TP) position holding the list
    over data-parallel ranks (gathered here), saved by DP rank 0."""
    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    states = [None] * dist.get_world_size(group)
    dist.all_gather_object(states, rng_state(), group=group)
    pp = parallel_state.get_pipeline_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_rank()
    return ShardedObject(
        "rng_state", states,
        (parallel_state.get_pipeline_model_parallel_world_size(),
         parallel_state.get_tensor_model_parallel_world_size()),
        (pp, tp),
        replica_id=parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )
