"""CLI smoke: the whole pipeline through ``kvtrain data ...`` subprocesses,
``python -m data_tools``, and the demo corpus."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402


def test_pipeline_through_kvtrain_data(tmp_path):
    corpus = tmp_path / "demo.jsonl"
    proc = h.kvtrain("data", "demo-corpus", "--output", str(corpus), "--max-mb", "0.4")
    assert "documents" in proc.stderr
    lines = corpus.read_text(encoding="utf-8").splitlines()
    assert len(lines) > 100
    first = json.loads(lines[0])
    assert first["text"] and first["id"].startswith("stdlib:")

    h.kvtrain("data", "train-tokenizer", "--input", str(corpus), "--vocab-size", "600",
              "--output", str(tmp_path / "tok"), "--threads", "2")
    side = json.loads((tmp_path / "tok.json").read_text())
    assert side["vocab_size"] == 600 and side["eod_id"] == 2 and side["pad_id"] == 3

    proc = h.kvtrain("data", "preprocess", "--input", str(corpus), "--tokenizer",
                     str(tmp_path / "tok.model"), "--output-prefix", str(tmp_path / "demo"),
                     "--workers", "2")
    assert f"{len(lines):,} written, 0 skipped" in proc.stdout
    assert "tokens/s" in proc.stdout and "MB/s" in proc.stdout
    prefix = tmp_path / "demo_text_document"
    expected = h.encode_expected(str(tmp_path / "tok.model"),
                                 [json.loads(line)["text"] for line in lines])
    assert h.shard_docs(str(prefix)) == expected

    proc = h.kvtrain("data", "inspect", str(tmp_path / "demo"), "--docs", "2")
    out = proc.stdout
    assert "version 1, dtype uint16 (code 8)" in out
    assert f"documents  {len(lines):,}" in out
    assert f"tokens     {sum(map(len, expected)):,}" in out
    assert "check      OK" in out
    assert "document length histogram (tokens):" in out
    assert "documents not ending in EOD: 0" in out  # tokenizer found via the meta
    assert first["text"].splitlines()[0] in out  # first document decoded

    proc = h.kvtrain("data", "merge", "--output-prefix", str(tmp_path / "twice"),
                     str(prefix), str(prefix) + ".idx")
    assert "merge: wrote" in proc.stderr
    assert h.shard_docs(str(tmp_path / "twice_text_document")) == expected + expected

    proc = h.kvtrain("data", "inspect", str(tmp_path / "nothing"), check=False)
    assert proc.returncode == 1 and "no IndexedDataset" in proc.stderr


def test_python_m_data_tools_and_light_help():
    proc = subprocess.run([sys.executable, "-m", "data_tools", "--help"], capture_output=True,
                          text=True, cwd=h.ROOT, timeout=60)
    assert proc.returncode == 0
    for cmd in ("train-tokenizer", "preprocess", "merge", "inspect", "demo-corpus"):
        assert cmd in proc.stdout
    # `kvtrain data --help` loads neither the trainer stack nor the tokenizer.
    code = ("import sys\nfrom kvtrain.cli import main\n"
            "try:\n    main(['data', 'preprocess', '--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = {'torch', 'megatron', 'sentencepiece', 'numpy', 'pyarrow'} & "
            "{m.split('.')[0] for m in sys.modules}\nprint(sorted(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=h.ROOT, timeout=60)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr


def test_demo_corpus_is_deterministic(tmp_path):
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"demo{seed}.jsonl"
        subprocess.run([sys.executable, "-m", "data_tools", "demo-corpus", "--output", str(out)],
                       check=True, capture_output=True, cwd=h.ROOT, timeout=120,
                       env={**os.environ, "PYTHONHASHSEED": seed})
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    size = len(outs[0])
    assert 1_000_000 < size < 20_000_000  # "a few MB"
    texts = [json.loads(line)["text"] for line in outs[0].splitlines()]
    assert all(t.strip() for t in texts)
    assert not any(" at 0x" in t for t in texts)  # no memory addresses
    # nor where this checkout or its Python lives (platform.architecture's default is
    # sys.executable): the same corpus, tokenizer and demo numbers from any folder
    local = [p for p in (sys.executable, sys.prefix, str(h.ROOT)) if len(p) > 1]
    assert not [t.splitlines()[0] for t in texts if any(p in t for p in local)]
    ids = [json.loads(line)["id"] for line in outs[0].splitlines()]
    assert len(set(ids)) == len(ids)


def _one_error_line(proc, command: str) -> str:
    """The one line a data command fails with (exit 1, no traceback)."""
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr.strip()
    assert "Traceback" not in err and "\n" not in err, err
    assert err.startswith(f"kvtrain data {command}: error: "), err
    return err


def test_output_paths_that_cannot_be_written_are_one_line(tmp_path):
    """An output under a file (a typo in -o) fails in one line naming the path,
    for every command that writes, and leaves no temporary file behind."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    tok, shard = h.tokenizer(), tmp_path / "s"
    h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", tok, "-o", str(shard), "-j", "0")
    for command, args in (
            ("demo-corpus", ["-o", f"{blocker}/c.jsonl", "--max-mb", "0.01"]),
            ("demo-corpus", ["-o", str(tmp_path)]),
            ("train-tokenizer", ["-i", str(corpus), "--vocab-size", "300", "-o", f"{blocker}/t"]),
            ("preprocess", ["-i", str(corpus), "-t", tok, "-o", f"{blocker}/p", "-j", "0"]),
            ("merge", ["-o", f"{blocker}/m", f"{shard}_text_document"])):
        err = _one_error_line(h.kvtrain("data", command, *args, check=False), command)
        assert err.endswith(f"{blocker} is a file, not a folder"
                            if str(blocker) in args[args.index("-o") + 1] else f"{tmp_path}: Is a directory"), err
    assert sorted(os.listdir(tmp_path)) == [
        "c.jsonl", "file", "s_text_document.bin", "s_text_document.idx",
        "s_text_document.meta.json"]


