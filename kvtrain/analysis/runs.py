"""A finished (or running) run folder as data: its curves, its KV-shift
coefficients and its evaluation results (per task and setting), read from what the trainer and
``kvtrain eval`` wrote (``config.yaml``, ``metrics.jsonl``, ``eval/*.json``).

Nothing here imports torch: ``kvtrain compare`` works on any machine that
holds the run folders.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError, read_yaml
from kvtrain.records import METRICS_FILE as METRICS
from kvtrain.records import read_records, spans_text, unrecorded

CONFIG = "config.yaml"
EVAL_DIR = "eval"


@dataclass
class Curve:
    """A loss against consumed tokens (and iterations), in the order logged."""

    iterations: list[int] = field(default_factory=list)
    tokens: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    # iterations whose loss was not finite (skipped): an empty curve with some is a
    # run that diverged, not one that never evaluated
    nonfinite: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.loss)

    @property
    def final(self) -> Optional[float]:
        return self.loss[-1] if self.loss else None


@dataclass
class RunData:
    """What ``kvtrain compare`` reads of one run."""

    path: Path
    label: str
    config: dict  # config.yaml as a plain mapping ({} when absent)
    train: Curve
    valid: Curve
    valid_sets: dict[str, Curve] = field(default_factory=dict)  # data.valid_sets, by name
    shift: Optional[dict] = None  # the latest kv_shift record
    evals: list = field(default_factory=list)  # read_evals' entries: a task's setting + metrics
    notes: list[str] = field(default_factory=list)  # what could not be read, for the report

    @property
    def attention(self) -> str:
        return str((self.config.get("model") or {}).get("attention", "?"))

    @property
    def final_tokens(self) -> Optional[float]:
        return self.train.tokens[-1] if self.train.tokens else None


def _number(value) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def tokens_per_iteration(config: dict) -> Optional[float]:
    """global batch x sequence length of the config (None when not given)."""
    train = config.get("train")
    if not isinstance(train, dict):
        return None
    gbs, seq = train.get("global_batch_size"), train.get("seq_length")
    if isinstance(gbs, int) and isinstance(seq, int):
        return float(gbs * seq)
    return None


def interpolate(x: float, xs: list[float], ys: list[float]) -> Optional[float]:
    """``ys`` at ``x`` by linear interpolation on increasing ``xs`` (None outside)."""
    if not xs or x < xs[0] or x > xs[-1]:
        return None
    for i in range(1, len(xs)):
        if x <= xs[i]:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return y1 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[0]


def _curves(records: list[dict], config: dict) -> tuple[Curve, Curve, dict[str, Curve]]:
    """Train loss and validation loss against tokens, and each named validation set's
    (records with ``set: NAME``). Validation records carry no token count: it comes
    from the train records' consumed tokens at that iteration (interpolated), else
    from the config's tokens per iteration after the last one."""
    train, valid, sets = Curve(), Curve(), {}
    for r in records:
        it, loss = r.get("iteration"), _number(r.get("lm_loss"))
        if r.get("kind") == "train" and isinstance(it, int) and loss is not None:
            tokens = _number(r.get("consumed_tokens"))
            if tokens is None and tokens_per_iteration(config):
                tokens = it * tokens_per_iteration(config)
            if tokens is not None:
                train.iterations.append(it)
                train.tokens.append(tokens)
                train.loss.append(loss)
    per_iter = tokens_per_iteration(config)
    known = ([0.0] + [float(i) for i in train.iterations], [0.0] + train.tokens)
    for r in records:
        it, loss = r.get("iteration"), _number(r.get("val_loss"))
        if r.get("kind") != "valid" or not isinstance(it, int) or "val_loss" not in r:
            continue
        name = r.get("set")
        curve = sets.setdefault(str(name), Curve()) if name else valid
        tokens = interpolate(float(it), *known)
        if tokens is None and per_iter and it > known[0][-1]:
            # after the last train record (a run still running, or crashed): on from its
            # consumed tokens, counted at the batches it ran (a resume may change them)
            tokens = known[1][-1] + (it - known[0][-1]) * per_iter
        if loss is None:
            curve.nonfinite.append(it)
        elif tokens is not None:
            curve.iterations.append(it)
            curve.tokens.append(tokens)
            curve.loss.append(loss)
    return train, valid, sets


