"""Packed documents through the trainer's data path (``data.reset_attention_mask``).

A run is built in-process on the tokenized test corpus; its micro batches go
through the trainer's ``ForwardStep``, which computes the document ids once per
micro batch and hands them to the layers. Each document's per-token loss in the
packed batch equals that document run alone (fp32, 1e-5), on ``torch`` and
``local``, vanilla and KV shift. Also: the THD packing ``te`` gets, and the
refusal where a kernel would ignore the mask.
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ConfigError, RunConfig
from kvtrain.config.backend import BackendChoice, check_document_masks, decide_backend
from kvtrain.config.loader import from_dict
from kvtrain.model.documents import Documents, cu_seqlens, document_ids, pack_thd
from kvtrain.train.step import schedule_shape

from .conftest import tiny_config

SEQ = 64


def packed_run(corpus, cache_dir, tmp_path, backend: str, attention: str):
    from kvtrain.train.setup import build_run

    cfg = tiny_config(corpus, cache_dir, model={"backend": backend, "attention": attention},
                      data={"reset_attention_mask": True},
                      train={"seq_length": SEQ, "global_batch_size": 2, "max_steps": 20})
    return build_run(from_dict(RunConfig, cfg), tmp_path)


def rows_with_documents(run, wanted: int = 2) -> list[dict]:
    """Micro batches of the run's training data whose rows hold several documents."""
    from kvtrain.train.loop import _data_iterators

    eod, found = run.documents.eod, []
    for batch in _data_iterators(run, 0)[0]:
        assert "attention_mask" not in batch  # no [b, 1, s, s] mask from the dataset
        inner = (batch["tokens"][:, :-1] == eod).any(dim=1)
        if inner.any():
            found.append(batch)
        if len(found) == wanted:
            return found
    raise AssertionError("the corpus gave no sequence holding two documents")


def per_token_loss(run, batch: dict, documents) -> torch.Tensor:
    """The loss ``[b, s]`` the trainer's forward step computes for ``batch``."""
    from kvtrain.train.step import ForwardStep

    output, _ = ForwardStep(documents=documents)(iter([batch]), run.model[0])
    return output.detach()


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_each_document_alone_equals_packed(single_rank, corpus, cache_dir, tmp_path, backend,
                                           attention):
    run = packed_run(corpus, cache_dir, tmp_path, backend, attention)
    assert run.backend.name == backend
    assert run.backend.documents == ("sdpa+mask" if backend == "torch" else "mask")
    assert "documents: " in run.backend.describe()
    # what computed the shift is recorded: the native C++ operators on this CPU
    assert run.backend.shift_kernel == ("native (auto: CPU)" if attention == "kv_shift" else None)
    checked = 0
    for batch in rows_with_documents(run):
        packed = per_token_loss(run, batch, run.documents)
        ids = document_ids(batch["tokens"], run.documents.eod)
        leaky = per_token_loss(run, batch, None)  # attention and shift across documents
        for row in range(ids.shape[0]):
            for doc in ids[row].unique().tolist():
                where = (ids[row] == doc).nonzero().reshape(-1)
                a, b = int(where[0]), int(where[-1]) + 1
                alone = {k: v[row:row + 1, a:b] for k, v in batch.items()}
                torch.testing.assert_close(packed[row, a:b],
                                           per_token_loss(run, alone, None)[0],
                                           atol=1e-5, rtol=1e-5)
                checked += a > 0
                if a > 0:  # a later document: without separation its loss differs
                    assert not torch.allclose(leaky[row, a:b], packed[row, a:b], atol=1e-4)
    assert checked >= 2


def test_document_ids_and_thd_offsets():
    eod = 0
    tokens = torch.tensor([[5, 0, 7, 8, 0, 9], [0, 3, 4, 5, 6, 0]])
    ids = document_ids(tokens, eod)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 1, 1, 1, 1]]  # EOD ends its document
    assert cu_seqlens(ids).tolist() == [0, 2, 5, 6, 7, 12]  # row starts start documents
    batch = {"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(2, 6),
             "position_ids": torch.arange(6).expand(2, 6)}
    flat, params = Documents(eod=eod, thd=True)(batch)
    assert flat["tokens"].shape == (1, 12) and flat["loss_mask"].shape == (1, 12)
    assert params.qkv_format == "thd" and params.max_seqlen_q == 6
    assert params.cu_seqlens_q.dtype == torch.int32
    assert torch.equal(pack_thd(batch, ids)[1].cu_seqlens_kv, params.cu_seqlens_q)
    # pipeline messages are sized for one row of b*s tokens
    assert schedule_shape(Documents(eod, thd=True), 6, 2) == (12, 1)
    assert schedule_shape(Documents(eod, thd=False), 6, 2) == schedule_shape(None, 6, 2) == (6, 2)
    same, docs = Documents(eod=eod, thd=False)(batch)
    assert same is batch and torch.equal(docs.doc_ids, ids) and docs.qkv_format == "sbhd"
    mask = docs.mask()  # [b, 1, s, s], True = masked; built once and cached
    assert mask is docs.mask() and mask.shape == (2, 1, 6, 6)
    assert not mask[0, 0, 3, 2] and mask[0, 0, 2, 1] and mask[0, 0, 2, 3]


def test_documents_refused_only_where_a_kernel_ignores_the_mask():
    cfg = from_dict(RunConfig, {"data": {"reset_attention_mask": True, "eod_id": 0},
                                "train": {"seq_length": 1024}})
    fused_local = decide_backend("local", cuda=True, te_error=None, fused_softmax=True)
    with pytest.raises(ConfigError, match="^data.reset_attention_mask: true is refused.*"
                                          "model.backend: torch"):
        check_document_masks(cfg, fused_local, half=True)
    for choice in (decide_backend("auto", cuda=True, te_error=None, fused_softmax=True),  # te
                   decide_backend("torch", cuda=True, te_error=None, fused_softmax=True),
                   BackendChoice("local", "local", "cpu", fused_softmax=False)):
        check_document_masks(cfg, choice, half=True)  # THD, torch's own masks, torch softmax