def test_preprocess_option_and_tokenizer_mistakes_are_one_line(tmp_path):
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _one_error_line(h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", str(corpus),
                                    "-o", str(tmp_path / "p"), check=False), "preprocess")
    assert err.endswith(f"{corpus}: not a sentencepiece model (could not parse it)")
    err = _one_error_line(h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                                    "-o", str(tmp_path / "p"), "--chunk-mb", "0", check=False),
                          "preprocess")
    assert err.endswith("--chunk-mb must be positive, got 0.0")
    from data_tools.preprocess import default_workers

    cpus = default_workers()
    for option, value, why in (("--shards", "0", "--shards must be at least 1, got 0"),
                               ("-j", "-1", "--workers must be 0 (no subprocess) or more, "
                                            "got -1"),
                               # a typo's 100000 processes each loaded the tokenizer
                               ("-j", "100000", f"--workers must be at most the {cpus} CPUs "
                                                "this process may use (tokenizing is "
                                                "CPU-bound: more processes only take memory), "
                                                "got 100000")):
        err = _one_error_line(h.kvtrain("data", "preprocess", "-i", str(corpus), "-t",
                                        h.tokenizer(), "-o", str(tmp_path / "p"), option, value,
                                        check=False), "preprocess")
        assert err.endswith(why), err
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_more_shards_than_input_files_is_said(tmp_path):
    """--shards groups the input files: 5 asked of one file gave one shard, silently."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    done = h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", h.tokenizer(), "-o",
                     str(tmp_path / "p"), "--shards", "5", "--quiet")
    assert "kvtrain data preprocess: warning: --shards 5 with 1 input file: 1 shard (inputs " \
        "are grouped into shards, a file is not split)" in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.glob("p*.idx")) == ["p_text_document.idx"]


@pytest.mark.parametrize("option, values, message", [
    # sentencepiece's seed is 32-bit unsigned: --seed -1 was a TypeError traceback
    ("--seed", ("-1", str(2**32)), "--seed must be in [0, 2**32 - 1], got {}"),
    # --max-documents 0 silently read every document, and -1 stopped after one (then
    # sentencepiece failed on 'Vocabulary size too high')
    ("--max-documents", ("0", "-1"), "--max-documents must be at least 1, got {}"),
])
def test_train_tokenizer_values_out_of_range_are_one_line(tmp_path, option, values, message):
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    for value in values:
        err = _one_error_line(h.kvtrain("data", "train-tokenizer", "-i", str(corpus),
                                        "--vocab-size", "300", "-o", str(tmp_path / "t"),
                                        option, value, check=False), "train-tokenizer")
        assert err.endswith(message.format(value)), err
    assert sorted(os.listdir(tmp_path)) == ["c.jsonl"]


def test_demo_corpus_max_mb_not_positive_is_one_line(tmp_path):
    """--max-mb 0 silently wrote the whole corpus, and -1 one document."""
    for mb in ("0", "-1", "nan"):
        err = _one_error_line(h.kvtrain("data", "demo-corpus", "-o", str(tmp_path / "c.jsonl"),
                                        "--max-mb", mb, check=False), "demo-corpus")
        assert err.endswith(f"--max-mb must be positive, got {float(mb)}"), err
    assert os.listdir(tmp_path) == []


def test_inspect_with_a_damaged_meta_file_still_reports(tmp_path):
    """The .meta.json next to a shard is a record, not the data: damaged, it is
    one warning naming it and the report goes on."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
              "-o", str(tmp_path / "s"), "-j", "0")
    meta = tmp_path / "s_text_document.meta.json"
    meta.write_text('{"counts": ')
    proc = h.kvtrain("data", "inspect", str(tmp_path / "s"), "--docs", "1", check=False)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert f"warning: {meta}: not read (not JSON: " in proc.stdout
    assert "check      OK" in proc.stdout and "--- document 0:" in proc.stdout


