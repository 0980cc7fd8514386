"""An experiment's results: the curve of each arm (read from its run's
``metrics.jsonl``), ``results.csv``, ``accuracy.png``, ``loss.png`` and the
summary (final accuracies, steps to 95 %, wall time, parameters per arm); for
the k-hop task also each arm's error rate by hop count (``hop_errors.png``).

Curve fields: ``arm, step, accuracy, accuracy_all, loss, train_loss, lr,
elapsed_s``; ``accuracy`` is the paper's first-prediction-position accuracy
(``val_acc_induction_first`` / ``val_acc_ngram_first``; every position for the
k-hop task, ``val_acc_hop_all``), ``accuracy_all`` at
every prediction position, ``loss`` the LM loss on the fixed evaluation set
(``val_loss``), ``train_loss`` the trainer's logged ``lm_loss`` at that step.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvtrain.output import written_whole
from kvtrain.records import read_records
from kvtrain.tasks.config import MASKS

CURVE_FIELDS = ["arm", "step", "accuracy", "accuracy_all", "loss", "train_loss", "lr",
                "elapsed_s"]
THRESHOLD = 0.95


def curve_from_metrics(path: str | Path, arm: str, task: str,
                       starts: Sequence[float] = ()) -> list[dict]:
    """The curve rows of one arm from its run's ``metrics.jsonl``: one per
    ``valid`` record of the run's own validation (not a named set's), with the latest
    ``train`` record's loss and lr; ``elapsed_s`` is ``training_time`` given the
    ``starts`` of the arm's attempts. Text data (a sweep's cells) has no accuracy: NaN."""
    first, every = MASKS.get(task, ("", ""))
    records = read_records(Path(path))[0]
    times = [float(r["time"]) if isinstance(r.get("time"), (int, float)) else math.nan
             for r in records]
    rows, train_loss, lr = [], math.nan, math.nan
    for rec, elapsed in zip(records, training_time(times, starts)):
        if rec.get("kind") == "train":
            loss = rec.get("lm_loss")
            train_loss = float(loss) if isinstance(loss, (int, float)) else math.nan
            lr = float(rec["lr"]) if isinstance(rec.get("lr"), (int, float)) else math.nan
        elif rec.get("kind") == "valid" and not rec.get("set"):
            rows.append({
                "arm": arm, "step": int(rec["iteration"]),
                "accuracy": float(rec.get(f"val_acc_{first}", math.nan)),
                "accuracy_all": float(rec.get(f"val_acc_{every}", math.nan)),
                "loss": float(rec["val_loss"]), "train_loss": train_loss, "lr": lr,
                "elapsed_s": round(elapsed, 2),
            })
    return rows


def training_time(times: list[float], starts: Sequence[float] = ()) -> list[float]:
    """The seconds of training behind each record written at ``times``, given
    when each attempt at the run started (``starts``; records before them all
    count from the first record).

    A run resumed from a checkpoint holds the records of several attempts: each
    attempt counts from its own start, after the time of the attempts before
    it up to their last record kept. Not counted: the time between attempts and
    what a crash lost after its last checkpoint (the trainer drops those
    records): they are not behind this curve (the runner's ``wall_s`` of an arm
    is the time of all its attempts)."""
    pending, out = sorted(starts), []
    behind, start, last = 0.0, None, None
    for t in times:
        if not math.isfinite(t):
            out.append(math.nan)
            continue
        begun = None
        while pending and pending[0] <= t:  # an attempt without records is passed over
            begun = pending.pop(0)
        if start is None or begun is not None:
            behind += 0.0 if start is None else last - start
            start = t if begun is None else begun
        out.append(behind + t - start)
        last = t
    return out


def steps_to_threshold(steps: list[int], accuracies: list[float],
                       threshold: float = THRESHOLD) -> Optional[int]:
    """The first evaluated step whose accuracy is >= ``threshold`` (None if never)."""
    for step, acc in zip(steps, accuracies):
        if acc == acc and acc >= threshold:
            return step
    return None


def write_results(rows: list[dict], path: str | Path) -> None:
    with written_whole(path, newline="") as f:
        w = csv.DictWriter(f, CURVE_FIELDS)
        w.writeheader()
        w.writerows(rows)


@dataclass
class ArmResult:
    """What one arm's run gave: its curve, wall time, exit code and size."""

    arm: str
    rows: list[dict]
    wall_s: float
    exit_code: int
    params: dict = field(default_factory=dict)  # total, non_embedding
    hop_errors: dict = field(default_factory=dict)  # the k-hop task: {k: error rate}


def hop_errors_from_metrics(path: str | Path) -> dict[int, float]:
    """The k-hop task's error rate of each hop count at the last validation
    (``1 - val_acc_hop_K``); {} for other tasks or before any validation."""
    records = [r for r in read_records(Path(path))[0] if r.get("kind") == "valid"] \
        if Path(path).exists() else []
    if not records:
        return {}
    last = records[-1]
    out = {}
    for key, value in last.items():
        hops = key[len("val_acc_hop_"):]
        if key.startswith("val_acc_hop_") and hops.isdigit() and isinstance(value, (int, float)):
            out[int(hops)] = 1.0 - float(value)
    return dict(sorted(out.items()))


