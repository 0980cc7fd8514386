"""Loss by position in the context (``kvtrain perplexity --by-position``).

The paper's case for KV shifting is induction: a head that finds the token after
an earlier copy of the current one, which a model uses more the more context it
has. Loss against context length shows that use directly: an induction-capable
model keeps getting better deep into the context, and Olsson et al.'s in-context
learning score (the loss with 500 tokens of context minus the loss with 50) sums it
up in one number, which the two arms can be compared on (``kvtrain.analysis.positions``:
the score and the bins, without torch).

A token's context is what its prediction could attend to: the tokens of its
sequence up to it, or, where the run separated documents
(``data.reset_attention_mask``), of its document (counted from the token after the
last end-of-document token). Position ``p`` (0-based) is a prediction made with
``p + 1`` tokens of context.
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

def context_positions(tokens: torch.Tensor, eod: Optional[int]) -> torch.Tensor:
    """``[b, s]`` 0-based positions of each prediction in its context: in the
    sequence, or (``eod`` given: documents separated) in its document, whose first
    token is the one after an end-of-document token."""
    b, s = tokens.shape
    index = torch.arange(s, device=tokens.device).expand(b, s)  # [b, s]
    if eod is None:
        return index.clone()
    starts = torch.zeros_like(tokens, dtype=torch.bool)  # [b, s]: a document begins here
    starts[:, 1:] = tokens[:, :-1] == eod
    start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values  # [b, s]
    return index - start


class _Tap:
    """The micro-batch iterator, remembering the batch it gave last."""

    def __init__(self, inner: Iterator):
        self.inner, self.batch = inner, None

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        self.batch = next(self.inner)
        return self.batch


class PositionForwardStep:
    """Wraps the trainer's ``ForwardStep``: the same forward and loss, and beside the
    loss the sums of the masked token losses and their counts at each position,
    ``"by position": [2, s]``."""

    def __init__(self, inner: Callable, seq_length: int, eod: Optional[int]):
        self.inner, self.seq_length, self.eod = inner, seq_length, eod

    def __call__(self, data_iterator, model):
        tap = _Tap(data_iterator)
        output, loss = self.inner(tap, model)
        positions = context_positions(tap.batch["tokens"], self.eod)  # [b, s]
        return output, partial(self._loss, loss, tap.batch["loss_mask"], positions)

    @property
    def bad_ids(self):  # the inner step's token ids outside the vocabulary
        return self.inner.bad_ids

    def stop_on_bad_ids(self, some_rank_found: bool) -> None:
        self.inner.stop_on_bad_ids(some_rank_found)

    def _loss(self, inner: Callable, loss_mask: torch.Tensor, positions: torch.Tensor,
              output: torch.Tensor):
        loss_sum, tokens, logs = inner(output)
        device = output.device
        mask = loss_mask.float().reshape(-1).to(device)  # [b*s]
        losses = output.float().reshape(-1) * mask  # [b*s] (THD's [1, b*s] alike)
        where = positions.reshape(-1).to(device)
        sums = torch.zeros(self.seq_length, device=device).index_add_(0, where, losses.detach())
        counts = torch.zeros(self.seq_length, device=device).index_add_(0, where, mask)
        return loss_sum, tokens, {**logs, "by position": torch.stack([sums, counts])}


def reduce_by_position(losses: list, seq_length: int) -> tuple[list, list[int]]:
    """(mean loss at each position, None where no token was scored; tokens scored at
    each position), the same on every rank (collective)."""
    from kvtrain.train.step import reports_losses

    total = torch.zeros(2, seq_length, dtype=torch.float64)
    if reports_losses():
        for item in losses:
            total += item["by position"].to(torch.float64).cpu()
    if torch.cuda.is_available():
        total = total.cuda()
    dist.all_reduce(total)
    sums, counts = total.cpu().tolist()
    return [s / c if c else None for s, c in zip(sums, counts)], [int(c) for c in counts]


__all__ = ["PositionForwardStep", "context_positions", "reduce_by_position"]
