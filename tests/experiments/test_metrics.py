"""Masked next-token accuracy (induction / 3-gram positions)."""

from __future__ import annotations

import math

import pytest
import torch

from kvtrain.experiments.results import steps_to_threshold
from kvtrain.tasks.accuracy import masked_accuracy, masked_correct, predictions


def one_hot_logits(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(ids, vocab).float()


def test_accuracy_at_masked_positions_only():
    labels = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4]])
    preds = torch.tensor([[5, 0, 7, 0], [0, 2, 0, 0]])
    first = torch.tensor([[True, False, False, False], [False, True, False, False]])
    every = torch.tensor([[True, True, True, False], [False, True, True, True]])
    assert masked_accuracy(preds, labels, first) == 1.0
    assert masked_correct(preds, labels, every) == (3, 6)
    assert masked_accuracy(preds, labels, every) == 0.5
    # logits give the same answer as their argmax
    assert masked_accuracy(one_hot_logits(preds, 10), labels, every) == 0.5


def test_padded_vocabulary_rows_never_win():
    labels = torch.tensor([[3, 3]])
    logits = one_hot_logits(labels, 8)
    logits[..., 7] = 5.0  # a padded row (vocab 6 padded to 8) with a large logit
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert masked_accuracy(logits, labels, mask) == 0.0
    assert masked_accuracy(logits, labels, mask, vocab_size=6) == 1.0


def test_empty_mask_and_bad_shapes():
    labels = torch.zeros(2, 3, dtype=torch.long)
    assert math.isnan(masked_accuracy(labels, labels, torch.zeros(2, 3, dtype=torch.bool)))
    with pytest.raises(ValueError):
        masked_accuracy(labels, labels[:, :2], torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError):
        predictions(torch.zeros(3))


def test_steps_to_threshold():
    steps = [0, 50, 100, 150]
    assert steps_to_threshold(steps, [0.0, 0.5, 0.96, 0.99]) == 100
    assert steps_to_threshold(steps, [0.0, 0.5, 0.9, float("nan")]) is None
    assert steps_to_threshold(steps, [0.0, 0.95, 0.9, 1.0]) == 50
