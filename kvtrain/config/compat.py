"""Does a checkpoint belong to this run? Its saved config against the new one.

A resume silently reinterprets a checkpoint when the run around it changed:
another ``train.seq_length`` changes what the data position and the token
counts mean, another data blend or tokenizer feeds other tokens, another model
section is another model. Before a checkpoint is loaded, the config saved in
it is compared with the run's on the keys of ``COMPARED``; a difference stops
the run with one line, unless ``checkpoint.allow_config_changes`` names the
key (or a section above it). What changed is then printed and recorded.

Everything else may change on a resume: the parallel layout (checkpoints
reshard), the schedule, the optimizer's hyper-parameters (the run's values
replace those of the checkpoint's param groups; a change of one is printed and
recorded like an allowed change, ``RECORDED``), the intervals, logging, and ``model.backend`` and the kernel choices
(``model.rope_kernel``, ``model.kv_shift.kernel``,
``model.cross_entropy_kernel``, ``model.swiglu_kernel``: the same weights on
other kernels). A key newer
than the checkpoint compares as its default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .loader import ConfigError

# Sections or keys compared on resume (a section compares every key below it).
COMPARED = ("model", "train.seq_length", "data.type", "data.paths", "data.split",
            "data.tokenizer", "data.seed", "data.induction", "data.ngram")
# how the model runs, not what it is (the same weights on other kernels)
IGNORED = ("model.backend", "model.rope_kernel", "model.kv_shift.kernel",
           "model.cross_entropy_kernel", "model.swiglu_kernel")
# free to change, but said and recorded: the run's values override the checkpoint's
RECORDED = ("optimizer",)


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
    for a in allowed:
        if not any(a == c or a.startswith(c + ".") or c.startswith(a + ".") for c in COMPARED):
            raise ConfigError(
                f"checkpoint.allow_config_changes: {a!r} is not compared on resume "
                f"(compared: {', '.join(COMPARED)}; everything else may change freely)")


def check_resume_config(saved: Optional[dict], current: dict, allowed: list[str],
                        where: str) -> list[Change]:
    """The changes between the checkpoint's config and the run's (compared keys,
    then ``RECORDED`` ones); raises ``ConfigError`` (one line) when a compared one
    is not allowed."""
    if not saved:
        return []  # a checkpoint of another tool: nothing to compare
    changes = config_changes(saved, current)
    refused = [c for c in changes if not _allowed(c.key, allowed)]
    if refused:
        keys = ", ".join(sorted({c.key for c in refused}))
        raise ConfigError(
            f"{where} was saved by a different run: {'; '.join(map(str, refused))}. "
            f"Resume it with the saved values, or set checkpoint.allow_config_changes: "
            f"[{keys}] to go on with the new ones")
    return changes + config_changes(saved, current, RECORDED)


__all__ = ["COMPARED", "RECORDED", "Change", "check_allowed_keys", "check_resume_config", "config_changes"]