def _refused(capsys, command: str, *args: str) -> str:
    """The one line a data command run in-process fails with (exit 1)."""
    from data_tools.cli import main

    assert main([command, *args]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith(f"kvtrain data {command}: error: "), err
    return err


def test_inspect_negative_docs_or_max_chars_is_one_line(tmp_path, capsys):
    """--docs -1 showed no document and --max-chars -5 cut 5 characters off
    each one's end, both with exit 0."""
    import numpy as np

    from data_tools.indexed import IndexedWriter

    with IndexedWriter(tmp_path / "s", np.uint16) as w:
        w.add_documents(np.arange(1, 7, dtype=np.uint16), np.array([3, 3], dtype=np.int32))
        w.commit()
    for option, value in (("--docs", "-1"), ("--max-chars", "-5")):
        err = _refused(capsys, "inspect", str(tmp_path / "s"), option, value)
        assert err.endswith(f"{option} must be 0 or more, got {value}"), err


def test_train_tokenizer_options_outside_sentencepiece_limits_are_one_line(tmp_path, capsys):
    """These failed in sentencepiece's words ('INTERNAL: trainer_interface.cc(94)
    [trainer_spec.character_coverage() >= 0.98 ...]'), or --threads 0 silently
    meant all cores; now refused before the corpus is read, naming the option."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    base = ["-i", str(corpus), "-o", str(tmp_path / "t")]
    for option, value, why in (
            ("--vocab-size", "0", "at least 261 (4 special pieces, 256 byte pieces and a "
                                  "character)"),
            ("--threads", "-1", "in [1, 1024]"), ("--threads", "0", "in [1, 1024]"),
            ("--character-coverage", "2.0", "in [0.98, 1.0]"),
            ("--character-coverage", "nan", "in [0.98, 1.0]"),
            ("--max-sentences", "-1", "at least 1")):
        args = base + (["--vocab-size", "300"] if option != "--vocab-size" else []) + [
            option, value]
        err = _refused(capsys, "train-tokenizer", *args)
        assert err.endswith(f"{option} must be {why}, got {value}"), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_train_tokenizer_vocab_size_the_corpus_cannot_fit_names_our_options(tmp_path, capsys):
    """sentencepiece said 'INTERNAL: src/trainer_interface.cc(638) [...] Increase
    vocab_size or decrease character_coverage with --character_coverage option':
    options this CLI spells otherwise."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _refused(capsys, "train-tokenizer", "-i", str(corpus), "-o", str(tmp_path / "t"),
                   "--vocab-size", "300")
    assert re.search(r"error: --vocab-size 300 is smaller than the (\d+) pieces this corpus "
                     r"needs \(4 special, 256 byte pieces and (\d+) characters at "
                     r"--character-coverage 0.99995\): raise --vocab-size or lower "
                     r"--character-coverage \(to 0.98\)$", err), err
    err = _refused(capsys, "train-tokenizer", "-i", str(corpus), "-o", str(tmp_path / "t"),
                   "--vocab-size", "60000")
    assert re.search(r"error: --vocab-size 60000 is more pieces than this corpus gives: "
                     r"at most \d+ here; give a smaller --vocab-size or more text$", err), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_output_prefix_naming_a_folder_is_one_line(tmp_path, capsys):
    """-o out/ wrote out.model (train-tokenizer) and out_text_document
    (preprocess) beside the folder, and merge wrote out/_text_document in it."""
    import numpy as np

    from data_tools.indexed import IndexedWriter

    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    with IndexedWriter(tmp_path / "s_text_document", np.uint16) as w:
        w.add_documents(np.arange(1, 7, dtype=np.uint16), np.array([3, 3], dtype=np.int32))
        w.commit()
    (tmp_path / "out").mkdir()
    before = sorted(os.listdir(tmp_path))
    for out in (f"{tmp_path}/out/", f"{tmp_path}/out/.", f"{tmp_path}/out/.."):
        for command, option, args, name in (
                ("train-tokenizer", "--output", ["-i", str(corpus), "--vocab-size", "400"],
                 "tokenizer"),
                ("preprocess", "--output-prefix", ["-i", str(corpus), "-t", h.tokenizer(),
                                                   "-j", "0"], "corpus"),
                ("merge", "--output-prefix", [f"{tmp_path}/s_text_document"], "corpus")):
            err = _refused(capsys, command, *args, option, out)
            assert err.endswith(f"{option} {out} names a folder, not a file name prefix: "
                                f"give a name in it, e.g. {os.path.join(out, name)}"), err
    assert sorted(os.listdir(tmp_path)) == before and os.listdir(tmp_path / "out") == []


