"""Masked next-token accuracy: the induction accuracy of Figure 1a/1b (first
and all prediction positions) and the 3-gram accuracy of Appendix E.3.

Conventions (as in the datasets of ``kvtrain.data.induction``): ``mask[b, p]``
marks an *input* position ``p`` whose label ``labels[b, p]`` (the next token)
is scored; the prediction at ``p`` is ``argmax(logits[b, p])``.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def predictions(logits_or_preds: Tensor, vocab_size: Optional[int] = None) -> Tensor:
    """``[b, s]`` predicted ids from logits ``[b, s, V]`` (argmax over the first
    ``vocab_size`` entries, so padded vocabulary rows never win) or from ids ``[b, s]``."""
    if logits_or_preds.dim() == 3:
        logits = logits_or_preds if vocab_size is None else logits_or_preds[..., :vocab_size]
        return logits.argmax(dim=-1)
    if logits_or_preds.dim() != 2:
        raise ValueError(f"expected logits [b, s, V] or predictions [b, s], "
                         f"got shape {tuple(logits_or_preds.shape)}")
    return logits_or_preds


def masked_correct(logits_or_preds: Tensor, labels: Tensor, mask: Tensor,
                   vocab_size: Optional[int] = None) -> tuple[int, int]:
    """(correct, counted) next-token predictions at the ``mask`` positions; sum
    these over batches (and ranks) and divide for an exact accuracy."""
    pred = predictions(logits_or_preds, vocab_size)
    if pred.shape != labels.shape or mask.shape != labels.shape:
        raise ValueError(f"shapes differ: predictions {tuple(pred.shape)}, labels "
                         f"{tuple(labels.shape)}, mask {tuple(mask.shape)}")
    m = mask.bool()
    return int((pred.eq(labels) & m).sum()), int(m.sum())


def masked_accuracy(logits_or_preds: Tensor, labels: Tensor, mask: Tensor,
                    vocab_size: Optional[int] = None) -> float:
    """Next-token accuracy at the ``mask`` positions (NaN when the mask is empty).

    ``logits_or_preds``: logits ``[b, s, V]`` or predicted ids ``[b, s]``;
    ``labels``: ``[b, s]`` next tokens; ``mask``: ``[b, s]`` bool (e.g.
    ``induction_first``, ``induction_all``, ``ngram_first``, ``ngram_all``).
    """
    correct, total = masked_correct(logits_or_preds, labels, mask, vocab_size)
    return correct / total if total else float("nan")


MASKS = {
    "induction": ("induction_first", "induction_all"),
    "ngram": ("ngram_first", "ngram_all"),
}
"""Per task: the masks reported as ``accuracy`` (primary: the paper's first
prediction position / 3-grams not yet seen in the sequence) and ``accuracy_all``."""


def steps_to_threshold(steps: list[int], accuracies: list[float],
                       threshold: float = 0.95) -> Optional[int]:
    """The first evaluated step whose accuracy is >= ``threshold`` (None if never)."""
    for step, acc in zip(steps, accuracies):
        if acc == acc and acc >= threshold:
            return step
    return None
