"""merge: joining shards equals preprocessing the concatenated inputs, and
equals megatron's IndexedDatasetBuilder.add_index."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dt_helpers as h  # noqa: E402

from data_tools import readers  # noqa: E402
from data_tools.indexed import IndexedReader, IndexedWriter  # noqa: E402
from data_tools.merge import merge  # noqa: E402
from data_tools.preprocess import preprocess  # noqa: E402

QUIET = dict(progress=False, log=lambda m: None)


def _bytes(prefix):
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")]


def test_merge_equals_preprocessing_the_concatenation(tmp_path):
    parts = [h.DOCS, h.synthetic_docs(50, seed=5), [], h.synthetic_docs(7, seed=6)]
    files = [h.write_jsonl(tmp_path / f"p{i}.jsonl", docs) for i, docs in enumerate(parts)]
    cat = tmp_path / "all.jsonl"
    cat.write_bytes(b"".join(f.read_bytes() for f in files))
    model = h.tokenizer()

    res = preprocess(readers.discover([str(f) for f in files]), model, str(tmp_path / "s" / "c"),
                     workers=2, **QUIET)
    assert len(res["outputs"]) == 4  # one shard per file, the empty one included
    preprocess(readers.discover([str(cat)]), model, str(tmp_path / "whole"), workers=0, **QUIET)
    merged = merge(res["outputs"], str(tmp_path / "m_text_document"), log=lambda m: None)
    assert _bytes(tmp_path / "m_text_document") == _bytes(tmp_path / "whole_text_document")
    assert merged["documents"] == sum(len(p) for p in parts)
    assert merged["counts"]["documents"] == merged["documents"]

    # The CLI, naming the shards by their preprocess prefix.
    h.kvtrain("data", "merge", "--output-prefix", str(tmp_path / "cli"), str(tmp_path / "s" / "c"))
    assert _bytes(tmp_path / "cli_text_document") == _bytes(tmp_path / "whole_text_document")
    meta = json.loads((tmp_path / "cli_text_document.meta.json").read_text())
    assert len(meta["merged_from"]) == 4


def test_merge_matches_megatron_add_index(tmp_path):
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(0)
    prefixes = []
    for i in range(3):
        docs = h.random_documents(rng, 30 * i + 1, 30000)
        with IndexedWriter(tmp_path / f"x{i}", np.uint16) as w:
            w.add_documents(np.concatenate(docs), [len(d) for d in docs])
            w.commit()
        prefixes.append(str(tmp_path / f"x{i}"))
    builder = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for p in prefixes:
        builder.add_index(p)
    builder.finalize(str(tmp_path / "ref.idx"))
    merge(prefixes, str(tmp_path / "ours"), log=lambda m: None)
    assert _bytes(tmp_path / "ours") == _bytes(tmp_path / "ref")


def test_merge_widens_mixed_dtypes(tmp_path):
    small = [np.array([1, 2, 3]), np.array([65000])]
    big = [np.array([70000, 5])]
    for name, docs, dtype in (("a", small, np.uint16), ("b", big, np.int32)):
        with IndexedWriter(tmp_path / name, dtype) as w:
            w.add_documents(np.concatenate(docs), [len(d) for d in docs])
            w.commit()
    merge([str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "m"), log=lambda m: None)
    r = IndexedReader(tmp_path / "m")
    assert r.dtype == np.int32 and r.check() == []
    assert [r.document(i).tolist() for i in range(3)] == [[1, 2, 3], [65000], [70000, 5]]


def test_merge_refuses_to_overwrite_an_input(tmp_path):
    with IndexedWriter(tmp_path / "a", np.uint16) as w:
        w.add_documents(np.arange(3), [3])
        w.commit()
    with pytest.raises(ValueError, match="also an input"):
        merge([str(tmp_path / "a")], str(tmp_path / "a"), log=lambda m: None)


def test_merge_refuses_a_damaged_input_in_one_line_writing_nothing(tmp_path):
    """An index whose sequence pointers do not follow its lengths (a shard damaged
    after it was written) is named with what is wrong, and no output appears."""
    import subprocess

    for name in ("good", "bad"):
        with IndexedWriter(tmp_path / name, np.uint16) as w:
            w.add_documents(np.arange(7), [3, 4])
            w.commit()
    idx = tmp_path / "bad.idx"
    raw = bytearray(idx.read_bytes())
    # header 9 + version 8 + dtype 1 + counts 16, lengths int32 [2], pointers int64 [2]
    pointers = 9 + 8 + 1 + 16 + 2 * 4
    raw[pointers + 8:pointers + 16] = (1000).to_bytes(8, "little")
    idx.write_bytes(bytes(raw))
    assert IndexedReader(tmp_path / "bad").check() == [
        "sequence pointers are not the running sum of the lengths"]
    done = subprocess.run([sys.executable, "-m", "data_tools", "merge", str(tmp_path / "good"),
                           str(tmp_path / "bad"), "--output-prefix", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr == (f"kvtrain data merge: error: {tmp_path / 'bad'}: damaged: sequence "
                           "pointers are not the running sum of the lengths\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.bin", "bad.idx", "good.bin",
                                                          "good.idx"]


def test_merge_refuses_shards_of_different_tokenizers_or_eod(tmp_path):
    """The metas name the tokenizer (sha256) and EOD id: shards that disagree
    are refused in one line naming both, before anything is written; a merge
    result records them, so merging it again is checked too."""
    src = h.write_jsonl(tmp_path / "a.jsonl", h.DOCS)

    def shard(name, vocab=800):
        return preprocess(readers.discover([str(src)]), h.tokenizer(vocab), str(tmp_path / name),
                          workers=0, **QUIET)["outputs"][0]

    a, b, c = shard("a"), shard("b", 1000), shard("c")
    before = sorted(os.listdir(tmp_path))
    with pytest.raises(ValueError) as e:
        merge([a, b], str(tmp_path / "m"), log=lambda m: None)
    assert str(e.value).startswith(f"{b}: made with another tokenizer (sha256) than {a} (")
    meta = json.loads(open(c + ".meta.json").read())
    meta["fingerprint"]["eod"] += 1
    open(c + ".meta.json", "w").write(json.dumps(meta))
    with pytest.raises(ValueError, match=f"^{c}: made with another EOD id than {a} "):
        merge([a, c], str(tmp_path / "m"), log=lambda m: None)
    assert sorted(os.listdir(tmp_path)) == before
    merged = merge([a, a], str(tmp_path / "m_text_document"), log=lambda m: None)
    assert merged["eod"] == meta["fingerprint"]["eod"] - 1
    with pytest.raises(ValueError, match="another tokenizer"):
        merge([str(tmp_path / "m_text_document"), b], str(tmp_path / "n"), log=lambda m: None)
    proc = h.kvtrain("data", "merge", "--output-prefix", str(tmp_path / "o"), a, b, check=False)
    assert proc.returncode == 1 and proc.stderr.count("\n") == 1, proc.stderr
