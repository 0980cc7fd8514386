"""The refusals and warnings of ``kvtrain data ...`` that a user's input reaches:
each is one line naming the file (or option), never a traceback, and nothing
half-written is left behind. Driven through ``data_tools.cli.main`` in-process."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402
from test_data_cli import _refused  # noqa: E402
from test_data_preprocess import run as run_preprocess  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.cli import main  # noqa: E402
from data_tools.indexed import HEADER_SIZE, IndexedWriter, check_shard  # noqa: E402


def _shard(prefix, docs, dtype=np.uint16) -> str:
    """A dataset of ``docs`` (lists of ids), one sequence per document."""
    with IndexedWriter(prefix, dtype) as w:
        if docs:
            w.add_documents(np.concatenate([np.asarray(d) for d in docs]), [len(d) for d in docs])
        w.commit()
    return str(prefix)


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    status = main(["inspect", *args])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return status, out.out, out.err


# --------------------------------------------------------------------------
# inspect


def test_inspect_of_a_shard_without_documents_and_a_meta_that_is_not_an_object(
        tmp_path, capsys):
    """An empty shard (megatron's own: no .meta.json) reports "(no documents)";
    a .meta.json edited into a JSON list is one warning naming it, and the report goes on."""
    prefix = _shard(tmp_path / "e_text_document", [])
    status, out, _ = _inspect(capsys, prefix)
    assert status == 0 and "documents  0" in out and "  (no documents)" in out, out
    assert "warning" not in out
    meta = tmp_path / "e_text_document.meta.json"
    meta.write_text("[1, 2]")
    status, out, _ = _inspect(capsys, prefix)
    assert status == 0 and f"warning: {meta}: not read (not a JSON object)" in out, out
    assert "check      OK" in out


def test_inspect_counts_empty_documents_as_0_tokens(tmp_path, capsys):
    """A megatron shard keeps "" as a document of no sequence: the histogram put it
    in the [1, 2) bucket, a one-token document that is not there."""
    with IndexedWriter(tmp_path / "m", np.uint16) as w:
        w.add_sequences(np.array([5, 6, 2], np.uint16), [3], [0, 1])  # documents "", [5 6 2]
        w.commit()
    status, out, _ = _inspect(capsys, str(tmp_path / "m"))
    assert status == 0 and "documents  2" in out, out
    assert "  [      0,       1)           1  ####" in out, out
    assert "  [      1,       2)           0  \n" in out
    assert "  [      2,       4)           1  ####" in out
    assert "--- document 0: 0 tokens\n" in out


def test_inspect_with_a_tokenizer_option_that_cannot_be_loaded_is_one_line(tmp_path, capsys):
    """``--tokenizer`` naming a file that is not a sentencepiece model (the corpus by
    mistake), or no file: it was a warning, the documents shown as ids, exit 0. An
    option given explicitly fails as ``kvtrain generate --tokenizer`` does."""
    prefix = _shard(tmp_path / "s_text_document", [[5, 6, 2]])
    corpus = h.write_jsonl(tmp_path / "c.model", ["not a model"])
    missing = tmp_path / "nonexist.model"
    for path, why in ((corpus, f"{corpus}: not a sentencepiece model (could not parse it)"),
                      (missing, f"{missing}: no sentencepiece model at {missing} "
                                f"(nor {missing}.model)")):
        assert main(["inspect", prefix, "--tokenizer", str(path)]) == 1
        out = capsys.readouterr()
        assert out.err == f"kvtrain data inspect: error: --tokenizer {why}\n", out.err
        assert out.out == ""  # refused before the report


def test_inspect_with_a_recorded_tokenizer_that_cannot_be_loaded_warns_and_shows_ids(
        tmp_path, capsys):
    """The tokenizer the shard's .meta.json names, found by inspect itself, damaged
    since: a warning naming it, and the documents shown as ids (the report is the
    shard's, not the tokenizer's)."""
    prefix = _shard(tmp_path / "s_text_document", [[5, 6, 2]])
    broken = h.write_jsonl(tmp_path / "tok.model", ["not a model"])
    (tmp_path / "s_text_document.meta.json").write_text(json.dumps({"tokenizer": str(broken)}))
    status, out, _ = _inspect(capsys, prefix)
    assert status == 0, out
    assert (f"warning: cannot load tokenizer {broken}: not a sentencepiece model "
            "(could not parse it)") in out, out
    assert "--- document 0: 3 tokens\n    5 6 2\n" in out


def test_inspect_ids_beyond_the_tokenizer_vocabulary_say_wrong_tokenizer(tmp_path, capsys):
    """A shard made with a larger tokenizer than the one given: token ids past its
    vocabulary are a warning naming the largest, exit 1 (its text would be garbage)."""
    prefix = _shard(tmp_path / "s_text_document", [[5, 900, 2], [7, 2]])
    status, out, _ = _inspect(capsys, prefix, "--tokenizer", h.tokenizer())
    assert status == 1, out
    assert "  WARNING: token id 900 >= vocab size 800: wrong tokenizer?" in out, out
    assert "--- document 0: 3 tokens\n    5 900 2\n" in out  # ids, not decoded
    assert "check      OK" in out


def test_inspect_with_another_tokenizer_than_the_shards_was_made_with_warns(tmp_path, capsys):
    """``--tokenizer`` another than the one the shard's meta records (its sha256): its
    text is printed with a warning, as train and perplexity refuse such a tokenizer; it
    decoded garbage without a word (a probe's). The shard's own: no warning."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    prefix = str(tmp_path / "p")
    assert main(["preprocess", "-i", str(corpus), "-t", h.tokenizer(), "-o", prefix,
                 "-j", "0", "--quiet"]) == 0
    capsys.readouterr()
    other = h.tokenizer(900)
    status, out, _ = _inspect(capsys, prefix + "_text_document", "--tokenizer", other)
    assert status == 0, out
    assert (f"  WARNING: {other} is not the tokenizer the shard was made with (its meta "
            "records another sha256): the text below is another tokenizer's reading") in out
    status, out, _ = _inspect(capsys, prefix + "_text_document", "--tokenizer", h.tokenizer())
    assert status == 0 and "WARNING" not in out, out


def test_inspect_of_a_merge_result_says_what_it_was_merged_from(tmp_path, capsys):
    """The merged dataset's .meta.json: "merged from N datasets"; an output prefix
    already ending in _text_document is used as it is."""
    a = _shard(tmp_path / "a_text_document", [[1, 2], [3]])
    b = _shard(tmp_path / "b_text_document", [[4, 5, 6]])
    assert main(["merge", "-o", str(tmp_path / "m_text_document"), a, b]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in tmp_path.glob("m_*")) == [
        "m_text_document.bin", "m_text_document.idx", "m_text_document.meta.json"]
    status, out, _ = _inspect(capsys, str(tmp_path / "m"))
    assert status == 0 and "merged     from 2 datasets" in out and "documents  3" in out, out


def test_inspect_of_shards_some_unreadable_is_one_error_line_each(tmp_path, capsys):
    """``inspect PREFIX`` over a preprocess run's shards: a truncated .idx and a missing
    .bin are one error line each naming the file (the .bin was a Python
    "[Errno 2] ...: '...'" line), the sound shard is still reported, exit 1."""
    for i in range(3):
        _shard(tmp_path / f"p_{i:05d}_text_document", [[1, 2, 3], [4, 2]])
    idx = tmp_path / "p_00000_text_document.idx"
    idx.write_bytes(idx.read_bytes()[:-4])
    missing = tmp_path / "p_00001_text_document.bin"
    missing.unlink()
    status, out, err = _inspect(capsys, str(tmp_path / "p"))
    assert status == 1
    assert err.splitlines() == [
        f"kvtrain data inspect: error: {idx}: {idx.stat().st_size} bytes, expected "
        f"{idx.stat().st_size + 4} for 2 sequences and 3 document indices (truncated or damaged)",
        f"kvtrain data inspect: error: {missing}: No such file or directory"], err
    assert out.count("dataset    ") == 1 and "p_00002_text_document" in out, out
    assert "check      OK" in out


# --------------------------------------------------------------------------
# damaged indexes: inspect's check and check_shard (what kvtrain's data loader calls)


def _damaged_index(tmp_path, name: str, entry: int, value: int):
    """A two-document shard whose document index ``entry`` is set to ``value``."""
    prefix = _shard(tmp_path / name, [[1, 2, 3], [4, 2]])
    idx = tmp_path / f"{name}.idx"
    raw = bytearray(idx.read_bytes())
    at = HEADER_SIZE + 12 * 2 + 8 * entry  # after S int32 lengths and S int64 pointers
    raw[at:at + 8] = struct.pack("<q", value)
    idx.write_bytes(bytes(raw))
    return prefix, idx


def test_document_indices_not_from_0_to_the_sequence_count_are_named(tmp_path, capsys):
    """A damaged .idx whose document indices do not start at 0, or do not end at the
    sequence count: inspect's check FAILED line (exit 1), and check_shard's line
    naming the .idx."""
    prefix, idx = _damaged_index(tmp_path, "first", 0, 1)
    status, out, _ = _inspect(capsys, prefix)
    assert status == 1 and "check      FAILED: document indices must start at 0" in out, out
    prefix, idx = _damaged_index(tmp_path, "last", 2, 5)
    status, out, _ = _inspect(capsys, prefix)
    assert status == 1 and "check      FAILED: last document index 5 != sequence count 2" in out
    assert check_shard(prefix) == f"{idx}: last document index 5 is not the sequence count 2"


def test_an_index_without_document_indices_is_named_in_words(tmp_path, capsys):
    """A header declaring no document index at all (not even the leading 0):
    check_shard said "last document index None is not the sequence count 0"."""
    idx, bin_ = tmp_path / "n.idx", tmp_path / "n.bin"
    idx.write_bytes(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, 0, 0))
    bin_.write_bytes(b"")
    assert check_shard(tmp_path / "n") == f"{idx}: no document indices (the first must be 0)"
    status, out, _ = _inspect(capsys, str(tmp_path / "n"))
    assert status == 1 and "check      FAILED: document indices must start at 0" in out, out


def test_writer_refuses_a_token_dtype_megatron_cannot_read(tmp_path):
    """IndexedWriter with uint32 tokens (not a megatron dtype code): refused before
    any file or folder is made."""
    with pytest.raises(ValueError, match="unsupported token dtype"):
        IndexedWriter(tmp_path / "out" / "x", np.uint32)
    assert os.listdir(tmp_path) == []


# --------------------------------------------------------------------------
# merge


def test_merge_of_a_multimodal_dataset_is_refused_writing_nothing(tmp_path, capsys):
    """A multimodal dataset (sequence modes after the arrays): one line naming it."""
    a = _shard(tmp_path / "a_text_document", [[1, 2], [3]])
    mm = _shard(tmp_path / "mm", [[1, 2], [3]])
    with open(tmp_path / "mm.idx", "ab") as f:
        f.write(b"\x00\x00")  # one mode per sequence
    status, out, _ = _inspect(capsys, mm)
    assert status == 0 and "(code 8), multimodal" in out, out
    before = sorted(os.listdir(tmp_path))
    err = _refused(capsys, "merge", "-o", str(tmp_path / "m"), a, mm)
    assert err.endswith(f"{mm}: multimodal datasets (sequence modes) are not supported"), err
    assert sorted(os.listdir(tmp_path)) == before


def test_merge_of_a_glob_matching_only_the_output_names_it(tmp_path, capsys):
    """``merge -o d 'd*'`` once d_text_document exists: the glob's only match is
    the output (skipped); the line said "nothing to merge" without naming why."""
    _shard(tmp_path / "d_text_document", [[1, 2]])
    before = sorted(os.listdir(tmp_path))
    pattern = str(tmp_path / "d*.idx")
    err = _refused(capsys, "merge", "-o", str(tmp_path / "d"), pattern)
    assert err.endswith(f"nothing to merge: {pattern} matches only the output "
                        f"{tmp_path / 'd_text_document'}"), err
    assert sorted(os.listdir(tmp_path)) == before
    from data_tools.merge import merge

    with pytest.raises(ValueError, match="nothing to merge"):  # the function, called with []
        merge([], str(tmp_path / "x"), log=lambda m: None)


def test_merge_of_a_missing_dataset_or_bin_is_one_line_naming_it(tmp_path, capsys):
    """An input that does not exist; an .idx whose .bin is gone (was a Python
    "[Errno 2] No such file or directory: '...'" line)."""
    a = _shard(tmp_path / "a_text_document", [[1, 2]])
    err = _refused(capsys, "merge", "-o", str(tmp_path / "m"), a, str(tmp_path / "nope"))
    assert err == (f"kvtrain data merge: error: {tmp_path / 'nope'}: no IndexedDataset "
                   "(.idx/.bin) found there"), err
    _shard(tmp_path / "b_text_document", [[3]])
    (tmp_path / "b_text_document.bin").unlink()
    err = _refused(capsys, "merge", "-o", str(tmp_path / "m"), a, str(tmp_path / "b"))
    assert err == (f"kvtrain data merge: error: {tmp_path / 'b_text_document.bin'}: "
                   "No such file or directory"), err
    assert not list(tmp_path.glob("m*"))


# --------------------------------------------------------------------------
# preprocess: inputs


def _write_parquet(path, columns: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(columns), path)
    return path


def test_parquet_without_the_text_column_is_one_line(tmp_path, capsys):
    """A parquet file whose text is in another column than --json-key: one line
    listing the columns it has; no shard written."""
    path = _write_parquet(tmp_path / "p.parquet", {"id": [1, 2], "body": ["a", "b"]})
    err = _refused(capsys, "preprocess", "-i", str(path), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "out" / "p"), "-j", "0")
    assert err.endswith(f"{path}: no column 'text' (columns: id, body)"), err
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []


def test_parquet_nulls_and_non_strings_are_skipped_by_reason(tmp_path):
    """A null text cell is missing_key, a number not_a_string, each named file:row."""
    import pyarrow as pa

    p = _write_parquet(tmp_path / "p.parquet", {"text": pa.array(["one", None, "three"])})
    q = _write_parquet(tmp_path / "q.parquet", {"text": [4, 5]})
    res = run_preprocess([p, q], tmp_path / "out", shards=1)
    assert res["counts"].documents == 2
    assert res["counts"].skipped == {"missing_key": 1, "not_a_string": 2}
    assert res["first_bad"][:2] == [(f"{p}:2", "missing_key", "text is null"),
                                    (f"{q}:1", "not_a_string", "int")]
    assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), ["one", "three"])


def test_a_corrupt_zstd_input_stops_the_run_in_one_line_leaving_nothing(tmp_path, capsys):
    """A .zst whose second frame is damaged (bit rot), read after a good input into the
    same shard: one line naming it with zstd's words; the half-written shard's
    temporaries are removed."""
    import zstandard

    data = "".join(json.dumps({"text": d}) + "\n" for d in h.synthetic_docs(50)).encode()
    frame = zstandard.ZstdCompressor().compress(data)
    bad = bytearray(frame)
    bad[20:60] = bytes(b ^ 0xFF for b in bad[20:60])
    path = tmp_path / "c.jsonl.zst"
    path.write_bytes(frame + bytes(bad))
    good = h.write_jsonl(tmp_path / "a.jsonl", h.DOCS)
    err = _refused(capsys, "preprocess", "-i", str(good), str(path), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "out" / "p"), "-j", "0", "--shards", "1")
    assert err.startswith(f"kvtrain data preprocess: error: {path}: cannot read: ZstdError: "), err
    assert os.listdir(tmp_path / "out") == []  # the writer was open: its temporaries are gone


