"""What megatron's dataset indices of a run take in memory, checked before it
builds them: a run that asks for more sequences than this machine can index
(a huge ``train.max_steps``, short documents under long sequences) is one line,
not hours of megatron counting epochs and then a failed allocation."""

from __future__ import annotations

import math
import os
from typing import Optional

from kvtrain.config import ConfigError
from kvtrain.config.schema import RunConfig


# megatron's indices of a part hold at least 12 bytes a sequence: the sample index's
# two int32 and the shuffle index's uint32 (int64 past 2**32 sequences); and its
# document index an int32 per document and epoch
INDEX_BYTES_PER_SAMPLE = 12
INDEX_BYTES_PER_DOCUMENT_EPOCH = 4


def document_index_bytes(cfg: RunConfig, share: float, samples: int, blend: Optional[tuple],
                          sizes: dict[str, tuple[int, int]]) -> int:
    """One part's document indices (``share``: the part's share of every shard's
    documents): each shard's documents in that part, times the epochs of them its
    share of ``samples`` takes. Short documents under long sequences make these larger
    than the sample indices (a corpus of 50-token documents at seq_length 2048: 14 x)."""
    if blend is None or samples == 0:
        return 0
    prefixes, weights = blend
    weights = weights or [1.0] * len(prefixes)
    total = 0
    for prefix, weight in zip(prefixes, weights):
        documents, tokens = sizes[prefix]
        drawn = samples * weight / sum(weights)
        epochs = math.ceil((drawn * cfg.train.seq_length + 1) / max(tokens * share, 1))
        total += INDEX_BYTES_PER_DOCUMENT_EPOCH * epochs * math.ceil(documents * share)
    return total


def check_index_memory(cfg: RunConfig, parts: list[tuple[Optional[tuple], float, int]],
                        sizes: dict[str, tuple[int, int]]) -> None:
    """Refuses sequences whose indices cannot fit this machine's memory: megatron
    would count their epochs one loop turn at a time (for hours with a large
    ``train.max_steps``), then fail to allocate them with a traceback. Every part
    drawn from counts (``parts``: each one's blend, its share of every shard's
    documents and the sequences drawn; the training part first)."""
    from kvtrain.config.layout import total_steps

    train_samples, valid_samples = parts[0][2], sum(n for _, _, n in parts[1:])
    sample_bytes = INDEX_BYTES_PER_SAMPLE * (train_samples + valid_samples)
    document_bytes = sum(document_index_bytes(cfg, share, samples, blend, sizes)
                         for blend, share, samples in parts)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if sample_bytes + document_bytes > memory:
        valid = f" and train.eval_iters for {valid_samples} validation ones" if valid_samples else ""
        raise ConfigError(
            f"{total_steps(cfg)[1]} asks for {train_samples} training sequences of "
            f"{cfg.train.seq_length} tokens{valid}: megatron's indices would need "
            f"{(sample_bytes + document_bytes) / 2**30:.0f} GiB of memory "
            f"({sample_bytes / 2**30:.0f} GiB of sample indices, {INDEX_BYTES_PER_SAMPLE} "
            f"bytes a sequence; {document_bytes / 2**30:.0f} GiB of document indices, "
            f"{INDEX_BYTES_PER_DOCUMENT_EPOCH} bytes a document per epoch), more than this "
            f"machine's {memory / 2**30:.0f} GiB")


def drawn_parts(d, blend: Optional[tuple], held_out: Optional[tuple], named: dict,
                 train_samples: int, valid_samples: int) -> list:
    """Each drawn part's blend, its share of every shard's documents and its sequences:
    data.split's parts of data.paths, or all of data.paths and all of data.valid_paths;
    then all of each named validation set."""
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    if held_out is not None:
        parts = [(blend, 1.0, train_samples), (held_out, 1.0, valid_samples)]
    else:  # of every shard's documents (and so, about, tokens), as megatron reads data.split
        share = parse_and_normalize_split(d.split)
        parts = [(blend, share[0], train_samples), (blend, share[1], valid_samples)]
    return parts + [(b, 1.0, valid_samples) for b, _ in named.values()]


__all__ = ["INDEX_BYTES_PER_DOCUMENT_EPOCH", "INDEX_BYTES_PER_SAMPLE", "check_index_memory",
           "document_index_bytes", "drawn_parts"]