def short_of_steps(config: dict, curve: Curve) -> Optional[str]:
    """Why ``curve``'s last (finite) validation is not the run's final one: taken short of
    the run's steps (``train.max_steps``) and tokens (``train.train_tokens``), as a run
    still running, stopped or diverged has it (a finished run validates at its last
    step); None when not."""
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    steps, budget = train.get("max_steps"), train.get("train_tokens")
    steps = steps if isinstance(steps, int) and not isinstance(steps, bool) else None
    budget = budget if isinstance(budget, int) and not isinstance(budget, bool) else None
    it, tokens = curve.iterations[-1], curve.tokens[-1]
    if (steps is None and budget is None) or (steps is not None and it >= steps) or \
            (budget is not None and tokens >= budget):
        return None
    if budget is not None:  # the steps that cover it come first (layout.total_steps)
        where = f"{tokens:.0f} tokens, short of its {budget} (train.train_tokens)"
    else:
        where = f"iteration {it}, short of its {steps} steps (train.max_steps)"
    why = ("the later ones are not finite" if curve.nonfinite and curve.nonfinite[-1] > it
           else "still running or stopped")
    return f"its last finite validation is at {where}: {why}, its loss is not final"


def later_history(records: list[dict], metrics: Path) -> tuple[list[dict], list[str]]:
    """The records of one history: where a train record's iteration goes back (two
    files concatenated, a restart that kept the records after its checkpoint; the
    trainer itself cuts them at every start), the records from that iteration on
    that came before it are dropped, as the trainer would have; a note for each."""
    kept, notes, last = [], [], None
    for r in records:
        it = r.get("iteration")
        if r.get("kind") == "train" and isinstance(it, int):
            if last is not None and it <= last:
                def stale(x: dict) -> bool:
                    at = x.get("iteration")
                    return isinstance(at, int) and at >= it and x.get("kind") != "event"

                top = max(x["iteration"] for x in kept if stale(x))
                kept = [x for x in kept if not stale(x)]
                notes.append(f"{metrics}: iterations {it}-{top} are recorded twice (the "
                             f"history goes back to {it}): the later records are read")
            last = it
        kept.append(r)
    return kept, notes


def nonfinite_notes(records: list[dict], metrics: Path) -> list[str]:
    """Notes on train / valid records whose loss is not a finite number (the
    trainer writes "nan"/"inf"): the curves skip them, so a diverged run would
    otherwise show its last finite loss as its final one, unremarked."""
    notes = []
    for kind, key in (("train", "lm_loss"), ("valid", "val_loss")):
        bad = [r.get("iteration") for r in records
               if r.get("kind") == kind and key in r and _number(r[key]) is None]
        if bad:
            notes.append(f"{metrics}: {key} not finite in {len(bad)} {kind} record(s), first at "
                         f"iteration {bad[0]} (skipped: the curve and final loss stop before)")
    return notes


def gap_notes(records: list[dict], metrics: Path) -> list[str]:
    """A note on trained iterations no train record stands for (records a full
    disk refused to the end of a run): the curve passes straight over them."""
    gaps = unrecorded(records, named_too=True)
    if not gaps:
        return []
    return [f"{metrics}: no train records of iterations {spans_text(gaps)}, which were "
            "trained (their records were not written): the curve passes over them"]


# what makes two results of a task comparable: same checkpoint iteration, shots, limit, dtype
EVAL_KEY = ("task", "iteration", "num_fewshot", "limit", "dtype", "max_length")


def _scalar(value) -> Optional[float]:
    return value if _number(value) is not None else None


def eval_setting(record: dict, task: str) -> dict:
    """The setting of ``task``'s results in a ``kvtrain eval`` record: the
    checkpoint's iteration, the shots (as lm-eval reported running them in
    ``n_shot``: a task whose YAML fixes 0 ignores ``--num-fewshot``; else the
    shots asked for), ``--limit``, ``--dtype`` (fp32 in a record whose config
    names none) and the window lm-eval scored within (``max_length``: a record of
    kvtrain before session 42 names none); None for what the record does not say."""
    config = record.get("config") if isinstance(record.get("config"), dict) else {}
    ran = record["n_shot"].get(task) if isinstance(record.get("n_shot"), dict) else None
    shots = ran if _number(ran) is not None else config.get("num_fewshot")
    return {"task": task, "iteration": _scalar(record.get("iteration")),
            "num_fewshot": _scalar(shots), "limit": _scalar(config.get("limit")),
            "dtype": str(config.get("dtype") or "fp32") if config else None,
            "max_length": _scalar(record.get("max_length"))}


