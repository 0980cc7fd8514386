"""How many sequences one pass over a blend's documents gives, as megatron draws them:
a sequence takes ``seq_length`` + 1 tokens (its last the next one's first), and a
blend gives each dataset its weight's share, rounded up. Past that count megatron
draws the documents again (another epoch): a validation scores the same tokens twice."""

from __future__ import annotations

import math
from typing import Optional


def one_pass(per_pass: list[int], weights: Optional[list[float]]) -> int:
    """The sequences a blend gives before one of its datasets (``per_pass``: the
    sequences one pass over each holds) is drawn again; ``weights`` None: one dataset."""
    if weights is None:
        return per_pass[0]
    total = sum(weights)
    held = min(int(n * total / w) for n, w in zip(per_pass, weights))
    while held and any(math.ceil(held * w / total) > n for n, w in zip(per_pass, weights)):
        held -= 1  # each part's share, rounded up as megatron's blend draws it
    return held


def part_pass(prefixes: list[str], weights: Optional[list[float]], split: str, part: int,
              seq_length: int) -> int:
    """``one_pass`` over part ``part`` (0 train, 1 validation, 2 test) of ``data.split``
    ``split`` of the shards ``prefixes``: each shard's sequences in the part (megatron's
    bookends over its sequences), their tokens read from its index."""
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix, parse_and_normalize_split,
    )

    from data_tools.indexed import IndexedReader

    low, high = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))[part]
    per_pass = []
    for prefix in prefixes:
        lengths = IndexedReader(prefix).sequence_lengths
        tokens = lengths[int(round(low * len(lengths))):int(round(high * len(lengths)))]
        per_pass.append(max(int(tokens.sum(dtype="int64")) - 1, 0) // seq_length)
    return one_pass(per_pass, weights)


__all__ = ["one_pass", "part_pass"]