def test_preprocess_chunk_mb_below_a_byte_or_past_a_gib_is_one_line(tmp_path, capsys):
    """--chunk-mb 1e-9 read 0-byte chunks ("no documents ... no records"), inf
    was an OverflowError traceback and 1e9 a MemoryError one."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    for mb in ("1e-09", "inf", "1000000000.0"):
        err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                       "-o", str(tmp_path / "p"), "-j", "0", "--chunk-mb", mb)
        assert err.endswith(f"--chunk-mb must be from one byte (1e-06) to 1024 (1 GiB), "
                            f"got {mb}"), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_preprocess_resume_with_force_is_one_line(tmp_path, capsys):
    """--resume keeps the shards an earlier run completed, --force replaces them: both
    at once resumed, unsaid (a probe's)."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "p"), "-j", "0", "--resume", "--force")
    assert err.endswith("--resume and --force: --resume keeps the shards an earlier run "
                        "completed, --force replaces them; give one"), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_an_output_prefix_ending_in_what_the_tool_adds_is_one_line(tmp_path, capsys):
    """``train-tokenizer -o t.model`` wrote t.model.model (.vocab, .json) and
    ``preprocess -o d_text_document`` d_text_document_text_document.bin/.idx, unsaid
    (a probe's); ``merge`` takes either form, as before."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    out = str(tmp_path / "t.model")
    err = _refused(capsys, "train-tokenizer", "-i", str(corpus), "--vocab-size", "300",
                   "-o", out)
    assert err.endswith(f"--output {out}: give the prefix without .model, which the tool "
                        f"adds ({tmp_path / 't'} writes {out})"), err
    out = str(tmp_path / "d_text_document")
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(), "-o", out,
                   "-j", "0")
    assert err.endswith(f"--output-prefix {out}: give the prefix without _text_document, "
                        f"which the tool adds ({tmp_path / 'd'} writes {out})"), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_preprocess_negative_report_bad_is_one_line(tmp_path, capsys):
    """--report-bad -1 silently meant 0 (no bad record printed)."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    err = _refused(capsys, "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
                   "-o", str(tmp_path / "p"), "-j", "0", "--report-bad", "-1")
    assert err.endswith("--report-bad must be 0 or more, got -1"), err
    assert os.listdir(tmp_path) == ["c.jsonl"]


