"""The KV shift under context parallelism: the halo exchange.

A CP rank holds chunks ``r`` and ``2·CP−1−r`` of the sequence
(``kvtrain.model.context_parallel``). The shift mixes each token with its ``w``
predecessors, so the first ``w`` tokens of a chunk need the raw (unshifted)
K/V of the ``w`` tokens before it, which another rank holds:

* before chunk ``r``: the end of chunk ``r−1``, rank ``r−1``'s first chunk
  (nothing, i.e. zeros, for ``r = 0``: the sequence start);
* before chunk ``2·CP−1−r``: the end of chunk ``2·CP−2−r``, which is rank
  ``r+1``'s second chunk, or for ``r = CP−1`` this rank's own first chunk.

Every rank all-gathers the last ``w`` raw tokens of both its chunks over the CP
group (``2w`` tokens a rank, autograd-aware: the gradient of a halo token is
reduce-scattered back to its owner) and picks its neighbours'. Packed
documents: a halo token of another document counts as zero, as inside a chunk
(its document id comes from the full sequence's ids, no exchange needed).

This runs in ``KVShiftSelfAttention.get_query_key_value_tensors``, before RoPE
and the core attention, so it is the same for every backend and CP
communication type.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

from .context_parallel import joined_doc_ids
from .shift_kernels import fused_shift


def exchange_halo(x: Tensor, window: int, group) -> Tensor:
    """The raw tokens before this rank's two chunks: ``[w, 2b, h, d]`` (chunk 0's
    halo in batch rows ``:b``, chunk 1's in ``b:``), from ``x [2c, b, h, d]``."""
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    c = x.shape[0] // 2
    if window > c:
        raise ValueError(f"the KV-shift window ({window}) is longer than a context-parallel "
                         f"chunk ({c} tokens)")
    tails = torch.cat([x[c - window:c], x[2 * c - window:]], dim=0)  # [2w, b, h, d]
    gathered = gather_from_sequence_parallel_region(tails.contiguous(), True, group)
    gathered = gathered.unflatten(0, (cp, 2, window))  # [cp, 2 chunks, w, b, h, d]
    if rank > 0:
        first = gathered[rank - 1, 0]  # the end of chunk r-1
    else:
        first = torch.zeros_like(gathered[0, 0])  # the sequence start
    if rank < cp - 1:
        second = gathered[rank + 1, 1]  # the end of chunk 2cp-2-r
    else:
        second = gathered[rank, 0]  # chunk cp-1, this rank's own first chunk
    return torch.cat([first, second], dim=1)  # [w, 2b, h, d]


def shift_context_parallel(x: Tensor, coef: Tensor, group,
                           global_doc_ids: Optional[Tensor] = None,
                           impl: str = "auto") -> Tensor:
    """The KV shift of this CP rank's tokens ``x [2c, b, h, d]`` with coefficients
    ``coef [h, w+1]``: equal to the shift of the whole sequence, sliced.

    ``global_doc_ids``: ``[b, S]`` document ids of the whole sequence (packed
    documents) or None. Both chunks are shifted in one call, side by side in
    the batch dimension, each preceded by its halo. ``impl``: the shift's kernel
    (``model.kv_shift.kernel``), as without context parallelism.
    """
    window = coef.shape[1] - 1
    s, b = x.shape[0], x.shape[1]
    c = s // 2
    if window == 0:
        return fused_shift(x, coef, impl=impl)
    halo = exchange_halo(x, window, group)  # [w, 2b, h, d]
    chunks = torch.cat([x[:c], x[c:]], dim=1)  # [c, 2b, h, d]
    joined = torch.cat([halo, chunks], dim=0)  # [w + c, 2b, h, d]
    cp, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    ids = joined_doc_ids(global_doc_ids, s, window, cp, rank)  # [w + c, 2b] or None
    out = fused_shift(joined, coef, ids, impl=impl)[window:]  # [c, 2b, h, d]
    return torch.cat([out[:, :b], out[:, b:]], dim=0)  # [2c, b, h, d]


__all__ = ["exchange_halo", "shift_context_parallel"]
