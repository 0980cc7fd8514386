"""A small tokenized corpus with real structure, written as megatron shards.

Used by the tests and by ``kvtrain demo`` when the data tools (corpus,
tokenizer, preprocessing) are not available. Documents are walks of a fixed
sparse Markov chain (each token has four likely successors) with spans copied
from earlier in the document (the repeats induction heads learn), ended by an
end-of-document token. A model can learn a lot of it quickly: the loss falls
from ln(vocab) to well below it in a few dozen steps of a tiny model.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def synthetic_documents(num_docs: int, vocab_size: int, seed: int = 0,
                        min_len: int = 48, max_len: int = 400) -> list[np.ndarray]:
    """``num_docs`` token arrays (ids < vocab_size - 1), each ending with the EOD
    id ``vocab_size - 1``; deterministic in ``seed``."""
    rng = np.random.default_rng(seed)
    text_vocab = vocab_size - 1
    successors = rng.integers(0, text_vocab, size=(text_vocab, 4)).tolist()  # [V-1, 4]
    cumulative = np.cumsum([0.6, 0.2, 0.1, 0.1])
    docs = []
    for _ in range(num_docs):
        length = int(rng.integers(min_len, max_len))
        # Random draws up front (per-token numpy calls are slow).
        branch = np.searchsorted(cumulative, rng.random(length)).tolist()
        repeat = (rng.random(length) < 0.04).tolist()
        spans = rng.integers(6, 16, size=length).tolist()
        starts = rng.random(length).tolist()
        doc = [int(rng.integers(0, text_vocab))]
        i = 0
        while len(doc) < length:
            i += 1
            if len(doc) > 24 and repeat[i]:
                span = spans[i]
                start = int(starts[i] * (len(doc) - span))
                doc.extend(doc[start:start + span])  # a repeat: induction food
            else:
                doc.append(successors[doc[-1]][min(branch[i], 3)])
        docs.append(np.array(doc[:length] + [text_vocab], dtype=np.int32))
    return docs


def write_shard(prefix: str | Path, docs: list[np.ndarray]) -> str:
    """Writes ``prefix.bin``/``prefix.idx`` with megatron's IndexedDatasetBuilder
    (one sequence per document); returns the prefix."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs:
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def write_synthetic_corpus(prefix: str | Path, num_docs: int = 400, vocab_size: int = 256,
                           seed: int = 0) -> str:
    """A structured synthetic corpus as one shard; its EOD id is ``vocab_size - 1``."""
    return write_shard(prefix, synthetic_documents(num_docs, vocab_size, seed))
