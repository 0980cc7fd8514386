"""Accuracy inside ``kvtrain train``'s validation: vocab-parallel argmax and the
loss function that carries [correct, count] through megatron's schedule."""

from __future__ import annotations

import torch

from kvtrain.tasks.accuracy import accuracy_loss_func, vocab_parallel_argmax
from kvtrain.testing import run_distributed

VOCAB, PADDED = 10, 12


def example():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, PADDED, generator=gen)
    logits[0, 0, 11] = 50.0  # a padded row must never win
    labels = logits[..., :VOCAB].argmax(-1)
    labels[1, :2] = (labels[1, :2] + 1) % VOCAB  # two wrong predictions
    first = torch.zeros(2, 5, dtype=torch.bool)
    first[:, 1] = True
    every = torch.ones(2, 5, dtype=torch.bool)
    batch = {"labels": labels, "loss_mask": torch.ones(2, 5), "induction_first": first,
             "induction_all": every}
    return logits, batch


def reference(logits, batch):
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(),
                                           reduction="sum")
    return float(ce), logits[..., :VOCAB].argmax(-1)


def tp_worker(rank, world):
    from kvtrain.backend import init_model_parallel

    init_model_parallel(world, 1)
    logits, batch = example()
    part = PADDED // world
    local = logits[..., rank * part:(rank + 1) * part].contiguous()
    pred = vocab_parallel_argmax(local, VOCAB)
    loss_sum, tokens, logs = accuracy_loss_func(batch, ("induction_first", "induction_all"),
                                                VOCAB, local)
    return pred, float(loss_sum), int(tokens), {k: v.tolist() for k, v in logs.items()}


def check(pred, loss_sum, tokens, logs):
    logits, batch = example()
    ref_loss, ref_pred = reference(logits, batch)
    assert (pred == ref_pred).all()
    assert abs(loss_sum - ref_loss) < 1e-3 and tokens == 10
    assert logs["induction_first"] == [1.0, 2.0]  # row 1, position 1 is wrong
    assert logs["induction_all"] == [8.0, 10.0]


def test_single_rank(mp1):
    check(*tp_worker(0, 1))


def test_tensor_parallel_2():
    results = run_distributed(tp_worker, 2)
    for r in results:
        check(*r)
