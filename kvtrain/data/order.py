"""Has the training data's order changed since a checkpoint?

megatron's ``GPTDataset`` shuffles its documents and samples over as many epochs
as the run asks samples for, so the order of *every* sample depends on that
count: extending a run (a larger ``train.max_steps`` or ``train_tokens``) past an
epoch, or changing ``data.*``, reorders the samples a resumed run draws from
``consumed_samples`` on, and samples already trained on can come again. A
checkpoint keeps a fingerprint of a few samples it has drawn
(:func:`order_fingerprint`); on resume the same samples of the dataset as built
now are compared (:func:`order_changed`) and a change is said in one warning.
"""

from __future__ import annotations

import zlib
from typing import Optional

import numpy as np


def _spread(consumed: int) -> list[int]:
    """Up to four indices of samples already drawn: the first, the last, two between."""
    return sorted({0, consumed // 3, 2 * consumed // 3, consumed - 1})


def _crc(dataset, index: int) -> int:
    tokens = dataset[index]["tokens"]  # [seq]: a tensor or an array, per dataset type
    array = tokens.numpy() if hasattr(tokens, "numpy") else np.asarray(tokens)
    return zlib.crc32(np.ascontiguousarray(array).tobytes())


def order_fingerprint(dataset, consumed: int) -> Optional[list[list[int]]]:
    """``[[index, crc32 of its tokens], ...]`` for a few of the first ``consumed``
    samples of ``dataset`` (None: nothing drawn yet, or no dataset)."""
    if dataset is None or consumed <= 0:
        return None
    return [[i, _crc(dataset, i)] for i in _spread(min(consumed, len(dataset)))]


def order_changed(dataset, saved: Optional[list]) -> bool:
    """Whether ``dataset`` gives other samples at the indices ``saved`` fingerprinted
    (a checkpoint from before fingerprints, or without one: False, unknown)."""
    if dataset is None or not saved:
        return False
    return any(i >= len(dataset) or _crc(dataset, i) != crc for i, crc in saved)


__all__ = ["order_changed", "order_fingerprint"]
