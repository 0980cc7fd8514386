"""Masked next-token accuracy of the toy tasks, on its own and inside the
trainer's validation.

Conventions (as in ``kvtrain.tasks.sequences``): ``mask[b, p]`` marks an
*input* position ``p`` whose label ``labels[b, p]`` (the next token) is
scored; the prediction at ``p`` is ``argmax(logits[b, p])``. The masks of each
task are ``kvtrain.tasks.config.MASKS`` (``induction_first`` /
``induction_all``, ``ngram_first`` / ``ngram_all``).

Inside ``kvtrain train`` (``data.type: induction | ngram | hop``) the validator
uses :class:`AccuracyForwardStep` instead of the trainer's loss-only forward
step: the model is run without labels (logits ``[b, s, V/TP]`` on the last
pipeline stage), the LM loss is computed from the logits with megatron's
vocab-parallel cross entropy (the same number the trainer reports as val loss)
and the prediction is the argmax over the whole vocabulary (across TP ranks,
padded rows excluded). The per-micro-batch ``[correct, count]`` of each mask
ride along with the loss through megatron's schedule; :func:`reduce_accuracies`
sums them over micro batches and data-parallel replicas like the loss.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist
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


# ----------------------------------------------------------------------------- in the trainer's validation
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

    def __init__(self, masks: tuple[str, ...], vocab_size: int,
                 share: Optional[Callable[[dict], tuple]] = None):
        self.masks = tuple(masks)
        self.vocab_size = vocab_size
        self.share = share  # batch -> (this rank's part, _): the trainer's CP split
        self.iteration = 0

    def __call__(self, data_iterator, model):
        batch = next(data_iterator)
        keys = ("tokens", "position_ids", "labels", "loss_mask") + self.masks
        batch = {k: batch[k] for k in keys}
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        if self.share is not None:  # masks and labels too: the counts add up over CP
            batch, _ = self.share(batch)
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
