"""Context parallelism (CP): megatron's sequence layout, and gathering it back.

Under CP a micro batch's sequence of ``S`` tokens is cut into ``2·CP`` chunks of
``c = S / (2·CP)`` tokens and CP rank ``r`` keeps chunks ``r`` and
``2·CP−1−r`` (megatron's ``get_batch_on_this_cp_rank``: each rank gets one early
and one late chunk, so causal attention costs the same on every rank). Its
local sequence is those two chunks end to end, ``2c`` tokens.

* :func:`split_micro_batch` slices a micro batch (tokens, labels, loss mask,
  position ids, accuracy masks: every ``[b, S]`` tensor) and its
  :class:`DocumentParams` for this rank, once per micro batch;
* :func:`gather_sequence` all-gathers a ``[2c, ...]`` tensor of every rank back
  into the global order ``[S, ...]``, with autograd (the gradient of each slice
  is summed over the ranks that used it and lands on its owner);
* :func:`chunk_starts` says where this rank's chunks start in the sequence
  (the KV-shift halo and the attention's causal offsets need it).

RoPE needs nothing from here: megatron's rotary embedding slices its table the
same way (``get_pos_emb_on_this_cp_rank``), so each chunk gets its true positions.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .documents import DocumentParams


def cp_group():
    """megatron's context-parallel group, or None when CP is 1 (or not initialised)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_context_parallel_group(check_initialized=False)
    if group is None or torch.distributed.get_world_size(group) == 1:
        return None
    return group


def chunk_starts(local_length: int, cp: int, rank: int) -> tuple[int, int]:
    """Sequence positions where this rank's two chunks start (local length ``2c``)."""
    c = local_length // 2
    return rank * c, (2 * cp - 1 - rank) * c


def local_positions(seq_length: int, cp: int, rank: int, device=None) -> Tensor:
    """``[2c]`` sequence positions of CP rank ``rank``'s tokens, in local order."""
    c = seq_length // (2 * cp)
    first, second = chunk_starts(2 * c, cp, rank)
    return torch.cat([torch.arange(first, first + c, device=device),
                      torch.arange(second, second + c, device=device)])


def slice_sequence(t: Tensor, cp: int, rank: int, dim: int = 1) -> Tensor:
    """This rank's two chunks of ``t`` along ``dim`` (length ``S`` -> ``2c``)."""
    s = t.shape[dim]
    if s % (2 * cp):
        raise ValueError(f"sequence length {s} is not a multiple of 2 x CP ({2 * cp})")
    c = s // (2 * cp)
    chunks = t.unflatten(dim, (2 * cp, c))  # [..., 2cp, c, ...]
    index = torch.tensor([rank, 2 * cp - 1 - rank], device=t.device)
    return chunks.index_select(dim, index).flatten(dim, dim + 1)


def split_micro_batch(batch: dict, packed, group) -> tuple[dict, object]:
    """This CP rank's part of a micro batch (every ``[b, S]`` tensor) and of its
    documents: the :class:`DocumentParams` keep the full ``[b, S]`` ids as
    ``global_doc_ids`` (the KV-shift halo and the attention masks read them)."""
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    out = {k: slice_sequence(v, cp, rank) if torch.is_tensor(v) and v.dim() == 2 else v
           for k, v in batch.items()}
    if isinstance(packed, DocumentParams):
        # max_seqlen stays S: megatron sizes RoPE from it, then slices it per CP rank
        packed = dataclasses.replace(packed, doc_ids=slice_sequence(packed.doc_ids, cp, rank),
                                     global_doc_ids=packed.doc_ids, cache={})
    elif packed is not None:
        raise ValueError("context parallelism splits sbhd batches only (THD packing with "
                         "CP is not supported)")
    return out, packed


def context_parallel_share(batch: dict, packed=None) -> tuple[dict, object]:
    """This CP rank's two chunks of a micro batch (``[b, S]`` -> ``[b, 2c]``) and of
    its documents; unchanged without context parallelism. The trainer's loss is
    then each rank's sum over its own tokens: megatron adds the token counts and
    gradients over DP x CP once (``finalize_model_grads``), and the reported loss
    adds the sums of every rank (``kvtrain.train.step.reduce_losses``)."""
    group = cp_group()
    if group is None:
        return batch, packed
    return split_micro_batch(batch, packed, group)


def gather_sequence(x: Tensor, group) -> Tensor:
    """``[2c, ...]`` local tensors of all CP ranks -> ``[S, ...]`` in sequence order.

    megatron's all-gather (backward: reduce-scatter) stacks the ranks' local
    sequences ``[r0 chunk 0, r0 chunk 2cp-1, r1 chunk 1, ...]``; the index puts
    global chunk ``j`` (rank ``j``'s first, or rank ``2cp-1-j``'s second) in place.
    """
    cp = torch.distributed.get_world_size(group)
    gathered = gather_from_sequence_parallel_region(x.contiguous(), True, group)  # [cp*2c, ...]
    c = x.shape[0] // 2
    order = [2 * j if j < cp else 2 * (2 * cp - 1 - j) + 1 for j in range(2 * cp)]
    chunks = gathered.unflatten(0, (2 * cp, c))  # [2cp, c, ...] in gathered order
    index = torch.tensor(order, device=x.device)
    return chunks.index_select(0, index).flatten(0, 1)


def gather_batch_sequence(x: Tensor, group, dim: int = 1) -> Tensor:
    """:func:`gather_sequence` of a ``[b, 2c, ...]`` tensor (no autograd needed:
    logits and labels for tests and reports)."""
    moved = x.movedim(dim, 0)
    return gather_sequence(moved, group).movedim(0, dim)


def joined_doc_ids(global_ids: Optional[Tensor], local_length: int, window: int, cp: int,
                   rank: int) -> Optional[Tensor]:
    """``[w + c, 2b]`` document ids of this rank's two chunks, each preceded by
    its ``w`` halo tokens (the chunk order of the KV-shift halo: chunk 0's rows,
    then chunk 1's); ``-1`` before the sequence start. None without documents."""
    if global_ids is None:
        return None
    c = local_length // 2
    parts = []
    for start in chunk_starts(local_length, cp, rank):
        pos = torch.arange(start - window, start + c, device=global_ids.device)  # [w + c]
        ids = global_ids.index_select(1, pos.clamp(min=0))  # [b, w + c]
        parts.append(ids.masked_fill(pos[None] < 0, -1))
    return torch.cat(parts, dim=0).transpose(0, 1).contiguous()  # [w + c, 2b]


__all__ = ["chunk_starts", "context_parallel_share", "cp_group", "gather_batch_sequence", "gather_sequence",
           "joined_doc_ids", "local_positions", "slice_sequence", "split_micro_batch"]
