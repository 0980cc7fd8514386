"""Induction / 3-gram accuracy inside ``kvtrain train``'s validation.

For a run with ``data.type: induction | ngram``, the validator uses
:class:`AccuracyForwardStep` instead of the trainer's loss-only forward step:
the model is run without labels (logits ``[b, s, V/TP]`` on the last pipeline
stage), the LM loss is computed from the logits with megatron's
vocab-parallel cross entropy (the same number the trainer reports as val loss)
and the prediction is the argmax over the whole vocabulary (across TP ranks,
padded rows excluded). The per-micro-batch ``[correct, count]`` of each mask
ride along with the loss through megatron's schedule; :func:`reduce_accuracies`
sums them over micro batches and data-parallel replicas like the loss.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist

from .metrics import MASKS


def accuracy_masks(data_type: str) -> tuple[str, ...]:
    """The masks scored for ``data.type`` (none for text data)."""
    return MASKS.get(data_type, ())


def vocab_parallel_argmax(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Global argmax ids ``[...]`` of vocab-parallel logits ``[..., V/TP]``
    (rows >= ``vocab_size``, the padding, never win)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    part = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * part
    ids = torch.arange(start, start + part, device=logits.device)
    masked = logits.masked_fill(ids >= vocab_size, float("-inf"))
    value, index = masked.max(dim=-1)
    index = index + start
    if tp == 1:
        return index
    group = parallel_state.get_tensor_model_parallel_group()
    values = [torch.empty_like(value) for _ in range(tp)]
    indices = [torch.empty_like(index) for _ in range(tp)]
    dist.all_gather(values, value.contiguous(), group=group)
    dist.all_gather(indices, index.contiguous(), group=group)
    best = torch.stack(values).argmax(dim=0, keepdim=True)  # first rank wins ties
    return torch.stack(indices).gather(0, best).squeeze(0)


def accuracy_loss_func(batch: dict, masks: tuple[str, ...], vocab_size: int,
                       output_tensor: torch.Tensor):
    """megatron loss function on logits: ``(loss_sum, tokens, logs)`` like the
    trainer's, with ``logs[mask] = [correct, count]`` for each mask."""
    from megatron.core import tensor_parallel

    logits = output_tensor.float()  # [b, s, V/TP]
    labels = batch["labels"]
    pred = vocab_parallel_argmax(logits, vocab_size)  # before the in-place CE below
    losses = tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), labels)  # [b, s]
    mask = batch["loss_mask"].float()
    loss_sum = (losses * mask).sum()
    logs = {"lm loss": torch.stack([loss_sum.detach(), mask.sum()])}
    hit = pred.eq(labels)
    for name in masks:
        m = batch[name].bool()
        logs[name] = torch.stack([(hit & m).sum(), m.sum()]).to(torch.float32)
    return loss_sum, mask.sum().to(torch.int), logs


class AccuracyForwardStep:
    """megatron ``forward_step_func`` for validation on induction / 3-gram data."""

    def __init__(self, masks: tuple[str, ...], vocab_size: int):
        self.masks = tuple(masks)
        self.vocab_size = vocab_size
        self.iteration = 0

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        keys = ("tokens", "position_ids", "labels", "loss_mask") + self.masks
        batch = {k: batch[k] for k in keys}
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        output = model(batch["tokens"], batch["position_ids"], None)  # logits on the last stage
        return output, partial(accuracy_loss_func, batch, self.masks, self.vocab_size)


def reduce_accuracies(losses: list, masks: tuple[str, ...]) -> dict:
    """``{"val_acc_<mask>": accuracy}`` over all micro batches and DP replicas
    (collective over the world, like the trainer's loss reduction)."""
    from megatron.core import parallel_state

    local = torch.zeros(2 * len(masks), dtype=torch.float64)
    if (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0):
        for item in losses:
            for i, name in enumerate(masks):
                local[2 * i:2 * i + 2] += item[name].to(torch.float64).cpu()
    if torch.cuda.is_available():
        local = local.cuda()
    dist.all_reduce(local)
    local = local.cpu().tolist()
    out = {}
    for i, name in enumerate(masks):
        correct, count = local[2 * i], local[2 * i + 1]
        out[f"val_acc_{name}"] = correct / count if count else float("nan")
    return out
