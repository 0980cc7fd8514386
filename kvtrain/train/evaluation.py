"""Validation loss/perplexity and the KV-shift coefficient statistics.

Validation always reads the *first* ``eval_iters`` global batches of the
validation split, so every evaluation of a run (and of a resumed run) scores
the same sequences and the curve shows the model, not the sample. So does each
named set of ``data.valid_sets``, a Validator of its own whose records carry
``set: NAME``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron.core import parallel_state

from kvtrain.config import ConfigError, on_every_rank
from kvtrain.data import fixed_batches
from kvtrain.tasks.accuracy import AccuracyForwardStep, reduce_accuracies
from kvtrain.model.context_parallel import context_parallel_share
from kvtrain.model.kv_shift import collect_shift_coefficients

from .step import ForwardStep, check_token_ids, global_mean_loss, schedule_shape


class Validator:
    """Runs forward-only passes over the fixed validation batches (of the run's
    validation, or of the named set ``name``)."""

    def __init__(self, dataset, forward_backward: Callable, model: list, eval_iters: int,
                 global_batch_size: int, micro_batch_size: int, num_microbatches: int,
                 seq_length: int, accuracy_masks: tuple = (), vocab_size: int = 0,
                 documents: Optional[Callable] = None, source: str = "data.paths",
                 name: Optional[str] = None):
        self.dataset, self.name = dataset, name
        self.forward_backward = forward_backward
        self.model = model
        self.gbs, self.mbs, self.m = global_batch_size, micro_batch_size, num_microbatches
        self.seq_length = seq_length
        self.iters = min(eval_iters, len(dataset) // global_batch_size) if dataset is not None else 0
        self.accuracy_masks = tuple(accuracy_masks)
        if self.accuracy_masks:  # induction / 3-gram data: accuracy from the logits
            self.forward_step = AccuracyForwardStep(self.accuracy_masks, vocab_size,
                                                    share=context_parallel_share)
        else:
            self.forward_step = ForwardStep(documents=documents, vocab_size=vocab_size or None,
                                            source=source)
        self.documents = documents

    def run(self, iteration: int) -> Optional[dict]:
        """``{"val_loss", "val_ppl", ...}`` (the same on every rank), or None."""
        if self.iters == 0:
            return None
        losses = self.forward()  # collective
        loss, tokens = global_mean_loss(losses, self.forward_step)
        record = {"kind": "valid", **({"set": self.name} if self.name else {}),
                  "iteration": iteration, "val_loss": loss,
                  "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": tokens}
        if self.accuracy_masks:
            record.update(reduce_accuracies(losses, self.accuracy_masks))  # collective
        return record

    def check_token_ids(self) -> None:
        """The token ids of this rank's share of every validation batch, below the
        vocabulary, read before training: a shard of another tokenizer is one line at
        the start, not at the first evaluation, after train.eval_interval steps that
        no checkpoint may have kept yet (collective: every rank raises the first
        rank's finding). (The toy tasks make their own ids.)"""
        vocab = getattr(self.forward_step, "vocab_size", None)
        if self.iters == 0 or self.accuracy_masks or not vocab:
            return
        batches = fixed_batches(self.dataset, self.iters * self.gbs, self.mbs,
                                parallel_state.get_data_parallel_rank(),
                                parallel_state.get_data_parallel_world_size())
        found = None
        try:
            for batch in batches:
                check_token_ids(batch["tokens"], vocab, self.forward_step.source)
        except ConfigError as e:
            found = str(e)
        # each rank reads its own share: the first rank's finding is every rank's
        # line, said once a node (not one a rank, each naming other ids)
        findings = [found]
        if dist.is_initialized() and dist.get_world_size() > 1:
            findings = [None] * dist.get_world_size()
            dist.all_gather_object(findings, found)
        if first := next((f for f in findings if f), None):
            raise on_every_rank(ConfigError(first))

    def forward(self) -> list:
        """The forward-only passes over the batches: what ``forward_step``'s loss
        function reported for each micro batch (last pipeline stage; collective)."""
        dp_rank = parallel_state.get_data_parallel_rank()
        dp = parallel_state.get_data_parallel_world_size()
        iterators = [fixed_batches(self.dataset, self.iters * self.gbs, self.mbs, dp_rank, dp)
                     for _ in self.model]  # one per virtual stage, the same batches
        for chunk in self.model:
            chunk.eval()
        losses = []
        seq_length, micro_batch_size = schedule_shape(self.documents, self.seq_length, self.mbs)
        with torch.no_grad():
            for _ in range(self.iters):
                losses += self.forward_backward(
                    forward_step_func=self.forward_step,
                    data_iterator=iterators if len(iterators) > 1 else iterators[0],
                    model=self.model if len(self.model) > 1 else self.model[0],
                    num_microbatches=self.m,
                    seq_length=seq_length,
                    micro_batch_size=micro_batch_size,
                    decoder_seq_length=seq_length,
                    forward_only=True,
                )
        for chunk in self.model:
            chunk.train()
        return losses


# ----------------------------------------------------------------------------- KV-shift statistics
def gather_shift_coefficients(modules: list) -> Optional[dict[int, dict[str, torch.Tensor]]]:
    """All KV heads of all layers: ``{layer: {tensor: [kv_heads, w+1]}}`` on global
    rank 0 (None elsewhere). Collective over the world.

    Each rank knows only its pipeline stage's layers and its TP slice of their
    heads; the DP rank-0 replica of every (PP, TP) position sends its slice and
    rank 0 concatenates the slices of a layer in TP-rank order.
    """
    mine = []
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        mine = [(s.layer, {t: c.tolist() for t, c in s.coefficients.items()})
                for s in collect_shift_coefficients(modules)]
    payload = (parallel_state.get_tensor_model_parallel_rank(), mine)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    if dist.get_rank() != 0:
        return None
    parts: dict[int, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for tp_rank, layers in sorted(gathered, key=lambda x: x[0]):
        for layer, coefs in layers:
            for tensor, values in coefs.items():
                parts[layer][tensor].append((tp_rank, values))
    out = {}
    for layer in sorted(parts):
        out[layer] = {t: torch.tensor([row for _, rows in sorted(chunks) for row in rows])
                      for t, chunks in parts[layer].items()}
    return out


# paper notation: alpha are K's coefficients, beta V's; gamma for the Q ablation
GREEK = {"k": "alpha", "v": "beta", "q": "gamma"}


def shift_statistics(coefs: dict[int, dict[str, torch.Tensor]], iteration: int) -> dict:
    """Per-layer coefficient means and the paper's Table 5 quadrant counts.

    ``kv_shift/layer_03/alpha1`` is the mean over layer 3's KV heads of α1 (the
    current token's key weight), ``alpha2`` the previous token's, and so on.
    Quadrants (KV shift of both K and V): over every KV head of every layer,
    how many have α1 > α2 and β1 > β2, etc. (Table 5: 50/17/9/52 of 128 heads
    for the paper's 2.9B model). ``kv_shift/coefficients`` holds every head's
    coefficients, ``{"03": {"alpha": [[α1, α2], ...], "beta": ...}}``.
    """
    record: dict = {"kind": "kv_shift", "iteration": iteration}
    alpha_gt, beta_gt = [], []
    heads: dict[str, dict[str, list]] = {}  # every head's coefficients (kvtrain compare's plots)
    for layer, tensors in coefs.items():
        for tensor, c in tensors.items():  # c: [kv_heads, w+1]
            heads.setdefault(f"{layer:02d}", {})[GREEK[tensor]] = c.tolist()
            for i in range(c.shape[1]):
                record[f"kv_shift/layer_{layer:02d}/{GREEK[tensor]}{i + 1}"] = float(c[:, i].mean())
        if "k" in tensors and "v" in tensors and tensors["k"].shape[1] > 1:
            alpha_gt.append(tensors["k"][:, 0] > tensors["k"][:, 1])
            beta_gt.append(tensors["v"][:, 0] > tensors["v"][:, 1])
    if alpha_gt:
        a, b = torch.cat(alpha_gt), torch.cat(beta_gt)  # [layers * kv_heads]
        record["kv_shift/quadrant/a1>a2,b1>b2"] = int((a & b).sum())
        record["kv_shift/quadrant/a1<=a2,b1>b2"] = int((~a & b).sum())
        record["kv_shift/quadrant/a1>a2,b1<=b2"] = int((a & ~b).sum())
        record["kv_shift/quadrant/a1<=a2,b1<=b2"] = int((~a & ~b).sum())
        record["kv_shift/kv_heads"] = int(a.numel())
    # {layer: {alpha|beta|gamma: [kv_heads][w+1]}}: a dict, so not sent to wandb as a metric
    record["kv_shift/coefficients"] = heads
    return record
