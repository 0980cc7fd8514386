"""Shared helpers of the data_tools tests (a plain module, not a conftest).

The tokenizer is trained once per test session and reused: training is the
slow part, and every test only needs *a* small BPE model.
"""

from __future__ import annotations

import atexit
import gzip
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# Multi-byte UTF-8 on purpose: 2-byte (é, ß, Cyrillic), 3-byte (CJK, ₂, €),
# 4-byte (emoji, Gothic), combining marks, right-to-left script.
DOCS = [
    "Hello world. This is the first document.",
    "Déjà vu: the café serves crème brûlée for 12,50 € (about 13.45 $).",
    "Straße, Maß und Fuß; Привет, как дела?",
    "日本語のテキストも含まれています。中文也可以。",
    "Emoji 🦜🚀 and 𐍈 Gothic, e\u0301 combining, שלום עולם.",
    "Numbers 1234567890 and 3.14159 and 2025-01-31.",
    "   leading spaces and\ttabs\tinside   ",
    "Line one\nLine two\n\nafter a blank line",
    "def f(x):\n    return x ** 2  # code with indentation",
    "A longer document " + "with repeated words and more text " * 40,
]

_WORDS = ("the of and to in is for that with as on by this from at be are was which "
          "module function class return value data token text file shard index write "
          "read encode decode worker process stream chunk document corpus python "
          "café naïve Zürich привет мир 日本 中文 🦜 ünïcödé").split()

_TOKENIZER: dict[int, str] = {}


def line_docs() -> list[str]:
    """DOCS without newlines: each fits on one line of a text file."""
    return [d for d in DOCS if "\n" not in d]


def synthetic_docs(n: int, seed: int = 0, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(5, max_words))) +
            f". Number {rng.randint(0, 10**6)}." for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    data = "".join(json.dumps({key: d, "id": i}, ensure_ascii=False) + "\n"
                   for i, d in enumerate(docs)).encode()
    if str(path).endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    elif str(path).endswith(".zst"):
        import zstandard

        data = zstandard.ZstdCompressor().compress(data)
    path.write_bytes(data)
    return path


def tokenizer(vocab_size: int = 800) -> str:
    """Path of a small BPE model trained on DOCS + synthetic text (cached)."""
    if vocab_size not in _TOKENIZER:
        from data_tools import readers
        from data_tools.train_tokenizer import train

        folder = Path(tempfile.mkdtemp(prefix="dt-tok-"))
        atexit.register(shutil.rmtree, folder, True)  # cached for the session, then gone
        corpus = write_jsonl(folder / "train.jsonl", DOCS + synthetic_docs(300, seed=1))
        train(readers.discover([str(corpus)]), str(folder / "spm"), vocab_size,
              log=lambda m: None, threads=2)
        _TOKENIZER[vocab_size] = str(folder / "spm.model")
    return _TOKENIZER[vocab_size]


def encode_expected(model: str, docs: list[str]) -> list[list[int]]:
    """What each document must become in the shard: encode(doc) + [EOD]."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    return [sp.encode(d, out_type=int) + [sp.eos_id()] for d in docs]


def shard_docs(prefix: str) -> list[list[int]]:
    from data_tools.indexed import IndexedReader

    r = IndexedReader(prefix)
    return [r.document(i).tolist() for i in range(r.num_documents)]


def kvtrain(*args: str, check: bool = True, timeout: float = 120,
            **kw) -> subprocess.CompletedProcess:
    """Run ``kvtrain ARGS`` (the installed script, else ``python -m kvtrain.cli``)."""
    exe = Path(sys.executable).with_name("kvtrain")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvtrain.cli"]
    kw.setdefault("capture_output", "stdout" not in kw)  # a caller's own stdout: no capture
    proc = subprocess.run(cmd + list(args), text=True, cwd=ROOT, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        raise AssertionError(f"kvtrain {' '.join(args)} -> {proc.returncode}\n"
                             f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}")
    return proc


def files_in(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def random_documents(rng: np.random.Generator, n: int, high: int, max_len: int = 50):
    return [rng.integers(0, high, size=rng.integers(1, max_len)) for _ in range(n)]


__all__ = ["DOCS", "line_docs", "synthetic_docs", "write_jsonl", "tokenizer",
           "encode_expected", "shard_docs", "kvtrain", "files_in", "random_documents", "io", "os"]
