"""preprocess: round trip for every input format, determinism, sharding, and
the documented handling of bad input (counts, file:line, --strict)."""

from __future__ import annotations

import gzip
import json
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.preprocess import StrictError, plan_shards, preprocess  # noqa: E402


def run(inputs, prefix, **kw):
    kw.setdefault("workers", 0)
    kw.setdefault("progress", False)
    kw.setdefault("log", lambda m: None)
    specs = [str(i) for i in (inputs if isinstance(inputs, list) else [inputs])]
    return preprocess(readers.discover(specs, kw.pop("format", "auto")), h.tokenizer(),
                      str(prefix), **kw)


def _write_text(path, docs):
    data = ("\n".join(docs) + "\n").encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.suffix == ".gz" else data)


def _write_parquet(path, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    # Small row groups: several batches per file.
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=3)


FORMATS = {
    "jsonl": lambda d, docs: h.write_jsonl(d / "in.jsonl", docs),
    "jsonl.gz": lambda d, docs: h.write_jsonl(d / "in.jsonl.gz", docs),
    "jsonl.zst": lambda d, docs: h.write_jsonl(d / "in.jsonl.zst", docs),
    "text-line": lambda d, docs: _write_text(d / "in.txt", docs) or d / "in.txt",
    "text-line.gz": lambda d, docs: _write_text(d / "in.txt.gz", docs) or d / "in.txt.gz",
    "parquet": lambda d, docs: _write_parquet(d / "in.parquet", docs) or d / "in.parquet",
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip_every_format(tmp_path, fmt):
    docs = (h.line_docs() if fmt.startswith("text") else h.DOCS) + h.synthetic_docs(30)
    path = FORMATS[fmt](tmp_path, docs)
    result = run(path, tmp_path / "out", chunk_bytes=1024)  # many chunks
    assert result["counts"].documents == len(docs)
    assert result["counts"].skipped == {}
    expected = h.encode_expected(h.tokenizer(), docs)
    assert h.shard_docs(str(tmp_path / "out_text_document")) == expected


def test_round_trip_text_file_mode(tmp_path):
    folder = tmp_path / "docs"
    folder.mkdir()
    for i, doc in enumerate(h.DOCS):  # newlines inside documents are kept
        (folder / f"{i:02d}.txt").write_text(doc, encoding="utf-8")
    (folder / ".hidden.txt").write_text("never read")
    (folder / "notes.md").write_text("not an input: unknown extension")
    run(folder, tmp_path / "out", text_mode="file")
    expected = h.encode_expected(h.tokenizer(), h.DOCS)
    assert h.shard_docs(str(tmp_path / "out_text_document")) == expected


def test_output_is_independent_of_workers_and_chunking(tmp_path):
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.synthetic_docs(400))
    run(corpus, tmp_path / "a", workers=0)
    run(corpus, tmp_path / "b", workers=2, chunk_bytes=4096)
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"a_text_document{ext}").read_bytes() == \
            (tmp_path / f"b_text_document{ext}").read_bytes()


