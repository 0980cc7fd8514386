"""Packed documents: document ids computed once per micro batch, handed to the layers.

With ``data.reset_attention_mask`` a training sequence holds several documents,
each ended by the EOD token. The trainer's forward step turns the tokens into
document ids once per micro batch (:func:`document_ids`, on the device, no host
sync) and gives them to ``GPTModel`` through megatron's own channel for such
things, ``packed_seq_params``, which reaches every layer's attention (also when
it is recomputed, and on every pipeline stage):

* ``torch`` and ``local``: a :class:`DocumentParams` (``qkv_format="sbhd"``,
  the batch keeps its ``[b, s]`` shape) carrying the ids. The KV shift resets
  at their boundaries; the core attention derives its mask from them once per
  micro batch (cached on the object and shared by all layers): a FlexAttention
  block mask, or an explicit ``[b, 1, s, s]`` mask;
* ``te``: THD packing (:func:`pack_thd`): the micro batch becomes one row of
  ``b*s`` tokens and ``cu_seqlens`` marks every document and row start, which
  Transformer Engine's attention, megatron's RoPE and the KV shift all read.

A document's EOD token belongs to that document (megatron's
``reset_attention_mask``: the token after an EOD starts a new document).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams


def document_ids(tokens: Tensor, eod: int) -> Tensor:
    """``[b, s]`` int32 index of each token's document within its row: the number
    of EOD tokens strictly before it."""
    ends = (tokens == eod).to(torch.int32)  # [b, s]
    return ends.cumsum(1, dtype=torch.int32) - ends


def document_causal_mask(doc_ids: Tensor) -> Tensor:
    """``[b, 1, s, s]`` bool, megatron's convention (True = masked): key ``j`` is
    hidden from query ``i`` when ``j > i`` or they are in different documents."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()  # [s, s]
    same = doc_ids[:, :, None] == doc_ids[:, None, :]  # [b, s, s]
    return ~(same & causal)[:, None]


@dataclass
class DocumentParams(PackedSeqParams):
    """``packed_seq_params`` for unpacked (``sbhd``) batches that hold several documents.

    megatron passes it untouched to every layer's attention; only kvtrain's
    modules read ``doc_ids`` (the KV shift, the ``torch`` and ``local`` core
    attentions). ``max_seqlen_q/kv`` is the full sequence length: megatron sizes
    RoPE from it whenever ``packed_seq_params`` is given.
    """

    doc_ids: Optional[Tensor] = None
    """``[b, s]`` int32 document index of every token (:func:`document_ids`); under
    context parallelism, of this CP rank's tokens only."""
    global_doc_ids: Optional[Tensor] = None
    """Under context parallelism: the ``[b, S]`` ids of the whole sequence (the
    KV-shift halo and the attention over gathered keys read them); else None."""
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    """Masks derived from ``doc_ids``, built by the first layer that needs them."""

    @classmethod
    def from_ids(cls, doc_ids: Tensor) -> "DocumentParams":
        s = doc_ids.shape[1]
        return cls(qkv_format="sbhd", max_seqlen_q=s, max_seqlen_kv=s, doc_ids=doc_ids)

    def derived(self, key: str, build: Callable[[Tensor], object]) -> object:
        """``build(doc_ids)``, computed once per micro batch and shared by all layers."""
        if key not in self.cache:
            self.cache[key] = build(self.doc_ids)
        return self.cache[key]

    def mask(self) -> Tensor:
        """The explicit ``[b, 1, s, s]`` document-causal mask (True = masked)."""
        return self.derived("mask", document_causal_mask)


def cu_seqlens(doc_ids: Tensor) -> Tensor:
    """int32 ``[n + 1]`` offsets of the ``n`` documents of ``doc_ids [b, s]`` laid
    end to end (row after row); a row start always starts a document."""
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)  # [b, s]
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # nonzero is the one host sync of THD packing, once per micro batch
    offsets = starts.reshape(-1).nonzero().reshape(-1).to(torch.int32)
    end = torch.tensor([b * s], dtype=torch.int32, device=doc_ids.device)
    return torch.cat([offsets, end])


def pack_thd(batch: dict, doc_ids: Tensor) -> tuple[dict, PackedSeqParams]:
    """The micro batch as one THD row (``[1, b*s]`` tensors) and its ``PackedSeqParams``.

    Not run by the CPU tests (Transformer Engine's attention is GPU-only); the
    offsets are checked by tests/train/test_packed_documents.py.
    """
    b, s = doc_ids.shape
    cu = cu_seqlens(doc_ids)
    flat = {k: (v.reshape(1, b * s) if torch.is_tensor(v) and v.dim() == 2 else v)
            for k, v in batch.items()}
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=s, max_seqlen_kv=s)
    return flat, params


@dataclass(frozen=True)
class Documents:
    """How the forward step hands documents to the model (None: no separation)."""

    eod: int
    """The end-of-document token id."""
    thd: bool
    """True on ``te`` (THD packing), False on ``torch``/``local`` (DocumentParams)."""

    def __call__(self, batch: dict) -> tuple[dict, PackedSeqParams]:
        """``batch`` (``[b, s]`` tensors) -> (the batch to run, its ``packed_seq_params``)."""
        ids = document_ids(batch["tokens"], self.eod)
        if self.thd:
            return pack_thd(batch, ids)
        return batch, DocumentParams.from_ids(ids)


def doc_ids_from_cu_seqlens(cu_seqlens: Tensor, total: int) -> Tensor:
    """Document index of each of ``total`` packed (THD) tokens, ``[total, 1]``."""
    starts = torch.zeros(total, dtype=torch.int32, device=cu_seqlens.device)
    inner = cu_seqlens[1:-1].long()
    inner = inner[inner < total]
    starts[inner] = 1
    return starts.cumsum(0)[:, None]


def doc_ids_from_attention_mask(mask: Tensor, s: int, b: int) -> Optional[Tensor]:
    """Document index ``[s, b]`` from a ``[b|1, 1, s, s]`` mask (True = masked).

    A token whose immediate predecessor is masked starts a new document (this is
    how megatron's ``reset_attention_mask`` separates documents). Returns None
    when no token in the batch starts a document after position 0. Only for
    callers that pass their own mask: the trainer hands the layers document ids
    (``DocumentParams``), which need neither this per-layer pass nor its host sync.
    """
    if mask is None or mask.dim() != 4 or mask.shape[-1] != s or mask.shape[-2] != s:
        return None
    sub = mask[:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)  # [b|1, s-1]: can t see t-1?
    if sub.dtype != torch.bool:
        sub = sub < -1e4 if sub.is_floating_point() else sub.bool()
    if not bool(sub.any()):
        return None
    starts = torch.nn.functional.pad(sub.to(torch.int32), (1, 0))  # [b|1, s]
    return starts.cumsum(1).expand(b, s).transpose(0, 1)


__all__ = ["DocumentParams", "Documents", "cu_seqlens", "doc_ids_from_attention_mask",
           "doc_ids_from_cu_seqlens", "document_causal_mask", "document_ids", "pack_thd"]
