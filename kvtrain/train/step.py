"""One training step: megatron's pipeline schedule over the micro batches, the
loss reduction every rank agrees on, and the guarded optimizer update.

Shapes: a micro batch is ``tokens/labels/loss_mask/position_ids [b, s]`` (b the
micro batch size, s the sequence length); the model's output on the last
pipeline stage is the per-token loss ``[b, s]`` (``[1, b*s]`` when documents
are THD-packed for Transformer Engine). When documents are separated, their
ids are computed here once per micro batch (``kvtrain.model.documents``) and
reach the layers as ``packed_seq_params``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from kvtrain.config import ConfigError, on_every_rank
from kvtrain.model.context_parallel import context_parallel_share

from .hooks import RunHooks
from .optimizer import StepOutcome, guarded_step


def loss_func(loss_mask: torch.Tensor, alter: Optional[Callable], output_tensor: torch.Tensor):
    """Sum of masked token losses, its token count, and both for logging.

    Returning ``(sum, tokens, logs)`` with ``calculate_per_token_loss`` makes
    megatron divide the gradients by the token count of the whole global batch
    (all micro batches and DP ranks), so the loss is a true per-token mean
    whatever the layout or the padding.
    """
    losses = output_tensor.float().reshape(-1)  # [b*s]
    mask = loss_mask.float().reshape(-1)  # [b*s]
    loss_sum = torch.sum(losses * mask)
    if alter is not None:
        loss_sum = alter(loss_sum)
    tokens = mask.sum().to(torch.int)
    report = torch.stack([loss_sum.detach(), mask.sum().detach()])  # [2]
    return loss_sum, tokens, {"lm loss": report}


BATCH_KEYS = ("tokens", "position_ids", "labels", "loss_mask")


class ForwardStep:
    """megatron's ``forward_step_func``: pulls a micro batch and runs the model.

    ``documents`` (``Run.documents``; None when documents are not separated)
    turns the micro batch's tokens into the document ids the layers read; under
    context parallelism the rank then keeps its two chunks of the sequence.
    """

    def __init__(self, hooks: Optional[RunHooks] = None,
                 documents: Optional[Callable[[dict], tuple]] = None,
                 vocab_size: Optional[int] = None, source: str = "data.paths"):
        self.iteration = 0  # the training step being run (1-based); 0 in evaluation
        self.hooks = hooks
        self.documents = documents
        self.vocab_size = vocab_size  # model.vocab_size: the token ids checked below it
        self.source = source  # the key naming the shards read (a bad id's line)
        self.bad_ids: Optional[tuple[int, int]] = None  # (lowest, highest) outside it, this step

    def __call__(self, data_iterator, model):
        batch = {k: v for k, v in next(data_iterator).items() if k in BATCH_KEYS}
        if self.vocab_size is not None:
            batch = self._in_vocabulary(batch)
        if torch.cuda.is_available():
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
        packed = None
        if self.documents is not None:
            batch, packed = self.documents(batch)
        batch, packed = context_parallel_share(batch, packed)
        output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=packed)  # [b, s] loss (last stage)
        alter = partial(self.hooks.loss, self.iteration) if self.hooks is not None else None
        return output, partial(loss_func, batch["loss_mask"], alter)

    def _in_vocabulary(self, batch: dict) -> dict:
        """The micro batch with its ids clamped into the vocabulary, and those
        outside noted in ``bad_ids``: the step's collectives still run, and its
        all-reduce tells every rank (``stop_on_bad_ids``), before any update."""
        bad = ids_outside(batch["tokens"], batch["labels"], vocab_size=self.vocab_size)
        if bad is None:
            return batch
        if self.bad_ids is not None:
            bad = (min(bad[0], self.bad_ids[0]), max(bad[1], self.bad_ids[1]))
        self.bad_ids = bad
        top = self.vocab_size - 1
        return {**batch, "tokens": batch["tokens"].clamp(0, top),
                "labels": batch["labels"].clamp(0, top)}

    def stop_on_bad_ids(self, some_rank_found: bool, iteration: Optional[int] = None) -> None:
        """Every rank raises the same line when one found ids outside the vocabulary
        (collective: call it on every rank when ``some_rank_found``, a value they
        share)."""
        mine, self.bad_ids = self.bad_ids, None
        if not some_rank_found:
            return
        low, high = mine if mine is not None else (0, 0)
        extremes = torch.tensor([-low, high], dtype=torch.float64)  # [2]: a max gives both
        if torch.cuda.is_available():
            extremes = extremes.cuda()
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        low, high = -int(extremes[0].item()), int(extremes[1].item())
        raise on_every_rank(ConfigError(token_id_refusal(
            high if high >= self.vocab_size else low, self.vocab_size, self.source,
            f" of step {iteration}" if iteration else "")))


def ids_outside(*ids: torch.Tensor, vocab_size: int) -> Optional[tuple[int, int]]:
    """(lowest, highest) id of ``ids`` (on the host: one pass over each) where one is
    outside ``[0, vocab_size)``; None where all are in it."""
    found = [torch.aminmax(t) for t in ids if t.numel()]
    if not found:
        return None
    low, high = min(int(lo) for lo, _ in found), max(int(hi) for _, hi in found)
    return (low, high) if low < 0 or high >= vocab_size else None


def token_id_refusal(token: int, vocab_size: int, source: str, where: str = "") -> str:
    """The line of a batch holding ``token`` outside ``model.vocab_size``: shards of a
    larger vocabulary whose ``.meta.json`` does not say so (megatron's own) were an
    IndexError traceback in the embedding at the first step on a CPU, a
    device-side assert on a GPU (or, below the padded vocabulary, ids of no token
    and labels that the cross-entropy masks, silently)."""
    return (f"{source}: a batch{where} holds token id {token}, outside model.vocab_size "
            f"({vocab_size}): the shards were made with another tokenizer (set "
            "model.vocab_size to its size, or data.tokenizer to it, which is checked before "
            "training)")


def check_token_ids(tokens: torch.Tensor, vocab_size: int, source: str = "data.paths") -> None:
    """Token ids of a batch [b, s] below ``model.vocab_size`` (``token_id_refusal``)."""
    bad = ids_outside(tokens, vocab_size=vocab_size)
    if bad is not None:
        raise ConfigError(token_id_refusal(bad[1] if bad[1] >= vocab_size else bad[0],
                                           vocab_size, source))


def schedule_shape(documents: Optional[Callable], seq_length: int,
                   micro_batch_size: int) -> tuple[int, int]:
    """(sequence, batch) of the activations megatron's schedule sizes its pipeline
    messages by: THD packing (``te``) makes a micro batch one row of ``b*s`` tokens."""
    if getattr(documents, "thd", False):
        return seq_length * micro_batch_size, 1
    return seq_length, micro_batch_size


def sync_params(model: list) -> None:
    """Brings every DP rank's copy of the weights up to date (collective).

    With the distributed optimizer and ``overlap_param_gather``, an update only
    refreshes the shard a rank owns; the all-gather of the other shards is left
    to the next forward pass (its pre-hooks). Whatever reads the weights before
    that forward - a checkpoint save, validation, the α/β statistics - must call
    this first, as Megatron-LM forces the param sync before every save. The next
    step re-gathers the same values (``zero_grad_buffer`` resets the buckets).
    """
    for chunk in model:
        if getattr(chunk, "use_forward_hook", False):  # DDP with overlapped param gather
            chunk.start_param_sync(force_sync=True)


def reports_losses() -> bool:
    """Whether this rank's micro-batch losses count in a sum over the world: the last
    pipeline stage's, once per tensor-parallel group (its TP rank 0)."""
    return (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
            and parallel_state.get_tensor_model_parallel_rank() == 0)


def reduce_losses(losses: list) -> torch.Tensor:
    """``[loss_sum, tokens]`` over the global batch, the same on every rank.

    Only last-stage ranks hold losses and the TP ranks of one replica hold the
    same value, so each (last stage, TP rank 0) rank contributes its data-
    parallel share and one all-reduce over the world gives everyone the total.
    """
    local = torch.zeros(2, dtype=torch.float64)
    if reports_losses():
        for item in losses:
            local += item["lm loss"].to(torch.float64).cpu()
    return local


@dataclass
class StepResult:
    loss: float  # mean lm loss per token over the global batch
    tokens: int  # loss tokens in the global batch
    outcome: StepOutcome
    stop_signal: bool  # some rank got SIGTERM/SIGUSR1
    time_up: bool  # some rank passed exit_duration_minutes


def train_step(forward_backward: Callable, forward_step: ForwardStep, data_iterators: list,
               model: list, optimizer, scheduler, num_microbatches: int, seq_length: int,
               micro_batch_size: int, stop_flags: tuple[float, float]) -> StepResult:
    """Forward/backward over ``num_microbatches`` micro batches, then the update."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    seq_length, micro_batch_size = schedule_shape(forward_step.documents, seq_length,
                                                  micro_batch_size)
    losses = forward_backward(
        forward_step_func=forward_step,
        data_iterator=data_iterators if len(data_iterators) > 1 else data_iterators[0],
        model=model if len(model) > 1 else model[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=seq_length,
        forward_only=False,
    )
    # One all-reduce per step carries the loss, the stop requests and the token ids
    # outside the vocabulary of every rank: all ranks see the same loss (finite or
    # not) and the same flags.
    flags = (*stop_flags, float(forward_step.bad_ids is not None))
    packed = torch.cat([reduce_losses(losses), torch.tensor(flags, dtype=torch.float64)])
    if torch.cuda.is_available():
        packed = packed.cuda()
    dist.all_reduce(packed)
    loss_sum, tokens, signal_flag, time_flag, bad_ids = packed.cpu().tolist()
    forward_step.stop_on_bad_ids(bad_ids > 0, forward_step.iteration)  # before the update
    loss = loss_sum / max(tokens, 1.0)
    if forward_step.hooks is not None:
        forward_step.hooks.gradients(forward_step.iteration, model)
    outcome = guarded_step(optimizer, scheduler, loss_is_finite=math.isfinite(loss))
    return StepResult(loss=loss, tokens=int(tokens), outcome=outcome,
                      stop_signal=signal_flag > 0, time_up=time_flag > 0)


def global_mean_loss(losses: list, forward_step=None) -> tuple[float, int]:
    """Mean per-token loss of a forward-only pass, reduced like ``train_step``; the
    token ids outside the vocabulary that ``forward_step`` (the same kind on every
    rank) found stop every rank alike."""
    found = getattr(forward_step, "bad_ids", None) is not None
    packed = torch.cat([reduce_losses(losses), torch.tensor([float(found)], dtype=torch.float64)])
    if torch.cuda.is_available():
        packed = packed.cuda()
    dist.all_reduce(packed)
    loss_sum, tokens, bad_ids = packed.cpu().tolist()
    if hasattr(forward_step, "stop_on_bad_ids"):
        forward_step.stop_on_bad_ids(bad_ids > 0)
    return loss_sum / max(tokens, 1.0), int(tokens)
