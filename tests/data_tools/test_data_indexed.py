"""The .bin/.idx files: byte-identical to megatron's builder, readable by
megatron's IndexedDataset, and agreeing with an independent reader written
here from the documented byte layout."""

from __future__ import annotations

import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.indexed import IndexedReader, IndexedWriter, token_dtype  # noqa: E402
from data_tools.preprocess import preprocess  # noqa: E402


def megatron_indexed():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets import indexed_dataset
    return indexed_dataset


def independent_read(prefix: str) -> dict:
    """Reader from the layout alone (struct, no numpy, no data_tools):
    magic, u64 version, u8 dtype code, u64 S, u64 D, i32[S] lengths,
    i64[S] pointers, i64[D] document indices; .bin holds the tokens."""
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    assert idx[:9] == b"MMIDIDX\x00\x00"
    version, code, S, D = struct.unpack_from("<QBQQ", idx, 9)
    fmt = {8: ("H", 2), 4: ("i", 4)}[code]
    lengths = list(struct.unpack_from(f"<{S}i", idx, 34))
    pointers = list(struct.unpack_from(f"<{S}q", idx, 34 + 4 * S))
    doc_idx = list(struct.unpack_from(f"<{D}q", idx, 34 + 12 * S))
    assert 34 + 12 * S + 8 * D == len(idx), "trailing bytes in .idx"
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    seqs = [list(struct.unpack_from(f"<{n}{fmt[0]}", data, p)) for n, p in zip(lengths, pointers)]
    docs = [sum(seqs[doc_idx[i]:doc_idx[i + 1]], []) for i in range(D - 1)]
    return {"version": version, "code": code, "lengths": lengths, "pointers": pointers,
            "doc_idx": doc_idx, "docs": docs, "bin_size": len(data)}


