"""Does a checkpoint fit the model built to load it? The same tensors, of the same shapes.

``checkpoint.allow_config_changes`` may let a model key change on a resume (a
dropout, the RoPE base, the initialisation), but a checkpoint's tensors load only
into tensors of their own names and shapes. megatron checks the names when asked
(``StrictHandling.RETURN_ALL``, then :func:`check_same_parameters`); a shape that
differs fails inside its load planning with a ``CheckpointException`` that names no
tensor, which a resume cannot tell from a damaged checkpoint: every checkpoint of
the run was skipped as unusable. :func:`check_same_shapes` compares the shapes
first, from the checkpoint's metadata, and says which change did it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

from kvtrain.config import ConfigError, on_every_rank


def _listed(keys: list[str]) -> str:
    return ", ".join(keys[:6]) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")


def check_same_optimizer(path: Path, saved: dict, current: dict) -> None:
    """The optimizer state is in the form this run's optimizer loads: megatron's
    distributed optimizer and its plain one save theirs in other forms, and neither
    loads the other's (a KeyError or ValueError deep in megatron, which a resume could
    not tell from a damaged checkpoint: every checkpoint of the run was called
    unusable). ``saved``/``current``: the checkpoint's and the run's config records;
    called only where the optimizer state is loaded."""
    def distributed(config: dict) -> bool:  # the schema's default where a record lacks it
        return bool((config.get("parallel") or {}).get("distributed_optimizer", True))

    if saved and distributed(saved) != distributed(current):
        was, now = (str(distributed(c)).lower() for c in (saved, current))
        raise ConfigError(
            f"checkpoint {path} was saved with parallel.distributed_optimizer: {was}, this "
            f"run has {now}: the two optimizers keep their state in forms neither loads from "
            f"the other; resume with parallel.distributed_optimizer: {was}, or take its "
            "weights only with checkpoint.load_optimizer: false (a fresh optimizer and LR "
            "schedule)")


def check_same_parameters(path: Path, in_checkpoint_only: set, in_model_only: set) -> None:
    """Strict loading: the model's tensors and the checkpoint's are the same set.

    megatron's default ignores checkpoint tensors that the model does not ask
    for: a KV-shift checkpoint would load into a vanilla model, its coefficients
    silently dropped. Optimizer state and RNG states are not compared here (a
    weights-only load or a new layout leaves them in the checkpoint on purpose).
    """
    def model_keys(keys) -> list[str]:
        return sorted(k for k in keys if not k.startswith(("optimizer.", "rng_state")))

    extra, missing = model_keys(in_checkpoint_only), model_keys(in_model_only)
    if extra or missing:
        parts = ([f"{_listed(extra)} not in this model"] if extra else []) + \
                ([f"{_listed(missing)} not in the checkpoint"] if missing else [])
        raise ConfigError(f"checkpoint {path} does not fit the model: {'; '.join(parts)}")


def model_shapes(sharded: dict) -> dict[str, tuple]:
    """The global shape of every tensor of the model entries (``model``, ``model0``,
    ...) of a sharded state dict, by checkpoint key (factories, such as SwiGLU's
    fused fc1, built into the tensors they save)."""
    shapes: dict[str, tuple] = {}
    for name, entry in sharded.items():
        if not name.startswith("model"):
            continue
        for value in nested_values(entry):
            # a factory builds a tensor, or a dict or list of them
            built = nested_values([value.build()]) if isinstance(value, ShardedTensorFactory) \
                else [value]
            for tensor in built:
                if isinstance(tensor, ShardedTensor):
                    shapes[tensor.key] = tuple(tensor.global_shape)
    return shapes


def shape_differences(path: Path, sharded: dict) -> list[tuple[str, tuple, tuple]]:
    """(key, shape in the checkpoint, shape here) of this rank's model tensors whose
    shapes differ, by key; tensors of one side only are left to the strict load."""
    saved = dist_checkpointing.load_tensors_metadata(str(path))
    here = model_shapes(sharded)
    return [(key, tuple(saved[key].global_shape), shape) for key, shape in sorted(here.items())
            if key in saved and tuple(saved[key].global_shape) != shape]


VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")


def _vocab_hint(found: list, model: dict, tensor: int) -> str:
    """Where only the vocabulary's rows differ: the padding rule, and the
    ``model.make_vocab_size_divisible_by`` that keeps the checkpoint's rows at this
    TP (the padding is TP's: megatron gives every TP rank an equal slice)."""
    if any(key not in VOCAB_TENSORS or saved[1:] != here[1:] for key, saved, here in found):
        return ""
    rows, vocab, multiple = found[0][1][0], model["vocab_size"], model["make_vocab_size_divisible_by"]
    keeps = [m for m in range(rows // tensor, 0, -1)
             if -(-vocab // (m * tensor)) * m * tensor == rows]
    keeps.sort(key=lambda m: m & (m - 1) != 0)  # the largest power of two first: aligned rows
    fix = (f"model.make_vocab_size_divisible_by: {keeps[0]} keeps the checkpoint's {rows} rows "
           f"at parallel.tensor {tensor}" if keeps else
           f"no model.make_vocab_size_divisible_by gives {rows} rows at parallel.tensor "
           f"{tensor}: resume at the checkpoint's parallel.tensor")
    return (f"; the vocabulary ({vocab}) is padded to a multiple of "
            f"model.make_vocab_size_divisible_by x parallel.tensor ({multiple} x {tensor}): {fix}")


def check_same_shapes(path: Path, sharded: dict, changes: Iterable, model: dict,
                      tensor: int) -> None:
    """ConfigError (one line, the same on every rank: a collective) when a model
    tensor of ``sharded`` has another shape in the checkpoint ``path``; it names
    the allowed model changes of ``changes`` (``compat.Change``) that made it, or
    for the vocabulary's padding, the setting that keeps it (``model``: the run's
    model section; ``tensor``: its TP)."""
    found = shape_differences(path, sharded)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, found)  # stages hold other tensors
    found = sorted({d for rank in gathered for d in rank})
    if not found:
        return
    key, saved, here = found[0]
    more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
    allowed = [str(c) for c in changes if c.key.startswith("model.")]
    why = (f"the allowed changes ({'; '.join(allowed)}) change the shapes of its tensors: "
           if allowed else "")
    hint = _vocab_hint(found, model, tensor) or "; a checkpoint loads only into a model of its " \
        "own shapes"
    raise on_every_rank(ConfigError(
        f"checkpoint {path} does not fit the model: {why}{key} is {saved} in the checkpoint "
        f"and {here} in this model{more}{hint}"))


__all__ = ["check_same_parameters", "check_same_shapes", "model_shapes", "shape_differences"]
