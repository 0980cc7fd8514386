"""train-tokenizer and the SentencePieceTokenizer loader."""

from __future__ import annotations

import json
import os
import pickle
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.tokenizer import SentencePieceTokenizer, sidecar_path  # noqa: E402
from data_tools.train_tokenizer import train  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return SentencePieceTokenizer(h.tokenizer())


def test_outputs_and_sidecar(tok):
    prefix = tok.model_path[: -len(".model")]
    assert os.path.exists(prefix + ".vocab")
    assert sidecar_path(tok.model_path) == prefix + ".json"
    with open(prefix + ".json") as f:
        side = json.load(f)
    assert side["vocab_size"] == tok.vocab_size == 800
    assert (side["unk_id"], side["bos_id"], side["eos_id"], side["pad_id"]) == (0, 1, 2, 3)
    assert side["eod_id"] == side["eos_id"] == tok.eod
    assert tok.pad == 3 and tok.id_to_piece(3) == "<pad>"
    assert side["model_sha256"] == tok.sha256
    assert side["trained_on"]["documents"] == len(h.DOCS) + 300
    # The loader accepts the prefix, the .model and the sidecar alike.
    assert SentencePieceTokenizer(prefix).model_path == tok.model_path
    assert SentencePieceTokenizer(prefix + ".json").model_path == tok.model_path


def test_llama_like_encoding(tok):
    # split_digits: one digit per token.
    pieces = [tok.id_to_piece(i) for i in tok.encode("year 20250131")]
    assert [p for p in pieces if p.strip("▁").isdigit()] == list("20250131")
    # byte_fallback: a character never seen in training becomes UTF-8 byte
    # pieces, not <unk>, and decodes back.
    text = "unseen: \u16a0\u16a1 \U0001f40d"
    ids = tok.encode(text)
    assert tok.unk not in ids
    assert "<0xF0>" in [tok.id_to_piece(i) for i in ids]
    assert tok.decode(ids) == text
    # Newlines (never in the training lines) survive as the byte piece <0x0A>.
    assert "<0x0A>" in [tok.id_to_piece(i) for i in tok.encode("a\nb")]
    # Identity normalization, no whitespace folding: exact round trip.
    for doc in h.DOCS:
        assert tok.decode(tok.encode(doc)) == doc
    assert tok.bos not in tok.encode("x") and tok.eod not in tok.encode("x")


def test_megatron_interface(tok):
    ids = tok.unique_identifiers
    assert json.loads(json.dumps(ids)) == ids
    assert ids["model_sha256"] == tok.sha256
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.encode("hello café") == tok.encode("hello café")
    assert (clone.vocab_size, clone.eod, clone.pad) == (tok.vocab_size, tok.eod, tok.pad)


def test_gpt_dataset_accepts_tokenizer_and_shard(tmp_path, tok):
    """What the trainer does: GPTDatasetConfig with our tokenizer, over our shard."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.blended_megatron_dataset_builder import (
            BlendedMegatronDatasetBuilder,
        )
        from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from data_tools.preprocess import preprocess

    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS + h.synthetic_docs(100))
    preprocess(readers.discover([str(corpus)]), tok.model_path, str(tmp_path / "c"), workers=0,
               progress=False, log=lambda m: None)
    cfg = GPTDatasetConfig(random_seed=1, sequence_length=32, split="1,0,0", tokenizer=tok,
                           blend=([str(tmp_path / "c_text_document")], None),
                           reset_position_ids=False, reset_attention_mask=False,
                           eod_mask_loss=False, path_to_cache=str(tmp_path / "cache"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_ds, _, _ = BlendedMegatronDatasetBuilder(
            GPTDataset, [8, None, None], lambda: True, cfg).build()
    sample = train_ds[0]
    assert sample["tokens"].shape == (32,)
    assert int(sample["tokens"].max()) < tok.vocab_size
    assert (sample["tokens"] == tok.eod).any() or len(train_ds) > 0


def test_train_from_text_inputs_is_deterministic(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("\n".join(h.line_docs() + h.synthetic_docs(200, seed=4)) + "\n",
                    encoding="utf-8")
    kw = dict(log=lambda m: None, threads=2)
    train(readers.discover([str(text)]), str(tmp_path / "a"), 500, **kw)
    train(readers.discover([str(text)]), str(tmp_path / "b"), 500, **kw)
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert SentencePieceTokenizer(tmp_path / "a.model").vocab_size == 500
    assert sorted(os.listdir(tmp_path)) == [
        "a.json", "a.model", "a.vocab", "b.json", "b.model", "b.vocab", "t.txt"]


def test_train_with_no_text_fails_clearly(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text('{"text": ""}\n{"other": "x"}\n')
    with pytest.raises(ValueError, match="no text to train on"):
        train(readers.discover([str(empty)]), str(tmp_path / "t"), 300, log=lambda m: None)
    with pytest.raises(ValueError, match="no text to train on"):  # no folder made for it
        train(readers.discover([str(empty)]), str(tmp_path / "new" / "t"), 300,
              log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == ["e.jsonl"]


@pytest.mark.parametrize("vocab, option, message", [
    (300, {"seed": -1}, "--seed must be in [0, 2**32 - 1], got -1"),
    (300, {"max_documents": 0}, "--max-documents must be at least 1, got 0"),
    (260, {}, "--vocab-size must be at least 261"),
    (300, {"threads": 0}, "--threads must be in [1, 1024], got 0"),
    (300, {"character_coverage": float("nan")}, "--character-coverage must be in [0.98, 1.0]"),
    (300, {"max_sentences": 0}, "--max-sentences must be at least 1, got 0"),
])
def test_the_function_checks_its_options_as_the_cli_does(tmp_path, vocab, option, message):
    """Only the CLI checked these: ``train()`` called from Python read the corpus
    first, then took 0 threads or 0 documents as all, or failed in sentencepiece's
    words. Now the same line as the CLI's, before any input is read."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    with pytest.raises(ValueError, match=re.escape(message)):
        train(readers.discover([str(corpus)]), str(tmp_path / "t"), vocab,
              log=lambda m: None, **option)
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_a_file_that_is_not_a_tokenizer_is_named(tmp_path):
    """preprocess -t with a corpus, or a damaged .model / sidecar: one line naming the file."""
    not_model = tmp_path / "corpus.model"
    not_model.write_text('{"text": "not a model"}\n')
    with pytest.raises(ValueError) as e:
        SentencePieceTokenizer(not_model)
    assert str(e.value) == f"{not_model}: not a sentencepiece model (could not parse it)"
    sidecar = tmp_path / "tok.json"
    sidecar.write_text("{not json")
    with pytest.raises(ValueError) as e:
        SentencePieceTokenizer(sidecar)
    assert str(e.value).startswith(f"{sidecar}: not a tokenizer sidecar (not JSON: ")
