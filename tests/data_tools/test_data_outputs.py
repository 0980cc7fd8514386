"""Outputs that exist: every data command that writes refuses to replace them, in
one line naming them, unless ``--force`` (preprocess: or ``--resume``); what a
forced replacement cut short leaves is never a record describing other files."""

from __future__ import annotations

import errno
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402
from test_data_cli import _refused  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.cli import main  # noqa: E402
from data_tools.indexed import IndexedWriter  # noqa: E402
from data_tools.tokenizer import sha256_file  # noqa: E402


def _ok(capsys, command: str, *args: str) -> None:
    assert main([command, *args]) == 0, capsys.readouterr().err
    capsys.readouterr()


def _shard(prefix, docs) -> str:
    with IndexedWriter(prefix, np.uint16) as w:
        w.add_documents(np.concatenate([np.asarray(d) for d in docs]), [len(d) for d in docs])
        w.commit()
    return str(prefix)


def _files(tmp_path, stem: str) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tmp_path.glob(stem + "*"))}


def test_train_tokenizer_refuses_an_existing_tokenizer_without_force(tmp_path, capsys):
    """``-o t`` where t.model is: it was replaced, exit 0, and the shards and runs made
    with it no longer matched. The side files alone (t.json) count too."""
    corpus = str(h.write_jsonl(tmp_path / "c.jsonl", h.synthetic_docs(200, seed=3)))
    t = tmp_path / "t"
    args = ["-i", corpus, "-o", str(t), "--threads", "1", "--vocab-size"]
    _ok(capsys, "train-tokenizer", *args, "400")
    before = _files(tmp_path, "t")
    err = _refused(capsys, "train-tokenizer", *args, "500")
    assert err.endswith(f"{t}.model, t.vocab and t.json exist (--force replaces them, "
                        f"or give another --output)"), err
    assert _files(tmp_path, "t") == before
    (tmp_path / "t.model").unlink()
    (tmp_path / "t.vocab").unlink()
    err = _refused(capsys, "train-tokenizer", *args, "500")
    assert err.endswith(f"{t}.json exists (--force replaces it, or give another --output)")
    _ok(capsys, "train-tokenizer", *args, "500", "--force")
    assert json.loads((tmp_path / "t.json").read_text())["vocab_size"] == 500


def test_merge_refuses_an_existing_output_without_force(tmp_path, capsys):
    """``merge -o m b`` where m_text_document was merged from a: replaced by b, exit 0."""
    a = _shard(tmp_path / "a_text_document", [[1, 2], [3]])
    b = _shard(tmp_path / "b_text_document", [[4, 5, 6]])
    m = tmp_path / "m_text_document"
    _ok(capsys, "merge", "-o", str(tmp_path / "m"), a)
    before = _files(tmp_path, "m_")
    err = _refused(capsys, "merge", "-o", str(tmp_path / "m"), b)
    assert err.endswith(f"{m}.bin, m_text_document.idx and m_text_document.meta.json exist "
                        f"(--force replaces them, or give another --output-prefix)"), err
    assert _files(tmp_path, "m_") == before
    _ok(capsys, "merge", "-o", str(tmp_path / "m"), b, "--force")
    assert h.shard_docs(str(m)) == [[4, 5, 6]]