@pytest.mark.parametrize("option, value, message", [
    ("workers", -1, "--workers must be 0 (no subprocess) or more, got -1"),
    ("shards", 0, "--shards must be at least 1, got 0"),
    ("report_bad", -1, "--report-bad must be 0 or more, got -1"),
])
def test_the_function_checks_its_options_as_the_cli_does(tmp_path, option, value, message):
    """``preprocess()`` called from Python took these silently as something else
    (inline, the default, 0): only the command line checked them."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.synthetic_docs(4))
    with pytest.raises(ValueError, match=re.escape(message)):
        run(corpus, tmp_path / "p", **{option: value})
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_directories_globs_and_shards(tmp_path):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    parts = [h.synthetic_docs(20, seed=s) for s in range(4)]
    h.write_jsonl(d / "b.jsonl", parts[1])
    h.write_jsonl(d / "a.jsonl.gz", parts[0])
    h.write_jsonl(d / "sub" / "c.jsonl", parts[2])
    h.write_jsonl(tmp_path / "z.jsonl", parts[3])
    # A directory (sorted, recursive) then a glob: four files, four shards.
    res = run([d, tmp_path / "z*.jsonl"], tmp_path / "out" / "p")
    assert [os.path.basename(p) for p in res["outputs"]] == [
        f"p_{i:05d}_text_document" for i in range(4)]
    model = h.tokenizer()
    for prefix, docs in zip(res["outputs"], parts):
        assert h.shard_docs(prefix) == h.encode_expected(model, docs)
    # --shards regroups the same files contiguously.
    res = run([d, tmp_path / "z*.jsonl"], tmp_path / "two" / "p", shards=2)
    assert len(res["outputs"]) == 2
    assert h.shard_docs(res["outputs"][0]) + h.shard_docs(res["outputs"][1]) == \
        h.encode_expected(model, sum(parts, []))


def test_plan_shards_balances_and_keeps_order():
    files = [readers.InputFile(f"f{i}", "jsonl", "none", s)
             for i, s in enumerate([100, 1, 1, 1, 100, 1, 1, 100])]
    plan = plan_shards(files, "/o/p", 3)
    assert [[f.path for f in s.inputs] for s in plan] == [
        ["f0", "f1", "f2"], ["f3", "f4", "f5"], ["f6", "f7"]]  # 102, 102, 101 bytes
    assert [len(s.inputs) for s in plan_shards(files, "/o/p", 8)] == [1] * 8
    assert [len(s.inputs) for s in plan_shards(files, "/o/p", 50)] == [1] * 8
    assert plan_shards(files, "/o/p", 1)[0].prefix == "/o/p_text_document"


def test_more_shards_than_their_names_hold_are_refused():
    """One shard per input file (the default) of 100,001 files: shard 100000 was named
    ``p_100000_text_document``, six digits, which merge, inspect and the trainer's
    ``data.paths: [p]`` (five-digit names) pass over: its documents left out of the
    training data, silently. Now refused before any input is read (``check_outputs_new``
    plans first), naming --shards."""
    files = [readers.InputFile(f"f{i}", "jsonl", "none", 1) for i in range(100_001)]
    with pytest.raises(ValueError, match=r"^100001 shards \(one per input file\): their "
                                         r"names hold five digits .* give --shards N"):
        plan_shards(files, "/o/p", None)
    with pytest.raises(ValueError, match=r"^--shards 100001: "):
        plan_shards(files, "/o/p", 100_001)
    plan = plan_shards(files, "/o/p", 100_000)
    assert all(re.fullmatch(r"/o/p_[0-9]{5}_text_document", s.prefix) for s in plan)


# --------------------------------------------------------------------------
# bad input

BAD_LINES = [
    (b'{"text": "good one"}', None),
    (b'{"text": "unterminated"', "malformed_json"),               # line 2
    (b'{"text": "bad \xff\xfe bytes"}', "invalid_utf8"),           # line 3
    (b'{"title": "no text key"}', "missing_key"),                  # line 4
    (b'{"text": null}', "missing_key"),                            # line 5
    (b'{"text": 5}', "not_a_string"),                              # line 6
    (b'{"text": ""}', "empty_document"),                           # line 7
    (b'', "empty_document"),                                       # line 8: blank line
    (b'{"text": "  \\n\\t "}', "empty_document"),                  # line 9: whitespace only
    (b'[1, 2]', "missing_key"),                                    # line 10: not an object
    (b'{"text": "lone \\ud800 surrogate"}', "invalid_utf8"),       # line 11
    ('{"text": "good \u00e9\u65e5\U0001f99c"}'.encode(), None),   # line 12
]
EXPECTED_COUNTS = {"malformed_json": 1, "invalid_utf8": 2, "missing_key": 3,
                   "not_a_string": 1, "empty_document": 3}


def _bad_fixture(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b"\n".join(line for line, _ in BAD_LINES) + b"\n")
    text = tmp_path / "bad.txt"
    text.write_bytes(b"fine line\n\xc3\x28 invalid\n\n   \nlast fine line")  # no final newline
    return path, text


def test_bad_input_is_counted_reported_and_skipped(tmp_path):
    path, text = _bad_fixture(tmp_path)
    res = run([path, text], tmp_path / "out", report_bad=3)
    assert res["counts"].skipped == {
        **EXPECTED_COUNTS, "invalid_utf8": 3, "empty_document": 5}
    assert res["counts"].documents == 2 + 2
    assert [(os.path.basename(loc), reason) for loc, reason, _ in res["first_bad"]] == [
        ("bad.jsonl:2", "malformed_json"), ("bad.jsonl:3", "invalid_utf8"),
        ("bad.jsonl:4", "missing_key")]
    good = ["good one", "good \u00e9\u65e5\U0001f99c"]
    assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), good)
    assert h.shard_docs(res["outputs"][1]) == h.encode_expected(
        h.tokenizer(), ["fine line", "last fine line"])
    meta = json.loads(open(res["outputs"][0] + ".meta.json").read())
    assert meta["counts"]["skipped"] == EXPECTED_COUNTS


def test_bad_input_cli_summary(tmp_path):
    path, _ = _bad_fixture(tmp_path)
    proc = h.kvtrain("data", "preprocess", "--input", str(path), "--tokenizer", h.tokenizer(),
                     "--output-prefix", str(tmp_path / "out"), "--workers", "2")
    assert "2 written, 10 skipped" in proc.stdout
    assert ("invalid_utf8 2, malformed_json 1, missing_key 3, not_a_string 1, "
            "empty_document 3") in proc.stdout
    assert f"{path}:2: malformed_json" in proc.stderr
    assert f"{path}:3: invalid_utf8" in proc.stderr


@pytest.mark.parametrize("workers", [0, 2])
def test_json_nested_too_deeply_is_malformed_json(tmp_path, workers):
    """json.loads raises RecursionError, not ValueError, on valid JSON nested
    deeper than the stack: still one bad line, for preprocess (in the main
    process or a worker) and for train-tokenizer's sentence stream."""
    from data_tools.train_tokenizer import SentenceStream

    path = tmp_path / "deep.jsonl"
    deep = '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}"
    path.write_text('{"text": "first doc"}\n' + deep + '\n{"text": "last doc"}\n')
    res = run(path, tmp_path / "out", workers=workers)
    assert (res["counts"].documents, res["counts"].skipped) == (2, {"malformed_json": 1})
    assert [(os.path.basename(loc), reason) for loc, reason, _ in res["first_bad"]] == [
        ("deep.jsonl:2", "malformed_json")]
    stream = SentenceStream(readers.discover([str(path)]), json_key="text", text_mode="line")
    assert (list(stream), stream.error) == (["first doc", "last doc"], None)
    assert stream.stats["skipped"] == {"malformed_json": 1}


