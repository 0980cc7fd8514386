"""Loading a trained sentencepiece tokenizer, and its JSON sidecar.

``SentencePieceTokenizer`` is what the trainer hands to megatron-core's
``GPTDatasetConfig``: megatron reads ``vocab_size``, ``eod``, ``pad`` and
``unique_identifiers`` (a JSON-able dict hashed into the dataset cache name).

The sidecar ``PREFIX.json`` written next to ``PREFIX.model`` records the
special ids so the trainer can size the embedding and mask padding without
loading sentencepiece::

    {"model": "PREFIX.model", "vocab_size": 32000, "unk_id": 0, "bos_id": 1,
     "eos_id": 2, "pad_id": 3, "eod_id": 2, "model_sha256": "...", ...}

``eod_id`` is the id preprocess appends after every document: the EOS piece.
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import cached_property

SIDECAR_VERSION = 1


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sidecar_path(model_path: str | os.PathLike) -> str:
    """``foo.model`` -> ``foo.json``."""
    root, ext = os.path.splitext(os.fspath(model_path))
    return (root if ext == ".model" else os.fspath(model_path)) + ".json"


def resolve_model_path(path: str | os.PathLike) -> str:
    """Accept ``PREFIX``, ``PREFIX.model`` or ``PREFIX.json`` for a tokenizer."""
    path = os.fspath(path)
    if path.endswith(".json") and os.path.isfile(path):
        model = _read_sidecar(path).get("model", "")
        candidate = os.path.join(os.path.dirname(path), os.path.basename(model))
        if model and os.path.isfile(candidate):
            return candidate
        path = path[: -len(".json")]
    if os.path.isfile(path):
        return path
    if os.path.isfile(path + ".model"):
        return path + ".model"
    raise FileNotFoundError(f"no sentencepiece model at {path} (nor {path}.model)")


def _read_sidecar(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            side = json.load(f)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"{path}: not a tokenizer sidecar (not JSON: {e})") from None
    if not isinstance(side, dict):
        raise ValueError(f"{path}: not a tokenizer sidecar (not a JSON object)")
    return side


class SentencePieceTokenizer:
    """A sentencepiece model with the interface megatron-core datasets expect.

    ``eod`` is the EOS id (what preprocess appends after each document); ``pad``
    is the model's pad id, or -1 when it has none (megatron then masks nothing).
    Pickles by path, so it can cross into dataloader workers.
    """

    def __init__(self, model_path: str | os.PathLike) -> None:
        import sentencepiece as spm  # deferred: `kvtrain data --help` stays instant

        self.model_path = resolve_model_path(model_path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.model_path)
        except RuntimeError as e:  # sentencepiece's C++ status, e.g. a corpus given as -t
            why = "could not parse it" if "parse" in str(e) else str(e).strip().splitlines()[0]
            raise ValueError(f"{self.model_path}: not a sentencepiece model ({why})") from None
        if self._sp.eos_id() < 0:
            raise ValueError(f"{self.model_path}: the model has no EOS piece to use as EOD")

    def __getstate__(self) -> dict:
        return {"model_path": self.model_path}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["model_path"])

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.model_path!r}, vocab_size={self.vocab_size})"

    @property
    def processor(self):
        """The underlying ``sentencepiece.SentencePieceProcessor``."""
        return self._sp

    @property
    def vocab_size(self) -> int:
        return self._sp.get_piece_size()

    @property
    def eod(self) -> int:
        return self._sp.eos_id()

    @property
    def eos(self) -> int:
        return self._sp.eos_id()

    @property
    def bos(self) -> int:
        return self._sp.bos_id()

    @property
    def pad(self) -> int:
        return self._sp.pad_id()

    @property
    def unk(self) -> int:
        return self._sp.unk_id()

    @cached_property
    def sha256(self) -> str:
        return sha256_file(self.model_path)

    @property
    def unique_identifiers(self) -> dict:
        # Content, not path: moving the model keeps megatron's index caches valid,
        # retraining it invalidates them.
        return {
            "class": type(self).__name__,
            "model_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "eod": self.eod,
            "pad": self.pad,
        }

    def encode(self, text: str) -> list[int]:
        """Ids of ``text``, no BOS/EOS added."""
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int, num_threads=num_threads)

    def decode(self, ids) -> str:
        return self._sp.decode([int(i) for i in ids])

    def id_to_piece(self, i: int) -> str:
        return self._sp.id_to_piece(int(i))

    def tokenize(self, text: str) -> list[int]:
        """Alias of ``encode`` (megatron's tokenizer naming)."""
        return self.encode(text)

    def detokenize(self, ids) -> str:
        return self.decode(ids)

    def sidecar(self) -> dict:
        """The sidecar dict for this model (see the module docstring)."""
        return {
            "version": SIDECAR_VERSION,
            "model": os.path.basename(self.model_path),
            "model_sha256": self.sha256,
            "type": "sentencepiece",
            "vocab_size": self.vocab_size,
            "unk_id": self.unk,
            "bos_id": self.bos,
            "eos_id": self.eos,
            "pad_id": self.pad,
            "eod_id": self.eod,
        }