def test_preprocess_refuses_shards_already_at_its_prefix_without_force_or_resume(
        tmp_path, capsys):
    """A run into a prefix holding another run's shards (another tokenizer, other
    inputs) replaced them, exit 0; a plan that would remove an earlier plan's
    shards too. --resume goes on with them, --force replaces them."""
    one = str(h.write_jsonl(tmp_path / "one.jsonl", h.DOCS))
    two = str(h.write_jsonl(tmp_path / "two.jsonl", h.synthetic_docs(5)))
    p = tmp_path / "out" / "p"
    base = ["-t", h.tokenizer(), "-o", str(p), "-j", "0", "-q"]
    _ok(capsys, "preprocess", "-i", one, two, *base)
    before = _files(tmp_path / "out", "p_")
    first = tmp_path / "out" / "p_00000_text_document"
    keep = "--resume keeps the complete ones, --force replaces them"
    what = f"{first}.bin, p_00000_text_document.idx, p_00000_text_document.meta.json and 3 more"
    for inputs in ([two, one], [one]):  # the same shards written; one shard, both removed
        err = _refused(capsys, "preprocess", "-i", *inputs, *base)
        assert err.endswith(f"{what} exist ({keep}, or give another --output-prefix)"), err
        assert _files(tmp_path / "out", "p_") == before
    _ok(capsys, "preprocess", "-i", one, two, *base, "--resume")
    assert _files(tmp_path / "out", "p_") == before
    _ok(capsys, "preprocess", "-i", one, *base, "--force")
    assert sorted(os.listdir(tmp_path / "out")) == [
        "p_text_document.bin", "p_text_document.idx", "p_text_document.meta.json"]


def test_demo_corpus_refuses_an_existing_file_without_force(tmp_path, capsys):
    """``demo-corpus -o corpus.jsonl`` replaced the file there (a real corpus, by a typo)."""
    out = tmp_path / "corpus.jsonl"
    out.write_text('{"text": "mine"}\n')
    err = _refused(capsys, "demo-corpus", "-o", str(out), "--max-mb", "0.01")
    assert err.endswith(f"{out} exists (--force replaces it, or give another --output)"), err
    assert out.read_text() == '{"text": "mine"}\n'
    _ok(capsys, "demo-corpus", "-o", str(out), "--max-mb", "0.01", "--force")
    assert out.read_text().startswith('{"id": "stdlib:')


def _failing_write(module, monkeypatch, suffix: str) -> None:
    """``module.atomic_write_bytes`` fails (a full disk) for the name ending in ``suffix``."""
    real = module.atomic_write_bytes

    def write(path, data):
        if str(path).endswith(suffix):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, data)

    monkeypatch.setattr(module, "atomic_write_bytes", write)


def test_a_forced_tokenizer_cut_short_leaves_no_sidecar_of_the_old_model(tmp_path, monkeypatch):
    """Replacing t (--force) and failing after the new t.model: the old t.json stayed,
    describing the old model (its sha256, vocab size) next to the new one."""
    from data_tools import train_tokenizer

    corpus = readers.discover([str(h.write_jsonl(tmp_path / "c.jsonl",
                                                 h.synthetic_docs(200, seed=3)))])
    t = str(tmp_path / "t")
    train_tokenizer.train(corpus, t, 400, threads=1, log=lambda m: None)
    _failing_write(train_tokenizer, monkeypatch, ".vocab")
    with pytest.raises(OSError):
        train_tokenizer.train(corpus, t, 500, threads=1, log=lambda m: None)
    assert not os.path.exists(t + ".json") or json.loads(
        open(t + ".json").read())["model_sha256"] == sha256_file(t + ".model")


def test_a_forced_merge_cut_short_leaves_no_meta_of_the_old_output(tmp_path, monkeypatch):
    """Replacing m (--force) and failing after the new .bin/.idx: the old .meta.json
    stayed, saying m was merged from a (and with a's tokenizer) while it held b."""
    from data_tools import merge as merge_module

    a = _shard(tmp_path / "a_text_document", [[1, 2], [3]])
    (tmp_path / "a_text_document.meta.json").write_text(
        json.dumps({"tokenizer_sha256": "aa" * 32, "eod": 2}))
    b = _shard(tmp_path / "b_text_document", [[4, 5, 6]])
    m = str(tmp_path / "m_text_document")
    merge_module.merge([a], m, log=lambda m: None)
    _failing_write(merge_module, monkeypatch, ".meta.json")
    with pytest.raises(OSError):
        merge_module.merge([b], m, log=lambda m: None)
    assert h.shard_docs(m) == [[4, 5, 6]] and not os.path.exists(m + ".meta.json")