@pytest.mark.parametrize("workers", [0, 2])
def test_strict_fails_on_first_bad_record_and_writes_nothing(tmp_path, workers):
    path, _ = _bad_fixture(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StrictError, match=r"bad\.jsonl:2: malformed_json"):
        run(path, out / "p", strict=True, workers=workers)
    assert os.listdir(out) == []
    proc = h.kvtrain("data", "preprocess", "--input", str(path), "--tokenizer", h.tokenizer(),
                     "--output-prefix", str(out / "p"), "--strict", check=False)
    assert proc.returncode == 1
    assert f"{path}:2: malformed_json" in proc.stderr
    assert os.listdir(out) == []


def test_unreadable_inputs_are_errors(tmp_path):
    with pytest.raises(readers.InputError, match="no such file"):
        readers.discover([str(tmp_path / "missing.jsonl")])
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(readers.InputError, match="--format"):
        readers.discover([str(tmp_path / "x.csv")])
    corrupt = tmp_path / "c.jsonl.gz"
    corrupt.write_bytes(gzip.compress(b'{"text": "a"}\n' * 1000)[:60])
    with pytest.raises(readers.InputError, match="c.jsonl.gz"):
        run(corrupt, tmp_path / "out")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]


def test_inputs_that_cannot_be_read_as_named_are_one_line_each(tmp_path):
    """What ``discover`` refuses before reading a byte, each naming the file or pattern
    in one line: an empty directory, a pattern that matches nothing, a file named
    ``.gz`` that is not gzip, a compressed parquet file."""
    empty = tmp_path / "empty"
    (empty / ".hidden").mkdir(parents=True)
    (empty / "notes.csv").write_text("a,b\n")  # not an input format: skipped in a walk
    fake_gz = tmp_path / "plain.jsonl.gz"
    fake_gz.write_text('{"text": "a"}\n')
    packed = tmp_path / "t.parquet.gz"
    packed.write_bytes(gzip.compress(b"PAR1"))
    for spec, message in ((empty, f"{empty}: no input files in this directory"),
                          (tmp_path / "*.nope", f"{tmp_path / '*.nope'}: the pattern matches "
                                                "no file"),
                          (fake_gz, f"{fake_gz}: named gzip but is not gzip-compressed"),
                          (packed, f"{packed}: compressed parquet files are not supported")):
        with pytest.raises(readers.InputError) as e:
            readers.discover([str(spec)])
        assert str(e.value) == message


