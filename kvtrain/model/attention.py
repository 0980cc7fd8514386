"""Core attention modules of kvtrain's ``torch`` and ``local`` backends.

:class:`TorchAttention` is the ``torch`` backend's core attention: PyTorch's
``scaled_dot_product_attention`` (flash / cuDNN / memory-efficient kernels on a
GPU, the fused CPU kernel on the CPU), with GQA handled by the kernel instead of
repeated K/V, and FlexAttention with a document-causal block mask for packed
documents on a GPU. It takes megatron's core-attention call
(``DotProductAttention.forward``): ``query [sq, b, np, hn]``, ``key/value
[sk, b, ng, hn]`` in (this TP rank's heads), ``[sq, b, np*hn]`` out. It has no
parameters, so a checkpoint of one backend loads on the other.

:class:`LocalDotProductAttention` is megatron's ``DotProductAttention`` (the
reference, s x s scores) that also accepts kvtrain's :class:`DocumentParams`,
turning its document ids into megatron's explicit mask.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from kvtrain.config.backend import document_attention

from .context_parallel import chunk_starts, cp_group, gather_sequence
from .documents import DocumentParams


@functools.lru_cache(maxsize=None)
def sdpa_has_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    q = torch.zeros(1, 2, 1, 2)
    try:
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def compiled_flex_attention():
    """FlexAttention compiled once per process (uncompiled it materialises scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def document_block_mask(doc_ids: Tensor):
    """FlexAttention's block mask of ``doc_ids [b, s]``: causal within each document."""
    from torch.nn.attention.flex_attention import create_block_mask

    b, s = doc_ids.shape

    def document_causal(batch, head, q_idx, kv_idx):
        return (doc_ids[batch, q_idx] == doc_ids[batch, kv_idx]) & (q_idx >= kv_idx)

    return create_block_mask(document_causal, B=b, H=None, Q_LEN=s, KV_LEN=s,
                             device=doc_ids.device)


class TorchAttention(MegatronModule):
    """megatron's core attention on ``torch.nn.functional.scaled_dot_product_attention``."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        super().__init__(config=config)
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise ValueError("the torch backend has causal attention with a plain softmax "
                             "only (no sliding window, no softmax offset)")
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels  # MLA: K (and Q) wider than V
        # megatron's query-key layer scaling divides and re-multiplies by the layer
        # number (fp16 range only), so the effective scale is the plain one
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.documents_kernel = document_attention(
            "torch", torch.cuda.is_available(), self.dropout, config.context_parallel_size,
            min(head_dim, v_channels or config.kv_channels))

    def keeps_value(self, documents: bool) -> bool:
        """Whether this attention keeps the ``value`` it is given for its backward, with
        or without ``documents``: where kvtrain's QKV node made it, a view of the QKV
        output, which then stays alive until the node's backward. SDPA keeps its inputs
        (tested); not an older torch's SDPA with GQA, which takes repeated copies
        (``_sdpa``), nor context parallelism, which gathers K and V (the node does not
        run there). Compiled FlexAttention (documents on a GPU) keeps them too, GQA
        included (``enable_gqa``: no copies): what it saves is its compiler's choice,
        seen on an H200 with torch 2.11 (the ``gpu`` test holds it)."""
        c = self.config
        if cp_group() is not None:
            return False
        if documents and self.documents_kernel == "flex" and torch.cuda.is_available():
            return True
        return sdpa_has_gqa() or c.num_query_groups in (None, c.num_attention_heads)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if attention_bias is not None:
            raise ValueError("attention_bias is not supported by the torch backend")
        if packed_seq_params is not None and not isinstance(packed_seq_params, DocumentParams):
            raise ValueError("THD packed sequences need Transformer Engine's attention "
                             "(model.backend: te)")
        sq, b, heads, hn = query.shape
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        group = cp_group()
        if group is not None:
            attend = functools.partial(self._attend_context_parallel, query, key, value, group,
                                       attention_mask, mask_type, packed_seq_params)
        else:
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, hn]
            attend = functools.partial(self._attend, q, k, v, attention_mask, mask_type,
                                       packed_seq_params)
        if self.training and self.dropout > 0 and not self.config.sequence_parallel:
            # as megatron: dropout draws differ per TP rank (the model-parallel stream)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        # [sq, b, np*hv]; hv = hn but for MLA (v_head_dim)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * out.shape[-1])

    def _attend_context_parallel(self, query: Tensor, key: Tensor, value: Tensor, group,
                                 attention_mask: Optional[Tensor], mask_type: AttnMaskType,
                                 documents: Optional[DocumentParams]) -> Tensor:
        """Attention of this CP rank's two query chunks over the whole sequence's keys.

        K and V are all-gathered over the CP group into sequence order (the
        scheme Llama 3 used; the backward reduce-scatters their gradients to the
        owners); each local chunk then attends the keys up to its own end,
        bottom-right causal, within its documents. ``[b, np, 2c, hn]`` out.
        """
        if attention_mask is not None or mask_type != AttnMaskType.causal:
            raise ValueError("context parallelism on the torch backend needs causal attention "
                             "without an explicit mask")
        k_all, v_all = (gather_sequence(x, group).permute(1, 2, 0, 3)  # [b, ng, S, hn]
                        for x in (key, value))
        c = query.shape[0] // 2
        rank, cp = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        outs = []
        for part, start in zip((query[:c], query[c:]), chunk_starts(2 * c, cp, rank)):
            end = start + c  # the chunk sees keys [0, end)
            q = part.permute(1, 2, 0, 3)  # [b, np, c, hn]
            allowed = torch.ones(c, end, dtype=torch.bool, device=q.device).tril(start)
            if documents is not None:
                ids = documents.global_doc_ids  # [b, S]
                same = ids[:, start:end, None] == ids[:, None, :end]  # [b, c, end]
                allowed = (allowed & same)[:, None]  # [b, 1, c, end]
            outs.append(self._sdpa(q, k_all[:, :, :end], v_all[:, :, :end], allowed, False))
        return torch.cat(outs, dim=2)  # [b, np, 2c, hn]

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, attention_mask: Optional[Tensor],
                mask_type: AttnMaskType, documents: Optional[DocumentParams]) -> Tensor:
        """``[b, np, sq, hn]`` attention of ``q [b, np, sq, hn]`` over ``k/v [b, ng, sk, hn]``."""
        if documents is not None and self.documents_kernel == "flex" and q.is_cuda:
            block_mask = documents.derived("block_mask", document_block_mask)
            return compiled_flex_attention()(q, k, v, block_mask=block_mask,
                                             scale=self.softmax_scale, enable_gqa=True)
        allowed, causal = None, False
        if documents is not None:
            allowed = ~documents.mask()  # [b, 1, s, s], built once per micro batch
        elif attention_mask is not None:
            allowed = ~attention_mask  # megatron: True = masked; SDPA: True = attend
        elif mask_type == AttnMaskType.causal:
            sq, sk = q.shape[2], k.shape[2]
            causal = sq == sk
            if not causal:  # queries are the last sq of sk positions (bottom-right)
                allowed = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        return self._sdpa(q, k, v, allowed, causal)

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor],
              causal: bool) -> Tensor:
        """SDPA with GQA (``k/v`` may have fewer heads), ``allowed``: True = attend."""
        extra = {}
        if k.shape[1] != q.shape[1]:
            if sdpa_has_gqa():
                extra["enable_gqa"] = True
            else:  # older torch: repeat each KV head for its group's query heads
                k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
                v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, is_causal=causal, scale=self.softmax_scale,
            dropout_p=self.dropout if self.training else 0.0, **extra)


class LocalDotProductAttention(DotProductAttention):
    """megatron's ``DotProductAttention`` that reads documents from :class:`DocumentParams`
    (as its explicit ``[b, 1, s, s]`` mask, built once per micro batch) and takes
    MLA's head widths (``k_channels``/``v_channels``, as TE's attention does)."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, cp_comm_type: Optional[str] = None,
                 pg_collection=None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None):
        # megatron's kernel sizes its output from kv_channels: MLA sets it to v_head_dim
        if v_channels is not None and v_channels != config.kv_channels:
            raise ValueError(f"local attention needs config.kv_channels ({config.kv_channels}) "
                             f"= the value head width ({v_channels})")
        if k_channels is not None and softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels)
        super().__init__(config, layer_number, attn_mask_type, attention_type,
                         attention_dropout, softmax_scale, cp_comm_type, pg_collection)

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Optional[Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[Tensor] = None, packed_seq_params=None) -> Tensor:
        if isinstance(packed_seq_params, DocumentParams):
            attention_mask, packed_seq_params = packed_seq_params.mask(), None
        return super().forward(query, key, value, attention_mask, attn_mask_type,
                               attention_bias, packed_seq_params)


__all__ = ["LocalDotProductAttention", "TorchAttention", "compiled_flex_attention",
           "document_block_mask", "sdpa_has_gqa"]