def plot_hop_errors(results: list["ArmResult"], path: str | Path, title: str = "") -> None:
    """Figure 8: each arm's error rate against the hop count, at its last evaluation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, r in enumerate(results):
        if r.hop_errors:
            style = "-o" if r.arm.startswith("kv_shift") else "--s"
            ax.plot(list(r.hop_errors), list(r.hop_errors.values()), style, ms=3.5,
                    color=f"C{i // 2}", label=r.arm)
    ax.set_xlabel("hops k")
    ax.set_ylabel("error rate (last evaluation)")
    ax.set_ylim(-0.02, 1.02)
    _finish(plt, fig, ax, path, title)


def _arm_summary(r: ArmResult) -> dict:
    rows = r.rows or [dict.fromkeys(CURVE_FIELDS, math.nan)]
    steps = [x["step"] for x in rows]
    last = rows[-1]
    # a NaN (an evaluation without an accuracy) would make max() depend on the order
    finite = [x["accuracy"] for x in rows if math.isfinite(x["accuracy"])]
    return {
        "final_step": last["step"],
        "final_accuracy": last["accuracy"],
        "final_accuracy_all": last["accuracy_all"],
        "max_accuracy": max(finite, default=math.nan),
        "final_loss": last["loss"],
        "steps_to_95": steps_to_threshold(steps, [x["accuracy"] for x in rows]),
        "steps_to_95_all": steps_to_threshold(steps, [x["accuracy_all"] for x in rows]),
        "wall_s": round(r.wall_s, 1),
        "exit_code": r.exit_code,
        "non_embedding_params": r.params.get("non_embedding"),
        "total_params": r.params.get("total"),
        **({"hop_errors": {str(k): v for k, v in r.hop_errors.items()}} if r.hop_errors else {}),
    }


def summarize(results: list[ArmResult], wall_s: float) -> dict:
    return {"arms": {r.arm: _arm_summary(r) for r in results}, "wall_s": round(wall_s, 1)}


def plot_curves(rows: list[dict], path: str | Path, metric: str = "accuracy", title: str = "",
                arms: Optional[list[str]] = None) -> None:
    """``metric`` against step, one line per arm (``accuracy`` also draws
    ``accuracy_all`` dotted and the 95% line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = arms or list(dict.fromkeys(r["arm"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, arm in enumerate(arms):
        pts = [r for r in rows if r["arm"] == arm]
        color = f"C{i}"
        ax.plot([r["step"] for r in pts], [r[metric] for r in pts], "-o", ms=2.5, color=color,
                label=arm)
        if metric == "accuracy":
            ax.plot([r["step"] for r in pts], [r["accuracy_all"] for r in pts], ":", color=color,
                    lw=1, label=f"{arm} (all positions)")
    if metric == "accuracy":
        ax.axhline(THRESHOLD, color="grey", lw=0.8, ls="--")
        ax.set_ylim(-0.02, 1.02)
        ax.set_ylabel("accuracy (solid: first prediction position)")
    else:
        ax.set_ylabel(f"eval {metric}")
    ax.set_xlabel("step")
    _finish(plt, fig, ax, path, title)


def _finish(plt, fig, ax, path: str | Path, title: str) -> None:
    """The title, grid and legend of a plot; the PNG written, the figure closed."""
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    try:
        with written_whole(path, "wb") as f:
            fig.savefig(f, format="png", dpi=110)
    finally:
        plt.close(fig)


def summary_json(summary: dict) -> str:
    """``summary.json``'s text: a number that is not finite (an arm without a
    curve, a diverged loss) is null, as JSON has no NaN."""
    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        return [clean(v) for v in value] if isinstance(value, list) else value
    return json.dumps(clean(summary), indent=2, allow_nan=False)


def format_summary(summary: dict) -> str:
    lines = [f"{'arm':<14} {'final acc':>9} {'acc all':>8} {'max acc':>8} {'steps->95%':>11} "
             f"{'loss':>7} {'wall s':>7}"]
    for arm, a in summary["arms"].items():
        s95 = a["steps_to_95"] if a["steps_to_95"] is not None else "never"
        lines.append(f"{arm:<14} {a['final_accuracy']:>9.4f} {a['final_accuracy_all']:>8.4f} "
                     f"{a['max_accuracy']:>8.4f} {str(s95):>11} {a['final_loss']:>7.4f} "
                     f"{a['wall_s']:>7.0f}")
    hops = {arm: a["hop_errors"] for arm, a in summary["arms"].items() if a.get("hop_errors")}
    if hops:
        counts = sorted({int(k) for errors in hops.values() for k in errors})
        lines.append("error rate by hops: " + " ".join(f"{k:>5}" for k in counts))
        for arm, errors in hops.items():
            lines.append(f"{arm:<18} " + " ".join(
                f"{errors[str(k)]:>5.3f}" if str(k) in errors else "    -" for k in counts))
    lines.append(f"total wall time: {summary['wall_s']:.0f} s")
    return "\n".join(lines)