def test_bom_crlf_and_lines_longer_than_a_chunk(tmp_path):
    docs = ["first", "x" * 5000 + " long é", "last"]
    jsonl = tmp_path / "w.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(
        json.dumps({"text": d}, ensure_ascii=False) for d in docs).encode() + b"\r\n")
    text = tmp_path / "w.txt"
    text.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(docs).encode())
    res = run([jsonl, text], tmp_path / "out", chunk_bytes=64)
    assert res["counts"].skipped == {}
    expected = h.encode_expected(h.tokenizer(), docs)
    assert [h.shard_docs(p) for p in res["outputs"]] == [expected, expected]


def test_encoder_list_fallback_matches_numpy_path():
    """sentencepiece < 0.2.1 has no numpy output; the list path gives the same arrays."""
    import numpy as np

    from data_tools.encoder import ChunkEncoder

    enc = ChunkEncoder(h.tokenizer(), np.uint16, "text")
    fast = enc.encode(h.DOCS)
    enc._numpy = False
    slow = enc.encode(h.DOCS)
    assert fast[0].dtype == slow[0].dtype == np.uint16
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])
    assert fast[1].tolist() == [len(x) for x in h.encode_expected(h.tokenizer(), h.DOCS)]


def test_progress_line_and_summary():
    import io

    from data_tools.progress import Counts, Progress, summary

    c = Counts(documents=1500, tokens=2_000_000, text_bytes=8_000_000, disk_bytes=4_000_000,
               skipped={"missing_key": 2, "invalid_utf8": 1})
    stream = io.StringIO()
    bar = Progress(8_000_000, stream=stream, log_interval=0)
    bar.update(c, 4_000_000)
    line = stream.getvalue()
    assert line.startswith(" 50.0% 1.50k docs 2.00M tokens")
    for unit in ("docs/s", "tok/s", "MB/s", "skipped 3"):
        assert unit in line
    text = summary(c, 2.0, dtype="uint16", outputs=["/o/p_text_document"])
    assert "1,500 written, 3 skipped (invalid_utf8 1, missing_key 2)" in text
    assert "1.00M tokens/s" in text and "/o/p_text_document.bin/.idx" in text