@pytest.mark.parametrize("dtype,high", [(np.uint16, 65000), (np.int32, 200_000)])
@pytest.mark.parametrize("n_docs", [0, 1, 257])
def test_writer_is_byte_identical_to_megatron_builder(tmp_path, dtype, high, n_docs):
    import torch

    idx_mod = megatron_indexed()
    docs = h.random_documents(np.random.default_rng(n_docs), n_docs, high)
    builder = idx_mod.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=dtype)
    for d in docs:
        builder.add_document(torch.from_numpy(d.astype(np.int64)), [len(d)])
    builder.finalize(str(tmp_path / "ref.idx"))

    with IndexedWriter(tmp_path / "ours", dtype) as w:
        # In two calls, as preprocess writes chunk by chunk.
        for part in (docs[: n_docs // 2], docs[n_docs // 2:]):
            tokens = np.concatenate(part) if part else np.zeros(0, dtype)
            w.add_documents(tokens, np.array([len(d) for d in part], dtype=np.int32))
        w.commit()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "ours.idx", "ref.bin", "ref.idx"]


def test_multi_sequence_documents_match_builder(tmp_path):
    """The general form (documents of several sequences, as Megatron-LM writes
    with sentence splitting) also matches, so merge handles such datasets."""
    import torch

    idx_mod = megatron_indexed()
    rng = np.random.default_rng(3)
    builder = idx_mod.IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    with IndexedWriter(tmp_path / "ours", np.uint16) as w:
        for _ in range(20):
            seqs = h.random_documents(rng, int(rng.integers(1, 4)), 1000, 10)
            tokens = np.concatenate(seqs)
            builder.add_document(torch.from_numpy(tokens.astype(np.int64)), [len(s) for s in seqs])
            w.add_sequences(tokens, [len(s) for s in seqs], [w.sequences + len(seqs)])
        w.commit()
    builder.finalize(str(tmp_path / "ref.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()


def test_megatron_and_independent_reader_agree_on_a_preprocessed_shard(tmp_path):
    model = h.tokenizer()
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS + h.synthetic_docs(50))
    preprocess(readers.discover([str(corpus)]), model, str(tmp_path / "c"), workers=0,
               progress=False, log=lambda m: None)
    prefix = str(tmp_path / "c_text_document")
    expected = h.encode_expected(model, h.DOCS + h.synthetic_docs(50))

    ind = independent_read(prefix)
    assert ind["version"] == 1 and ind["code"] == 8  # uint16: vocab 800 fits
    assert ind["docs"] == expected
    assert ind["doc_idx"] == list(range(len(expected) + 1))

    ds = megatron_indexed().IndexedDataset(prefix)
    assert len(ds) == len(expected)
    assert ds.index.dtype == np.uint16
    assert list(ds.document_indices) == ind["doc_idx"]
    assert list(ds.sequence_lengths) == ind["lengths"]
    assert [ds[i].tolist() for i in range(len(ds))] == expected
    assert [x.tolist() for x in ds[2:5]] == expected[2:5]

    ours = IndexedReader(prefix)
    assert ours.check() == []
    assert ours.sequence_pointers.tolist() == ind["pointers"]
    assert [ours.document(i).tolist() for i in range(ours.num_documents)] == expected


def test_token_dtype_follows_megatron_threshold():
    idx_mod = megatron_indexed()
    for vocab in (256, 32000, 48000, 65499, 65500, 128256):
        assert token_dtype(vocab) == idx_mod.DType.optimal_dtype(vocab)


def test_aborted_writer_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with IndexedWriter(tmp_path / "x", np.uint16) as w:
            w.add_documents(np.arange(10, dtype=np.uint16), np.array([4, 6], np.int32))
            raise RuntimeError("boom")
    assert os.listdir(tmp_path) == []


def test_reader_rejects_damaged_files(tmp_path):
    with IndexedWriter(tmp_path / "x", np.uint16) as w:
        w.add_documents(np.arange(10, dtype=np.uint16), np.array([4, 6], np.int32))
        w.commit()
    assert IndexedReader(tmp_path / "x").check() == []
    with open(tmp_path / "x.bin", "ab") as f:
        f.write(b"\0\0")
    assert IndexedReader(tmp_path / "x").check()  # .bin longer than the index says
    (tmp_path / "x.idx").write_bytes((tmp_path / "x.idx").read_bytes()[:-3])
    with pytest.raises(ValueError):
        IndexedReader(tmp_path / "x")


def test_preprocess_equals_megatron_preprocess_data_but_for_blank_documents(tmp_path):
    """The comparison data_tools/README.md documents: Megatron-LM core_v0.16.1's
    tools/preprocess_data.py --tokenizer-type GPTSentencePieceTokenizer
    --append-eod (its default tokenizer system) writes our bytes, except that
    it keeps "" as a document with no sequence and whitespace as tokens; we skip
    both (empty_document). Its Encoder.encode loop, as it is there:"""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.tokenizers import MegatronTokenizer
    model, blank = h.tokenizer(), ["", "   ", "\n"]
    tok = MegatronTokenizer.from_pretrained(
        tokenizer_path=model, metadata_path={"library": "sentencepiece"}, legacy=False,
        special_tokens=None)
    ref = megatron_indexed().IndexedDatasetBuilder(
        str(tmp_path / "ref.bin"), dtype=megatron_indexed().DType.optimal_dtype(tok.vocab_size))
    for text in blank[:2] + h.DOCS + blank[2:]:
        doc_ids, sentence_lens = [], []
        sentence_ids = tok.tokenize(text)
        if len(sentence_ids) > 0:
            doc_ids.extend(sentence_ids)
            sentence_lens.append(len(sentence_ids))
        if len(doc_ids) > 0:  # and args.append_eod
            doc_ids.append(tok.eod)
            sentence_lens[-1] += 1
        ref.add_document(torch.tensor(doc_ids, dtype=torch.int64), sentence_lens)
    ref.finalize(str(tmp_path / "ref.idx"))
    refs = megatron_indexed().IndexedDataset(str(tmp_path / "ref"))
    assert list(refs.document_indices[:3]) == [0, 0, 1]  # "" is a document, no sequence
    assert refs[0].tolist() == tok.tokenize("   ") + [tok.eod]
    assert refs[len(refs) - 1].tolist() == tok.tokenize("\n") + [tok.eod]

    corpus = h.write_jsonl(tmp_path / "c.jsonl", blank[:2] + h.DOCS + blank[2:])
    preprocess(readers.discover([str(corpus)]), model, str(tmp_path / "c"), workers=0,
               progress=False, log=lambda m: None)
    ref = megatron_indexed().IndexedDatasetBuilder(str(tmp_path / "ref2.bin"), dtype=np.uint16)
    for i in range(1, len(refs) - 1):  # Megatron's documents without the blank ones
        ref.add_document(torch.from_numpy(refs[i].astype(np.int64)), [len(refs[i])])
    ref.finalize(str(tmp_path / "ref2.idx"))
    for ext in (".bin", ".idx"):
        assert ((tmp_path / f"c_text_document{ext}").read_bytes()
                == (tmp_path / f"ref2{ext}").read_bytes())


@pytest.mark.parametrize("chunk", [1, 2, 3, 1 << 24])
def test_check_reads_the_index_in_chunks_and_finds_damage_in_any(tmp_path, chunk):
    """``IndexedReader.check`` walks the index ``chunk`` entries at a time (memory stays
    small for any size): a sound shard passes at every chunk size, and a pointer or a
    document index damaged in the last chunk is found."""
    from data_tools.indexed import HEADER_SIZE

    prefix = tmp_path / "s_text_document"
    with IndexedWriter(prefix, np.uint16) as w:
        for n in (3, 4, 2, 5, 1):
            w.add_documents(np.arange(1, n + 1, dtype=np.uint16), [n])
        w.commit()
    assert IndexedReader(prefix).check(chunk) == []
    S = D = 5  # D - 1 documents' bookends plus one: 6 entries
    raw = bytearray((tmp_path / "s_text_document.idx").read_bytes())
    pointer = HEADER_SIZE + 4 * S + 8 * (S - 2)  # the fourth sequence's
    bad = bytearray(raw)
    bad[pointer:pointer + 8] = (10**6).to_bytes(8, "little")
    (tmp_path / "s_text_document.idx").write_bytes(bytes(bad))
    assert IndexedReader(prefix).check(chunk) == [
        "sequence pointers are not the running sum of the lengths"]
    document = HEADER_SIZE + 12 * S + 8 * (D - 1)  # the fifth bookend: 4 -> 6, then 5
    bad = bytearray(raw)
    bad[document:document + 8] = (6).to_bytes(8, "little")
    (tmp_path / "s_text_document.idx").write_bytes(bytes(bad))
    assert IndexedReader(prefix).check(chunk) == ["document indices decrease"]
