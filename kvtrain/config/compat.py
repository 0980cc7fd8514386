"""Does a checkpoint belong to this run? Its saved config against the new one.

A resume silently reinterprets a checkpoint when the run around it changed:
another ``train.seq_length`` changes what the data position and the token
counts mean, another data blend or tokenizer feeds other tokens (another
validation set, ``data.valid_paths``, scores other ones; so does a named one,
``data.valid_sets``, given other shards, but one added or dropped is recorded),
another end-of-document id, loss mask on it or document separation (``data.eod_id``,
``eod_mask_loss``, ``reset_attention_mask``) trains on other targets or
contexts, another model section is another model. Before a checkpoint is loaded, the config saved in
it is compared with the run's on the keys of ``COMPARED``; a difference stops
the run with one line, unless ``checkpoint.allow_config_changes`` names the
key (or a section above it). What changed is then printed and recorded. A run
sized by ``train.train_tokens`` also compares ``train.global_batch_size``: when
allowed to change, the run ends where the consumed tokens reach the budget
(``layout.total_steps`` from the checkpoint's consumed tokens, as a changed
``train.seq_length`` does). ``train.precision`` is compared as it ran (``auto``
resolves to bf16 on a GPU, fp32 on a CPU); an allowed change needs the
distributed optimizer, whose fp32 main parameters carry over.

Everything else may change on a resume: the parallel layout (checkpoints
reshard), the schedule, the optimizer's hyper-parameters (the run's values
replace those of the checkpoint's param groups; a change of one is printed and
recorded like an allowed change, ``RECORDED``, as are ``train.global_batch_size``
and ``train.eval_iters``), the intervals, logging, and
``model.backend`` and the kernel choices (``model.rope_kernel``,
``model.kv_shift.kernel``, ``model.cross_entropy_kernel``,
``model.swiglu_kernel``: the same weights on other kernels), and
``model.make_vocab_size_divisible_by``, the vocabulary's padding: the load checks
that the padded tensors keep their shapes (``kvtrain.train.model_fit``). A key
newer than the checkpoint compares as its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .loader import ConfigError

# Sections or keys compared on resume (a section compares every key below it).
COMPARED = ("model", "train.seq_length", "data.type", "data.paths", "data.split",
            "data.valid_paths", "data.valid_sets", "data.tokenizer", "data.seed",
            "data.induction", "data.ngram", "data.hop", "data.eval_seed", "data.eod_id",
            "data.eod_mask_loss",
            "data.reset_attention_mask")
# a named validation set added or dropped on a resume changes no curve the run has
# (recorded, not refused); one whose shards changed would score other sequences under
# its old name (compared)
VALID_SETS = "data.valid_sets."
# how the model runs, not what it is (the same weights on other kernels); the
# vocabulary's padding multiple too: the load compares the padded tensors' shapes
# (train/model_fit.py), and a multiple that keeps them is what a new TP may need
IGNORED = ("model.backend", "model.rope_kernel", "model.kv_shift.kernel",
           "model.cross_entropy_kernel", "model.swiglu_kernel",
           "model.make_vocab_size_divisible_by")
# free to change, but said and recorded: the run's values override the checkpoint's
# (the optimizer's), or the records after the change are of another kind: another
# global batch per step (a batch-size ramp), another validation set (train.eval_iters)
RECORDED = ("optimizer", "train.global_batch_size", "train.eval_iters")
# compared where the run is sized by train.train_tokens: the steps it has left are
# counted in the current global batch (layout.total_steps), the checkpoint's in its own
TOKEN_BUDGET_COMPARED = ("train.global_batch_size",)
# compared as resolved (``auto``: bf16 on a GPU, fp32 on a CPU), from the run record's
# ``resolved`` section: a GPU run's checkpoint continued on a CPU changed it silently
PRECISION = "train.precision"


@dataclass(frozen=True)
class Change:
    key: str
    saved: Any
    current: Any

    def __str__(self) -> str:
        return f"{self.key}: {self.saved!r} -> {self.current!r}"


def _flatten(value: Any, prefix: str, out: dict) -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            _flatten(v, f"{prefix}.{k}", out)
    else:
        out[prefix] = value


def _compared(config: dict, keys: tuple = COMPARED) -> dict[str, Any]:
    """The ``keys`` of a config dict, flattened (``model.kv_shift.window``)."""
    out: dict[str, Any] = {}
    for key in keys:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        _flatten(node, key, out)
    # data.seed null means train.seed: compare the seed the data order comes from
    if "data.seed" in out and out["data.seed"] is None:
        out["data.seed"] = (config.get("train") or {}).get("seed")
    # with a tokenizer, data.eod_id is null or the tokenizer's own (data/tokenizer.py):
    # the tokenizer, compared, says where documents end
    if (config.get("data") or {}).get("tokenizer"):
        out.pop("data.eod_id", None)
    return {k: v for k, v in out.items() if not k.startswith(IGNORED)}


def config_changes(saved: dict, current: dict, keys: tuple = COMPARED) -> list[Change]:
    """The ``keys`` (sections or keys) whose values differ between two run configs.
    A key the saved config lacks (added to kvtrain after the checkpoint was written)
    counts as its default: the run that wrote it behaved as that."""
    a, b = _compared(saved, keys), _compared(current, keys)
    defaults = _defaults(keys)
    a.update({k: defaults[k] for k in b if k not in a and k in defaults})
    return [Change(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k)]


def _defaults(keys: tuple) -> dict[str, Any]:
    """The ``keys`` of a default config, flattened."""
    from .loader import to_dict
    from .schema import RunConfig

    return _compared(to_dict(RunConfig()), keys)


def _allowed(key: str, allowed: list[str]) -> bool:
    return any(key == a or key.startswith(a + ".") for a in allowed)


def check_allowed_keys(allowed: list[str]) -> None:
    """``checkpoint.allow_config_changes`` names only keys that resume compares."""
    compared = COMPARED + TOKEN_BUDGET_COMPARED + (PRECISION,)
    for a in allowed:
        if not any(a == c or a.startswith(c + ".") or c.startswith(a + ".") for c in compared):
            raise ConfigError(
                f"checkpoint.allow_config_changes: {a!r} is not compared on resume "
                f"(compared: {', '.join(COMPARED)}, {PRECISION}, and "
                f"{', '.join(TOKEN_BUDGET_COMPARED)} "
                f"for a run sized by train.train_tokens; everything else may change freely)")


def _sized_by_tokens(config: dict) -> bool:
    """Whether the run of a config dict ends by ``train.train_tokens`` (layout's rule)."""
    if not (config.get("train") or {}).get("train_tokens"):
        return False
    from .layout import total_steps
    from .loader import from_dict
    from .schema import RunConfig

    run = from_dict(RunConfig, {k: v for k, v in config.items() if k != "resolved"})
    return total_steps(run)[1] == "train.train_tokens"


def check_resume_config(saved: Optional[dict], current: dict, allowed: list[str],
                        where: str) -> list[Change]:
    """The changes between the checkpoint's config and the run's (compared keys,
    then ``RECORDED`` ones); raises ``ConfigError`` (one line) when a compared one
    is not allowed."""
    if not saved:
        return []  # a checkpoint of another tool: nothing to compare
    keys = COMPARED + (TOKEN_BUDGET_COMPARED if _sized_by_tokens(current) else ())
    changes = config_changes(saved, current, keys) + _precision_change(saved, current)
    refused = [c for c in changes if not _allowed(c.key, allowed) and not _new_curve(c)]
    if refused:
        keys = ", ".join(sorted({c.key for c in refused}))
        raise ConfigError(
            f"{where} was saved by a different run: {'; '.join(map(str, refused))}. "
            f"Resume it with the saved values, or set checkpoint.allow_config_changes: "
            f"[{keys}] to go on with the new ones")
    check_precision_change(changes, current, where)
    said = {c.key for c in changes}  # a token budget's global batch: compared already
    return changes + [c for c in config_changes(saved, current, RECORDED) if c.key not in said]


def _new_curve(change: Change) -> bool:
    """A named validation set added or dropped (``VALID_SETS``)."""
    return change.key.startswith(VALID_SETS) and (change.saved is None
                                                  or change.current is None)


def _resolved_precision(config: dict) -> Optional[str]:
    """What a run record's ``train.precision`` ran as; None where unknown (a record
    from before kvtrain recorded it, of ``auto``)."""
    resolved = (config.get("resolved") or {}).get("precision")
    setting = (config.get("train") or {}).get("precision", "auto")
    return resolved or (setting if setting != "auto" else None)


def _precision_change(saved: dict, current: dict) -> list[Change]:
    a, b = _resolved_precision(saved), _resolved_precision(current)
    return [Change(PRECISION, a, b)] if a is not None and b is not None and a != b else []


def check_precision_change(changes: list[Change], current: dict, where: str) -> None:
    """An allowed change of precision continues from the checkpoint's fp32 main
    parameters, which the distributed optimizer keeps at any precision; megatron's
    plain optimizer keeps another state for half parameters than for fp32 ones:
    either way the load failed, and the checkpoint was called unusable."""
    change = next((c for c in changes if c.key == PRECISION), None)
    parallel, checkpoint = current.get("parallel") or {}, current.get("checkpoint") or {}
    if (change is not None and not parallel.get("distributed_optimizer", True)
            and checkpoint.get("load_optimizer", True)):
        raise ConfigError(
            f"{where}: a change of {change} needs parallel.distributed_optimizer: true (its "
            "state holds fp32 main parameters at every precision; the plain optimizer's "
            "differs between half and fp32 parameters), or checkpoint.load_optimizer: false")


__all__ = ["COMPARED", "RECORDED", "TOKEN_BUDGET_COMPARED", "Change", "check_allowed_keys", "check_resume_config", "config_changes"]
