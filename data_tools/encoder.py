"""Worker side of ``preprocess``: raw chunk -> token array + document lengths.

Each worker process loads the sentencepiece model once (``init_worker``) and
then turns ``readers.Chunk``s into ``Encoded`` results: the documents'
tokens concatenated, each followed by EOD, as one numpy array in the output
dtype, plus one length per document. The main process only writes those
arrays, so no per-token Python work happens anywhere: sentencepiece's batch
encode returns numpy buffers (sentencepiece >= 0.2.1) that are concatenated in
C; older versions fall back to id lists flattened with ``np.fromiter``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from data_tools import readers
from data_tools.lifeline import die_with_parent


@dataclass
class ShardEnd:
    """Marker sent through the pool after a shard's last chunk, so the main
    process commits the shard in order (also when it had no chunk at all)."""
    shard: int


@dataclass
class Encoded:
    shard: int
    path: str
    tokens: np.ndarray            # output dtype, EOD after every document
    lengths: np.ndarray           # int32, tokens per document including EOD
    counts: dict[str, int] = field(default_factory=dict)   # skipped, by reason
    samples: list[tuple[str, str, str]] = field(default_factory=list)
    text_bytes: int = 0           # decompressed input bytes of the chunk
    disk_bytes: int = 0           # on-disk input bytes of the chunk


class ChunkEncoder:
    def __init__(self, model_path: str, dtype: type, json_key: str, keep_samples: int = 5) -> None:
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_file=model_path)
        self.eod = self.sp.eos_id()
        self.dtype = np.dtype(dtype).type
        self.json_key = json_key
        self.keep_samples = keep_samples
        self._eod = np.array([self.eod], dtype=np.int32)
        try:  # numpy buffers from the C++ batch encoder, when this version has them
            self.sp.encode(["a"], out_type="numpy", num_threads=1)
            self._numpy = True
        except (ValueError, TypeError, AttributeError):
            self._numpy = False

    def __call__(self, item):
        if isinstance(item, ShardEnd):
            return item
        res = readers.parse_chunk(item, self.json_key, self.keep_samples)
        tokens, lengths = self.encode(res.texts)
        if item.kind == "lines":
            text_bytes = len(item.payload)
        else:
            text_bytes = sum(len(v) for v in item.payload if isinstance(v, (str, bytes)))
        return Encoded(item.shard, item.path, tokens, lengths, res.counts, res.samples,
                       text_bytes, item.disk_bytes)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Tokens of all texts, each followed by EOD, and their lengths."""
        if not texts:
            return np.zeros(0, dtype=self.dtype), np.zeros(0, dtype=np.int32)
        # num_threads=1: parallelism comes from the worker processes; threads on
        # top would only oversubscribe the cores.
        if self._numpy:
            arrays = self.sp.encode(texts, out_type="numpy", num_threads=1)
            lengths = np.fromiter((a.size + 1 for a in arrays), np.int32, len(arrays))
            pieces = [None] * (2 * len(arrays))
            pieces[0::2] = arrays
            pieces[1::2] = itertools.repeat(self._eod, len(arrays))
            tokens = np.concatenate(pieces, dtype=self.dtype, casting="unsafe")
        else:
            ids = self.sp.encode(texts, out_type=int, num_threads=1)
            lengths = np.fromiter((len(x) + 1 for x in ids), np.int32, len(ids))
            for x in ids:
                x.append(self.eod)
            tokens = np.fromiter(itertools.chain.from_iterable(ids), self.dtype,
                                 int(lengths.sum(dtype=np.int64)))
        return tokens, lengths


_encoder: ChunkEncoder | None = None


def init_worker(model_path: str, dtype: type, json_key: str, keep_samples: int,
                parent_pid: int | None) -> None:
    """Pool initializer: load the model once per process."""
    global _encoder
    # If the main process is SIGKILLed, its pool workers would wait on their task
    # pipe forever. (Under forkserver the parent is the server, which exits with
    # the main process: parent_pid is None then.)
    die_with_parent(parent_pid)
    _encoder = ChunkEncoder(model_path, dtype, json_key, keep_samples)


def encode_item(item):
    return _encoder(item)