def test_an_input_that_cannot_be_opened_is_named(tmp_path, monkeypatch):
    """A path that exists but cannot be opened (here a socket; a file without read
    permission for a non-root user): the file and the system's reason."""
    import socket

    monkeypatch.chdir(tmp_path)  # a socket's path is limited to about 100 bytes
    with socket.socket(socket.AF_UNIX) as s:
        s.bind("s.jsonl")
        with pytest.raises(readers.InputError) as e:
            readers.discover(["s.jsonl"])
    assert str(e.value) == "s.jsonl: No such device or address"


def test_text_file_mode_strips_a_bom_and_batches_files_into_chunks(tmp_path):
    """--text-mode file: an editor's UTF-8 BOM is not part of the document, and
    files are batched into chunks of about --chunk-mb (here several chunks)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    docs = h.line_docs()
    for i, doc in enumerate(docs):
        (folder / f"{i:02d}.txt").write_bytes(b"\xef\xbb\xbf" + doc.encode())
    res = run_preprocess(folder, tmp_path / "out", text_mode="file", chunk_bytes=64)
    assert res["counts"].skipped == {}
    assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), docs)


# --------------------------------------------------------------------------
# preprocess: options, tokenizer, failures


def test_preprocess_text_mode_file_with_jsonl_inputs_is_one_line(tmp_path, capsys):
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "p"), "--text-mode", "file")
    assert err.endswith("--text-mode file reads text files whole; some inputs are not text")
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_no_documents_in_many_inputs_names_three_and_counts_the_rest(tmp_path, capsys):
    """Five inputs with only blank documents: the line names three and "2 more"."""
    names = [h.write_jsonl(tmp_path / f"e{i}.jsonl", [""]) for i in range(5)]
    err = _refused(capsys, "preprocess", "-i", *map(str, names), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "out" / "p"), "-j", "0", "--report-bad", "0")
    assert err.endswith(f"no documents in {names[0]}, {names[1]}, {names[2]} and 2 more: "
                        "5 records skipped (empty_document 5); no shard written"), err
    assert os.listdir(tmp_path / "out") == []


def test_running_out_of_memory_mid_shard_is_one_line_keeping_nothing_half_written(
        tmp_path, capsys, monkeypatch):
    """A MemoryError while encoding (a ``ulimit -v`` memory limit; simulated) after
    part of the shard was written: one line naming where, with --resume's hint,
    and the shard's temporaries removed."""
    from data_tools.encoder import ChunkEncoder

    calls, encode = [], ChunkEncoder.encode

    def encode_until_the_third(self, texts):
        calls.append(len(texts))
        if len(calls) == 3:
            raise MemoryError
        return encode(self, texts)

    monkeypatch.setattr(ChunkEncoder, "encode", encode_until_the_third)
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.synthetic_docs(100))
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "out" / "p"), "-j", "0", "--chunk-mb", "0.002")
    assert err.startswith(f"kvtrain data preprocess: error: out of memory (MemoryError) while "
                          f"encoding {corpus}:"), err
    assert err.endswith("; nothing was written for the shard being processed (--resume keeps "
                        "the shards completed before it)"), err
    assert os.listdir(tmp_path / "out") == []


