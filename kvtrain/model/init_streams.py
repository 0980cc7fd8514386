"""Initial weights that do not depend on the pipeline layout.

megatron draws every initial weight of a rank from that rank's one random
stream, in construction order. With every rank seeded alike, stage 1 of a
pipeline drew its first layer from the draws stage 0 spent on its embedding
and first layers; Megatron-LM's remedy (seed + 100 * pipeline rank) makes the
stages differ but still gives a model that changes with the layout.

Here each transformer layer is built inside a stream of its own, seeded by
(seed, global layer number), and the modules built after a layer (the final
norm and output layer after the last one) draw from a stream seeded by
(seed, that layer): the weights are a function of the seed and the position
in the model alone, so a PP=2 model is the PP=1 model cut in two. The model
as a whole is built inside a stream seeded by (seed, "model") (the embedding
draws from it first), and the caller's streams are restored afterwards.
Within a stream megatron's rules hold unchanged: CPU initialisation draws the
full master weight and slices the TP shard; on a GPU the TP-sharded weights
come from the tensor-parallel tracker (seed + 2718 + TP rank).
"""

from __future__ import annotations

import copy
import functools
import hashlib
from contextlib import contextmanager
from typing import Iterator

import torch

from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker, model_parallel_cuda_manual_seed
from megatron.core.utils import get_pg_rank
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    get_transformer_layer_offset,
)


def stream_seed(seed: int, key: str) -> int:
    """A seed for the stream ``key`` of ``seed`` (62 bits: megatron adds offsets)."""
    digest = hashlib.sha256(f"{seed}/init/{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 62) - 1)


def _real_cuda() -> bool:
    # the CPU backend maps torch.cuda's RNG calls onto the CPU generator
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def seed_stream(seed: int, key: str) -> None:
    """Seeds the default generators and megatron's tracker with the stream ``key``."""
    s = stream_seed(seed, key)
    torch.manual_seed(s)
    if parallel_state.model_parallel_is_initialized():
        model_parallel_cuda_manual_seed(s)
    else:  # a model built outside a process group (tests, tools): one rank
        model_parallel_cuda_manual_seed(s, tp_rank=0, ep_rank=0, etp_rank=0)


@contextmanager
def own_streams(seed: int, key: str) -> Iterator[None]:
    """Runs the block in the stream ``key`` and gives the caller its streams back."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state() if _real_cuda() else None
    tracker = get_cuda_rng_tracker().get_states()
    try:
        seed_stream(seed, key)
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
        get_cuda_rng_tracker().set_states(tracker)


class _SeededLayer:
    """Mixin of a megatron ``TransformerLayer`` (sub)class: the layer is initialised
    from the stream of its global number; what is built after it, from the stream
    after it."""

    def __init__(self, config, submodules, layer_number: int = 1, *args, init_seed: int,
                 **kwargs):
        # the global number, as TransformerLayer computes it
        groups = kwargs.get("pg_collection")
        if groups is not None:
            pp_rank = get_pg_rank(groups.pp)
        else:
            pp_rank = None if parallel_state.model_parallel_is_initialized() else 0
        number = layer_number + get_transformer_layer_offset(config, kwargs.get("vp_stage"),
                                                             pp_rank)
        with own_streams(init_seed, f"layer/{number}"):
            super().__init__(config, submodules, layer_number, *args, **kwargs)
        seed_stream(init_seed, f"after/{number}")


@functools.lru_cache(maxsize=None)
def _seeded(layer_class: type) -> type:
    return type(f"Seeded{layer_class.__name__}", (_SeededLayer, layer_class), {})


def seeded_layer_spec(spec, seed: int):
    """``spec`` (a TransformerLayer spec) with its layers drawn from their own streams."""
    if not (isinstance(spec.module, type) and issubclass(spec.module, TransformerLayer)):
        raise ValueError(f"seeded_layer_spec expects a TransformerLayer spec, got {spec.module}")
    seeded = copy.copy(spec)
    seeded.module = _seeded(spec.module)
    seeded.params = {**(spec.params or {}), "init_seed": seed}
    return seeded
