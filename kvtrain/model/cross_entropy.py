"""What computes the language-model loss (``model.cross_entropy_kernel``), and the
fused vocab-parallel cross-entropy kvtrain brings.

megatron's ``GPTModel`` computes the loss of its vocab-parallel logits
``[s, b, V/t]`` in ``compute_language_model_loss``; without Transformer Engine
that is ``tensor_parallel.vocab_parallel_cross_entropy`` on torch ops (an fp32
copy of the logits, ~10 passes over it, its fp32 softmax kept for the backward).
kvtrain's :class:`GPTModel` can take :func:`vocab_parallel_cross_entropy`
instead: one Triton pass over the logits forward and one backward
(``kvtrain.model.triton_cross_entropy``), the logits themselves kept (2 bytes
each in bf16, not 4) and overwritten by their gradient.

Choices (``auto | triton | torch``), resolved once per start and recorded with
the backend:

* ``auto``: ``triton`` on a GPU where Triton imports, for the ``torch`` and ``te``
  backends (the logits are a plain tensor either way; TE's containers ship
  Triton), else ``torch``; ``local``, the reference, keeps megatron's loss;
* ``triton``: the fused kernels (a GPU), refused in one line elsewhere;
* ``torch``: megatron's ``vocab_parallel_cross_entropy``.

The loss is megatron's: per token ``log Σ_v exp(x_v) - x_target`` over the whole
(padded) vocabulary of the TP group, in fp32, with the same gradient. A target
outside the vocabulary (which kvtrain's data never makes) contributes no logit:
its loss here is ``log Σ exp(x)``, where megatron's gives ``log Σ exp(x - max)``
(its logits shifted in place); the gradients agree. Label smoothing is not
offered (megatron's GPT loss has none).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from megatron.core.models.gpt import GPTModel as MegatronGPTModel

from . import triton_cross_entropy
from .kernel_choice import auto_choice, explicit_choice


def choose_cross_entropy(requested: str, backend: str, cuda: bool) -> tuple[str, str]:
    """The loss kernel for ``model.cross_entropy_kernel: requested`` on ``backend``:
    (name, why). ConfigError when the requested one cannot run here."""
    chosen = explicit_choice("model.cross_entropy_kernel", requested, cuda,
                             triton_cross_entropy.available())
    if chosen is not None:
        return chosen
    return auto_choice(cuda, backend, triton_cross_entropy.available(), "megatron's loss")


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group=None) -> Tensor:
    """The loss ``[s, b]`` (fp32) of the vocab-parallel ``logits [s, b, V/t]`` (this
    rank's shard of TP ``group``; None: no TP) for ``labels [s, b]``: megatron's
    ``vocab_parallel_cross_entropy``, fused. Its backward overwrites ``logits`` with
    their gradient (as megatron's loss does with fp32 logits): nothing may read
    them after the forward."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"expected labels {tuple(logits.shape[:-1])} for logits "
                         f"{tuple(logits.shape)}, got {tuple(labels.shape)}")
    return FusedCrossEntropy.apply(logits, labels, group)


class FusedCrossEntropy(torch.autograd.Function):
    """Saves the logits (a copy only where their rows are not unit-strided), the
    labels, and per token the maximum logit and 1 / Σ exp; the backward writes the
    gradient over the logits and refuses to run twice."""

    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, group) -> Tensor:
        *lead, v = logits.shape
        flat = logits.reshape(-1, v)  # a view where it can be: the gradient goes over it
        if flat.stride(1) != 1:  # the kernels step through a row one column at a time
            flat = flat.contiguous()
        flat_labels = labels.reshape(-1).contiguous()
        tp = 1 if group is None else dist.get_world_size(group)
        start = (0 if group is None else dist.get_rank(group)) * v
        top, sums, target = triton_cross_entropy.shard_statistics(flat, flat_labels, start)
        if tp > 1:
            top, sums, target = _combine_shards(top, sums, target, group)
        ctx.save_for_backward(flat, flat_labels, top, sums.reciprocal())
        ctx.vocab_start, ctx.shape, ctx.used = start, logits.shape, False
        return ((top - target) + torch.log(sums)).view(lead)  # log Σ exp(x) - x_target

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dloss: Tensor):
        if ctx.used:
            raise RuntimeError("fused cross-entropy's backward ran twice: the first "
                               "overwrote its logits (retain_graph is not supported; "
                               "use model.cross_entropy_kernel: torch)")
        ctx.used = True
        flat, labels, top, inv = ctx.saved_tensors
        dloss = dloss.reshape(-1).float().contiguous()
        grad = triton_cross_entropy.gradient_in_place(flat, labels, top, inv, dloss,
                                                      ctx.vocab_start)
        # the logits changed under autograd's eyes: a node that saved them too (none
        # in megatron's GPT) must fail on its backward, not read the gradient
        torch.autograd.graph.increment_version(flat)
        return grad.view(ctx.shape), None, None


def _combine_shards(top: Tensor, sums: Tensor, target: Tensor,
                    group) -> tuple[Tensor, Tensor, Tensor]:
    """The whole vocabulary's maximum, ``Σ exp(x - max)`` and target logit from every
    shard's: one max, then one sum of the sums rescaled to the maximum and of the
    target logits (the shard that holds a target gives its logit, the others 0)."""
    whole = top.clone()
    dist.all_reduce(whole, op=dist.ReduceOp.MAX, group=group)
    both = torch.cat([sums * torch.exp(top - whole), target])
    dist.all_reduce(both, group=group)
    sums, target = both.split(top.numel())
    return whole, sums, target


class GPTModel(MegatronGPTModel):
    """megatron's ``GPTModel`` whose language-model loss is ``cross_entropy``:
    ``torch`` (megatron's) or ``triton`` (:func:`vocab_parallel_cross_entropy`)."""

    def __init__(self, *args, cross_entropy: str = "torch", **kwargs):
        super().__init__(*args, **kwargs)
        if cross_entropy not in ("torch", "triton"):
            raise ValueError(f"cross_entropy must be torch or triton, got {cross_entropy!r}")
        self.cross_entropy = cross_entropy

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """``[b, s]`` loss of ``logits [s, b, V/t]`` and ``labels [b, s]``."""
        if self.cross_entropy == "torch":
            return super().compute_language_model_loss(labels, logits)
        tp = self.pg_collection.tp
        group = tp if tp is not None and dist.get_world_size(tp) > 1 else None
        loss = vocab_parallel_cross_entropy(logits, labels.t().contiguous(), group)  # [s, b]
        return loss.t().contiguous()