def test_demo_corpus_infinite_max_mb_is_one_line(tmp_path, capsys):
    """--max-mb inf was an OverflowError traceback."""
    err = _refused(capsys, "demo-corpus", "-o", str(tmp_path / "c.jsonl"), "--max-mb", "inf")
    assert err.endswith("--max-mb must be finite (leave it out for the whole corpus), got inf")
    assert os.listdir(tmp_path) == []


def test_merge_into_one_of_its_named_inputs_is_refused_keeping_it(tmp_path, capsys):
    """``merge -o d d e``: the input named like the output was dropped from the inputs
    (meant for a glob matching an earlier merge result), so d was replaced by e
    alone, exit 0: d's documents lost. A glob still skips the output."""
    import numpy as np

    from data_tools.cli import main
    from data_tools.indexed import IndexedWriter

    for name, n in (("d", 5), ("e", 3)):
        with IndexedWriter(tmp_path / f"{name}_text_document", np.uint16) as w:
            w.add_documents(np.arange(n, dtype=np.uint16), [n])
            w.commit()
    kept = (tmp_path / "d_text_document.bin").read_bytes()
    for inputs in ([str(tmp_path / "d"), str(tmp_path / "e")],
                   [str(tmp_path / "d_text_document.idx"), str(tmp_path / "e_text_document")]):
        err = _refused(capsys, "merge", "-o", str(tmp_path / "d"), *inputs)
        assert err.endswith("the output is also an input"), err
        assert (tmp_path / "d_text_document.bin").read_bytes() == kept
    # a glob over both (d matched as an earlier result) merges e alone into d, which
    # replaces d: refused without --force, which a rerun into its output means
    err = _refused(capsys, "merge", "-o", str(tmp_path / "d"), str(tmp_path / "*.idx"))
    assert err.endswith("d_text_document.idx exist (--force replaces them, or give another "
                        "--output-prefix)"), err
    assert (tmp_path / "d_text_document.bin").read_bytes() == kept
    assert main(["merge", "-o", str(tmp_path / "d"), str(tmp_path / "*.idx"), "--force"]) == 0
    capsys.readouterr()
    assert (tmp_path / "d_text_document.bin").read_bytes() == \
        (tmp_path / "e_text_document.bin").read_bytes()


def test_inspect_of_a_damaged_document_index_reports_it_without_a_traceback(tmp_path):
    """A document index entry pointing past the sequences: the length histogram
    was computed before the check (an IndexError traceback); now the check's
    FAILED line and exit 1."""
    import numpy as np

    from data_tools.indexed import HEADER_SIZE, IndexedWriter

    with IndexedWriter(tmp_path / "s_text_document", np.uint16) as w:
        for n in (3, 4, 2):
            w.add_documents(np.arange(1, n + 1, dtype=np.uint16), [n])
        w.commit()
    idx = tmp_path / "s_text_document.idx"
    data = bytearray(idx.read_bytes())
    S = 3  # sequences: the document index starts after 4 S bytes of lengths, 8 S of pointers
    data[HEADER_SIZE + 12 * S + 8:HEADER_SIZE + 12 * S + 16] = (10**9).to_bytes(8, "little")
    idx.write_bytes(bytes(data))
    proc = h.kvtrain("data", "inspect", str(tmp_path / "s_text_document"), check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "check      FAILED: document indices decrease" in proc.stdout, proc.stdout


def test_inspect_into_a_closed_pipe_ends_quietly(tmp_path):
    """``kvtrain data inspect PREFIX | head`` ended with "error: Broken pipe" and
    exit 1, as if the shard were unreadable: a reader that stopped reading is
    the shell's ordinary end of a pipeline (exit 141 as coreutils', 128 + SIGPIPE)."""
    corpus = h.write_jsonl(tmp_path / "c.jsonl", h.DOCS)
    h.kvtrain("data", "preprocess", "-i", str(corpus), "-t", h.tokenizer(),
              "-o", str(tmp_path / "s"), "-j", "0")
    read_end, write_end = os.pipe()
    os.close(read_end)  # `head` has read its lines and gone
    try:
        proc = h.kvtrain("data", "inspect", str(tmp_path / "s"), "--docs", "3", check=False,
                         stdout=write_end, stderr=subprocess.PIPE)
    finally:
        os.close(write_end)
    assert proc.returncode == 141 and proc.stderr == "", (proc.returncode, proc.stderr)