def eval_key(entry: dict) -> tuple:
    return tuple(entry[k] for k in EVAL_KEY)


def key_order(key: tuple) -> tuple:
    """Sorts setting keys whose parts may be None (unknown first)."""
    return tuple((v is not None, v if v is not None else 0) for v in key)


def _positions(value) -> bool:
    """A ``by_position`` entry of a record: equally long lists of losses and counts."""
    return (isinstance(value, dict) and isinstance(value.get("loss"), list)
            and isinstance(value.get("tokens"), list)
            and len(value["loss"]) == len(value["tokens"]))


def read_evals(run: Path) -> tuple[list[dict], list[str]]:
    """The results of ``RUN/eval/*.json``, one entry per task and setting:
    ``{"task", "iteration", "num_fewshot", "limit", "dtype", "metrics": {metric: value}}``
    (numbers only; files of one setting add up, a later name replacing a
    metric), and a ``kvtrain perplexity --by-position`` record's ``by_position``;
    files that do not read as such are named in the notes."""
    entries: dict[tuple, dict] = {}
    notes = []
    for path in sorted((run / EVAL_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            tasks = record.get("tasks")
        except (OSError, ValueError, AttributeError) as e:
            notes.append(f"{path}: not read ({type(e).__name__})")
            continue
        if not isinstance(tasks, dict):
            notes.append(f"{path}: no \"tasks\" mapping")
            continue
        for task, metrics in tasks.items():
            if not isinstance(metrics, dict):
                continue
            numbers = {str(m): float(v) for m, v in metrics.items() if _number(v) is not None}
            if numbers:
                setting = eval_setting(record, str(task))
                entry = entries.setdefault(eval_key(setting), {**setting, "metrics": {}})
                entry["metrics"].update(numbers)
                if _positions(record.get("by_position")):
                    entry["by_position"] = record["by_position"]
    return [entries[k] for k in sorted(entries, key=key_order)], notes


def checked_folder(path: str | Path) -> Path:
    """``path`` as a folder, else one line: no such folder, or a file there."""
    run = Path(path).expanduser()
    if run.exists() and not run.is_dir():
        raise ConfigError(f"{run} is a file, not a run folder")
    if not run.is_dir():
        raise ConfigError(f"{run}: no such run folder")
    return run


def read_run(path: str | Path, label: Optional[str] = None) -> RunData:
    """The run in folder ``path``; ConfigError (one line) when it is not a run
    folder or has no train records."""
    run = checked_folder(path)
    metrics = run / METRICS
    if not metrics.is_file():
        raise ConfigError(f"{run} is not a kvtrain run folder (no {METRICS})")
    config = {}
    if (run / CONFIG).is_file():
        config = read_yaml(run / CONFIG) or {}
    records, bad = read_records(metrics)
    records, twice = later_history(records, metrics)
    train, valid, sets = _curves(records, config)
    if not train.loss:
        raise ConfigError(f"{metrics} has no train records with a loss")
    shifts = [r for r in records if r.get("kind") == "kv_shift"]
    evals, notes = read_evals(run)
    notes[:0] = twice + nonfinite_notes(records, metrics) + gap_notes(records, metrics)
    if bad:
        notes.insert(0, f"{metrics}: {bad} line(s) are not JSON records (skipped)")
    return RunData(path=run, label=label or run.name, config=config, train=train, valid=valid,
                   valid_sets=sets, shift=shifts[-1] if shifts else None, evals=evals,
                   notes=notes)


def unique_labels(paths: list[Path]) -> list[str]:
    """Folder names, with as many parent folders as it takes to tell them apart;
    refuses a folder given twice (its runs would be labelled alike)."""
    resolved = [Path(p).resolve() for p in paths]
    for i, path in enumerate(resolved):
        if path in resolved[:i]:
            raise ConfigError(f"run folder {path} is given twice: name each run once")
    parts = [p.parts for p in resolved]
    depth = 1  # distinct folders: their whole paths at most tell them apart
    while len({"/".join(p[-depth:]) for p in parts}) < len(parts):
        depth += 1
    return ["/".join(p[-depth:]) for p in parts]


__all__ = ["Curve", "EVAL_KEY", "RunData", "eval_key", "eval_setting", "interpolate",
           "key_order", "read_evals", "read_run", "short_of_steps",
           "tokens_per_iteration", "unique_labels"]