def test_a_rerun_removes_an_earlier_shard_of_the_prefix_without_a_meta(tmp_path):
    """A shard of this prefix with no .meta.json (a run killed before it wrote the
    meta) that this run does not write is removed, and the log names it."""
    _shard(tmp_path / "p_00003_text_document", [[1, 2]])
    logs = []
    res = run_preprocess(h.write_jsonl(tmp_path / "c.jsonl", h.DOCS), tmp_path / "p",
                         log=logs.append)
    assert [os.path.basename(p) for p in res["outputs"]] == ["p_text_document"]
    assert not list(tmp_path.glob("p_00003*"))
    assert logs == ["preprocess: removed 1 shard(s) of an earlier run that this one does not "
                    "write: p_00003_text_document"]


def test_tokenizer_sidecars_renamed_models_and_models_without_eos(tmp_path, capsys):
    """-t with a .json sidecar that is not an object, or a model without an EOS piece
    (no EOD to append): one line each naming the file. A sidecar whose recorded model
    was renamed with it (tok.json says spm.model) finds tok.model beside it."""
    import shutil

    import sentencepiece as spm

    from data_tools.tokenizer import SentencePieceTokenizer

    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    out = str(tmp_path / "out" / "p")
    side = tmp_path / "list.json"
    side.write_text("[]")
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", str(side), "-o", out)
    assert err.endswith(f"{side}: not a tokenizer sidecar (not a JSON object)"), err

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(["hello world"] * 5),
                                   model_writer=model, vocab_size=10, eos_id=-1,
                                   hard_vocab_limit=False, model_type="char", minloglevel=2)
    no_eos = tmp_path / "noeos.model"
    no_eos.write_bytes(model.getvalue())
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", str(no_eos), "-o", out)
    assert err.endswith(f"{no_eos}: the model has no EOS piece to use as EOD"), err
    assert not (tmp_path / "out").exists()

    shutil.copy(h.tokenizer(), tmp_path / "tok.model")
    (tmp_path / "tok.json").write_text(json.dumps({"model": "spm.model"}))
    assert SentencePieceTokenizer(tmp_path / "tok.json").model_path == str(tmp_path / "tok.model")