def test_a_run_without_documents_keeps_the_shard_already_there(tmp_path):
    """Rerun into the same prefix with an input that turned out empty: an error,
    and the shard (and its meta) a previous run wrote are untouched."""
    from data_tools.preprocess import NoDocumentsError

    good = run(h.write_jsonl(tmp_path / "good.jsonl", h.DOCS), tmp_path / "p")
    files = {p: open(p, "rb").read() for prefix in good["outputs"]
             for p in (prefix + ".bin", prefix + ".idx", prefix + ".meta.json")}
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"text": ""}\n')
    with pytest.raises(NoDocumentsError, match="no shard written"):
        run(empty, tmp_path / "p")
    assert {p: open(p, "rb").read() for p in files} == files
    assert sorted(os.listdir(tmp_path)) == ["empty.jsonl", "good.jsonl"] + sorted(
        os.path.basename(p) for p in files)


def test_truncated_zstd_is_an_error_and_frames_concatenate(tmp_path):
    """A .zst cut inside a frame (a partial download) names the file, like a
    truncated .gz, instead of passing for a shorter corpus; concatenated frames
    (``zstd -c a b``) read as one file."""
    import zstandard

    docs = h.synthetic_docs(400)
    data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    frame = zstandard.ZstdCompressor().compress(data)
    cut = tmp_path / "cut.jsonl.zst"
    cut.write_bytes(frame[: len(frame) * 2 // 3])
    with pytest.raises(readers.InputError) as e:
        run(cut, tmp_path / "out")
    assert str(e.value) == (f"{cut}: cannot read: EOFError: compressed file ended inside a "
                            "zstd frame")
    assert not [n for n in os.listdir(tmp_path) if n.startswith("out")]
    two = tmp_path / "two.jsonl.zst"
    head = data[: data.index(b"\n", 1000) + 1]  # a frame shorter than one read
    two.write_bytes(frame + frame + zstandard.ZstdCompressor(level=9).compress(head) + frame)
    res = run(two, tmp_path / "two", chunk_bytes=4096)
    expected = docs + docs + docs[: head.count(b"\n")] + docs
    assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), expected)


def test_zstd_opening_with_a_skippable_frame_reads(tmp_path):
    """pzstd writes a skippable frame (magic 0x184D2A50) before every zstd
    frame; such a file reads as zstd, with the .zst suffix or without, and
    skippable frames between frames (any of the 16 magics) are skipped."""
    import struct

    import zstandard

    docs = h.synthetic_docs(20)
    frame = zstandard.ZstdCompressor().compress(
        "".join(json.dumps({"text": d}) + "\n" for d in docs).encode())
    data = (struct.pack("<II", 0x184D2A50, 4) + struct.pack("<i", len(frame)) + frame +
            struct.pack("<II", 0x184D2A5F, 3) + b"abc" + frame)
    for name in ("p.jsonl.zst", "p.jsonl"):
        (tmp_path / name).write_bytes(data)
        assert readers.detect(str(tmp_path / name)).compression == "zstd"
        res = run(tmp_path / name, tmp_path / "out")
        assert h.shard_docs(res["outputs"][0]) == h.encode_expected(h.tokenizer(), docs + docs)


def test_a_directory_walk_skips_the_shard_records_preprocess_writes(tmp_path):
    """``--input DIR -o DIR/x`` run twice: the second walk meets the first run's
    ``x_text_document.meta.json`` (a .json file), which is a shard's record, not a
    corpus file."""
    d = tmp_path / "corpus"
    d.mkdir()
    h.write_jsonl(d / "a.jsonl", h.synthetic_docs(10))
    first = run([d], d / "x")
    again = run([d], d / "x")
    assert [os.path.basename(i.path) for i in readers.discover([str(d)])] == ["a.jsonl"]
    assert again["counts"].documents == first["counts"].documents == 10
    assert again["counts"].skipped == {}