# --------------------------------------------------------------------------
# train-tokenizer


def test_train_tokenizer_text_mode_file_with_jsonl_inputs_is_one_line(tmp_path, capsys):
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _refused(capsys, "train-tokenizer", "-i", str(corpus), "--vocab-size", "300",
                   "-o", str(tmp_path / "t"), "--text-mode", "file")
    assert err.endswith("--text-mode file reads text files whole; some inputs are not text")
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_train_tokenizer_on_a_truncated_input_fails_after_training_writing_nothing(
        tmp_path, capsys):
    """A .gz cut short (a partial download) after a good input: sentencepiece trains
    on what was read, then the read error is the one line (naming the file), and no
    model is written from the partial corpus."""
    good = h.write_jsonl(tmp_path / "a.jsonl", h.DOCS + h.synthetic_docs(150, seed=3))
    packed = gzip.compress(good.read_bytes(), mtime=0)
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(packed[: len(packed) - 40])
    err = _refused(capsys, "train-tokenizer", "-i", str(good), str(path), "--vocab-size", "400",
                   "-o", str(tmp_path / "t"), "--threads", "2")
    assert err.startswith(f"kvtrain data train-tokenizer: error: {path}: cannot read: "
                          "EOFError: "), err
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "c.jsonl.gz"]
