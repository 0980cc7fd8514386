"""``kvtrain scaling``: validation loss against model size, per attention (Figure 6a).

The paper's scaling law (Figure 6a, after Kaplan et al. 2020) is each attention's
final validation loss against the model's non-embedding parameters ``N``, over
models trained alike (10B tokens each), with a power law fitted to each:
``L(N) = (N_c / N) ** alpha``, a straight line in log-log, fitted here by least
squares on ``(log N, log L)``. From two fitted arms follows the figure's claim in
one number per size: the parameters the reference arm (vanilla) needs to reach
the other's loss, as a multiple of the other's (``N_A(L_B(N)) / N``; > 1: the
other arm gets more from a parameter), read only where the reference's loss falls
with size: on its measured segments that fall (log-log lines), beyond its sizes by its
fitted slope through its end point, below the size where the other arm is worse (< 1),
above it where better (> 1); none where that falling part does not reach the loss, and
none at all where a fit does not fall with size (see ``size_multiple``).

Runs are grouped into arms by their attention (``model.attention``; a KV-shift
run's non-default ``model.kv_shift`` choices name another arm: ``kv_shift
(shift=[k])``); runs of one arm and size (seeds) give one point, their mean. A run
whose settings differ from the first run's in more than its size and attention
(tokens, data, learning rate, batch) is noted, since its loss then measures more
than the size. Reads only run folders (no torch), like ``kvtrain compare``.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from kvtrain.config import ConfigError
from kvtrain.config.loader import from_dict, to_dict
from kvtrain.config.model import KVShiftConfig
from kvtrain.config.schema import ModelConfig, ParallelConfig

from .compare import _common_parent, _settings
from .runs import RunData, checked_folder, read_run, short_of_steps, unique_labels

# The keys of a model's size: what a scaling study varies beside the attention.
SIZE_KEYS = ("model.num_layers", "model.hidden_size", "model.num_attention_heads",
             "model.num_query_groups", "model.ffn_hidden_size", "model.kv_channels",
             "model.mla", "model.max_position_embeddings")
REPLICATE_KEYS = ("train.seed", "data.seed")  # seeds: replicates of a point, not a confound
SHIFT_CHOICES = ("shift", "window", "mode", "weight_decay", "heads")  # what makes another arm
REFERENCE = "vanilla"  # the arm the others are measured against, where present
# the largest log size a float holds: a law that barely falls (alpha ~1e-4, tiny models)
# puts N_c, and the size it needs for a lower loss, past it
LOG_MAX = math.log(sys.float_info.max)


@dataclass
class Point:
    """One run: its arm, size and final validation loss."""

    label: str
    arm: str
    non_embedding: int
    total: int
    loss: Optional[float]
    tokens: Optional[float]
    left_out: Optional[str] = None  # why its loss is not fitted (None: fitted, or not finite)


@dataclass
class Fit:
    """``log L = intercept + slope * log N`` over ``points`` sizes (``alpha`` = -slope)."""

    slope: float
    intercept: float
    points: int
    n_min: int
    n_max: int
    r2: Optional[float] = None  # in log space, from three sizes on

    @property
    def alpha(self) -> float:
        return -self.slope

    @property
    def n_c(self) -> Optional[float]:
        """Kaplan's ``N_c``: ``L = (N_c / N) ** alpha`` (None unless alpha > 0, and
        where it is past a float)."""
        if self.alpha <= 0 or self.intercept / self.alpha > LOG_MAX:
            return None
        return math.exp(self.intercept / self.alpha)

    def loss(self, n: float) -> float:
        return math.exp(self.intercept + self.slope * math.log(n))

    def size_for(self, loss: float) -> Optional[float]:
        """The N at which the fit reaches ``loss`` (None for a flat or rising fit, or
        one that reaches it only past a float)."""
        if self.slope >= 0 or loss <= 0:
            return None
        at = (math.log(loss) - self.intercept) / self.slope
        return math.exp(at) if at <= LOG_MAX else None


def arm_name(config: dict) -> str:
    """``vanilla``, ``kv_shift``, or ``kv_shift (shift=['k'])`` for non-default choices."""
    model = config.get("model") or {}
    attention = str(model.get("attention", "vanilla"))
    if attention != "kv_shift":
        return attention
    default = to_dict(KVShiftConfig())
    shift = model.get("kv_shift") or {}
    choices = [f"{k}={shift[k]}" for k in SHIFT_CHOICES if k in shift and shift[k] != default[k]]
    return f"kv_shift ({', '.join(choices)})" if choices else "kv_shift"


def model_params(config: dict, where: str) -> tuple[int, int]:
    """(non-embedding, total) parameters of a run's ``model`` section, the total with
    the vocabulary padded for the run's ``parallel.tensor`` (megatron's rule: the
    embedding it trained), both without the KV shift's coefficients (4 per KV head and
    layer, < 0.001 % of a layer's weights: the two attentions of one architecture are
    one size). The non-embedding size, what the law is fitted on, is one for every TP."""
    try:
        model = from_dict(ModelConfig, dict(config.get("model") or {}), "model", where)
        parallel = from_dict(ParallelConfig, dict(config.get("parallel") or {}), "parallel",
                             where)
    except (ConfigError, TypeError) as e:
        raise ConfigError(f"{where}: its model cannot be counted ({e})") from None
    return size_of(model, parallel.tensor)


def size_of(model: ModelConfig, tensor_parallel: int = 1) -> tuple[int, int]:
    """(non-embedding, total) parameters of ``model`` without its shift coefficients,
    the vocabulary padded for ``tensor_parallel`` (the total's embedding only)."""
    from kvtrain.plan.params import count_params

    counts = count_params(model, tensor_parallel)
    return int(counts.non_embedding - counts.kv_shift), int(counts.total - counts.kv_shift)


def point(run: RunData, valid_set: Optional[str] = None) -> Point:
    """The run's size and final validation loss (of ``valid_set``, a
    ``data.valid_sets`` name, where given)."""
    if not run.config:
        raise ConfigError(f"{run.path} has no config.yaml: its model size is unknown")
    n, total = model_params(run.config, str(run.path / "config.yaml"))
    curve = run.valid if valid_set is None else run.valid_sets.get(valid_set)
    if valid_set is not None and curve is None:
        raise ConfigError(f"{run.path}: no validation set {valid_set!r} in its records "
                          f"(it has: {', '.join(sorted(run.valid_sets)) or 'none'})")
    loss = curve.final if curve else None
    finite = loss is not None and math.isfinite(loss)
    short = short_of_steps(run.config, curve) if curve else None
    return Point(run.label, arm_name(run.config), n, total, loss if finite and not short else None,
                 curve.tokens[-1] if curve else None, short)


def fit_power_law(points: Sequence[tuple[float, float]]) -> Optional[Fit]:
    """Least squares of log L on log N over (N, L) pairs; None below two sizes."""
    pairs = [(math.log(n), math.log(loss)) for n, loss in points if n > 0 and loss and loss > 0]
    if len({x for x, _ in pairs}) < 2:
        return None
    mx = sum(x for x, _ in pairs) / len(pairs)
    my = sum(y for _, y in pairs) / len(pairs)
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx
    intercept = my - slope * mx
    r2 = None
    if len({x for x, _ in pairs}) >= 3:
        total = sum((y - my) ** 2 for _, y in pairs)
        residual = sum((y - intercept - slope * x) ** 2 for x, y in pairs)
        r2 = 1.0 - residual / total if total > 0 else 1.0
    sizes = [math.exp(x) for x, _ in pairs]
    return Fit(slope, intercept, len({x for x, _ in pairs}), round(min(sizes)),
               round(max(sizes)), r2)


@dataclass
class Arm:
    """One attention's points (mean over runs of one size) and its fit."""

    name: str
    sizes: dict[int, list[float]] = field(default_factory=dict)  # N -> the runs' losses
    fit: Optional[Fit] = None

    def mean(self, n: int) -> Optional[float]:
        losses = self.sizes.get(n) or []
        return sum(losses) / len(losses) if losses else None


def arms_of(points: Sequence[Point]) -> list[Arm]:
    """The arms in the order first seen, the reference (vanilla) first; each fitted."""
    arms: dict[str, Arm] = {}
    for p in points:
        arm = arms.setdefault(p.arm, Arm(p.arm))
        if p.loss is not None:
            arm.sizes.setdefault(p.non_embedding, []).append(p.loss)
    for arm in arms.values():
        arm.fit = fit_power_law([(n, arm.mean(n)) for n in arm.sizes])
    ordered = sorted(arms.values(), key=lambda a: a.name != REFERENCE)
    return ordered


def _reference_line(reference: Arm) -> list[tuple[float, float]]:
    """``reference``'s measured points in log-log, ``(log N, log L)``, by size."""
    return [(math.log(n), math.log(reference.mean(n))) for n in sorted(reference.sizes)]


def _reference_at(reference: Arm, x: float) -> float:
    """``reference``'s log loss at log size ``x``: its straight lines between its measured
    points, beyond them its fitted slope through the end point."""
    line = _reference_line(reference)
    (x0, y0), (x1, y1) = line[0], line[-1]
    if x <= x0:
        return y0 + reference.fit.slope * (x - x0)
    if x >= x1:
        return y1 + reference.fit.slope * (x - x1)
    for (xa, ya), (xb, yb) in zip(line, line[1:]):
        if xa <= x <= xb:
            return ya + (yb - ya) * (x - xa) / (xb - xa)
    return y1  # not reached: x lies within the line


def _falling_pieces(reference: Arm) -> list[tuple[float, float, float, float, float]]:
    """Where ``reference``'s loss falls with size, as ``(x_lo, x_hi, x_a, y_a, slope)``
    lines in log-log (``y = y_a + slope * (x - x_a)`` for ``x_lo <= x <= x_hi``): each
    segment between two measured sizes whose loss decreases, and, where the fit falls
    (alpha > 0), its slope continued below the smallest size if the first segment falls
    and above the largest if the last one does."""
    line = _reference_line(reference)
    pieces = [(xa, xb, xa, ya, (yb - ya) / (xb - xa))
              for (xa, ya), (xb, yb) in zip(line, line[1:]) if yb < ya]
    slope = reference.fit.slope
    if slope < 0 and line[1][1] < line[0][1]:
        pieces.insert(0, (-math.inf, line[0][0], *line[0], slope))
    if slope < 0 and line[-1][1] < line[-2][1]:
        pieces.append((line[-1][0], math.inf, *line[-1], slope))
    return pieces


def _size_multiple(reference: Arm, arm: Arm, n: int) -> tuple[Optional[dict], Optional[str]]:
    """``size_multiple`` and, where it gives none for a loss ``arm`` has, why (None
    where a note on the fits says it already)."""
    loss = arm.mean(n)
    if loss is None:
        return None, None
    if reference.fit is None:
        return None, (f"{arm.name} at {_size(n)}: {reference.name} has fewer than two sizes, "
                      "so no size multiple is given")
    if reference.fit.alpha <= 0 or (arm.fit is not None and arm.fit.alpha <= 0):
        return None, None  # the note that the loss does not fall with size says it
    x, y = math.log(n), math.log(loss)
    y_ref = _reference_at(reference, x)
    lo, hi = math.log(min(reference.sizes)), math.log(max(reference.sizes))
    if y == y_ref:
        return {"multiple": 1.0, "needed": float(n), "extrapolated": not lo <= x <= hi}, None
    worse = y > y_ref
    found = []
    for x_lo, x_hi, x_a, y_a, slope in _falling_pieces(reference):
        at = x_a + (y - y_a) / slope
        tol = 1e-12 * max(1.0, abs(at))
        if x_lo - tol <= at <= x_hi + tol:
            at = min(max(at, x_lo), x_hi)
            if (at < x) if worse else (at > x):
                found.append(at)
    if not found:
        side = "below" if worse else "above"
        return None, (f"{arm.name} at {_size(n)}: its loss {loss:.4f} "
                      f"({'higher' if worse else 'lower'} than {reference.name}'s "
                      f"{math.exp(y_ref):.4f} there) is not reached where {reference.name}'s "
                      f"loss falls with size {side} that size, so no size multiple is given")
    at = min(found)  # the smallest size at which the reference's falling part reaches it
    if at > LOG_MAX:
        return None, (f"{arm.name} at {_size(n)}: its loss {loss:.4f} is reached where "
                      f"{reference.name}'s loss falls with size only at more parameters than "
                      "a float holds, so no size multiple is given")
    tol = 1e-12 * max(1.0, abs(at))
    needed = math.exp(at)
    return {"multiple": needed / n, "needed": needed,
            "extrapolated": not lo - tol <= at <= hi + tol}, None


def size_multiple(reference: Arm, arm: Arm, n: int) -> Optional[dict]:
    """The parameters ``reference`` needs for ``arm``'s loss at size ``n``, as a
    multiple of ``n``, read only where ``reference``'s loss falls with size:

    - between its measured sizes, on the straight lines (log-log) of the segments
      whose loss decreases (as ``kvtrain compare`` reads tokens on a curve); beyond
      them (``extrapolated``), on its fitted slope through its end point, and only
      where its end segment falls too;
    - on the side of ``n`` that the losses say: below ``n`` where ``arm`` is worse
      than ``reference`` at ``n`` (a multiple < 1), above it where better (> 1); the
      smallest such size where several are;
    - none (None) where that falling part does not reach the loss, and none at all
      where ``reference``'s or ``arm``'s fit does not fall with size (alpha <= 0,
      said in the notes), or ``reference`` has fewer than two sizes.

    ``reference``'s loss at a size it was not measured at is its lines between its
    points, its fitted slope through its end points beyond them."""
    return _size_multiple(reference, arm, n)[0]


def _size(n: float) -> str:
    from kvtrain.plan.params import human

    return human(n)


def setting_notes(runs: Sequence[RunData]) -> list[str]:
    """A line per run whose settings differ from the first run's beyond its size,
    attention and seeds (compare's settings, without those keys)."""
    def settings(run: RunData) -> dict:
        return {k: v for k, v in _settings(run.config, False).items()
                if not k.startswith(SIZE_KEYS + REPLICATE_KEYS + ("model.kv_shift",))}

    first, notes = settings(runs[0]), []
    for run in runs[1:]:
        mine = settings(run)
        diffs = [f"{k}: {first.get(k)} -> {mine.get(k)}" for k in sorted(set(first) | set(mine))
                 if first.get(k) != mine.get(k)]
        if diffs:
            notes.append(f"{run.label} differs from {runs[0].label} beyond its size and "
                         f"attention: {'; '.join(diffs[:4])}"
                         + (f"; and {len(diffs) - 4} more" if len(diffs) > 4 else ""))
    return notes


def summarize(runs: Sequence[RunData], valid_set: Optional[str] = None) -> dict:
    """Everything ``scaling.md`` says, as JSON-able data."""
    points = [point(r, valid_set) for r in runs]
    arms = arms_of(points)
    notes = setting_notes(runs) + [f"{r.label}: {n}" for r in runs for n in r.notes]
    notes += [f"{p.label}: {p.left_out or 'no finite validation loss'} (left out)"
              for p in points if p.loss is None]
    notes += [f"{a.name}: the loss does not fall with size (alpha {a.fit.alpha:.4f}): these runs "
              "are limited by their tokens or steps, not their parameters (the law holds "
              "where the tokens far exceed the parameters), so no size multiple is given"
              for a in arms if a.fit is not None and a.fit.alpha <= 0]
    reference = arms[0]
    out_arms = []
    for arm in arms:
        fit = arm.fit
        entry = {"arm": arm.name, "sizes": {str(n): {"loss": arm.mean(n), "runs": len(v)}
                                            for n, v in sorted(arm.sizes.items())},
                 "fit": None if fit is None else {
                     "alpha": fit.alpha, "n_c": fit.n_c, "r2": fit.r2, "sizes": fit.points,
                     "slope": fit.slope, "intercept": fit.intercept}}
        if arm is not reference:
            entry["vs_reference"] = {}
            for n in sorted(arm.sizes):
                entry["vs_reference"][str(n)], why = _size_multiple(reference, arm, n)
                notes += [why] if why else []
        out_arms.append(entry)
    return {"valid_set": valid_set, "reference": reference.name,
            "runs": [vars(p) for p in points], "arms": out_arms, "notes": notes}


def _loss(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def _multiple(entry: Optional[dict]) -> str:
    if not entry:
        return "-"
    return f"{entry['multiple']:.2f}x" + (" (extrapolated)" if entry["extrapolated"] else "")


def report_lines(summary: dict) -> list[str]:
    """Markdown: the loss at each size per arm, B - A, the reference's size multiple,
    and each arm's fitted law."""
    from kvtrain.plan.params import human

    arms, ref = summary["arms"], summary["arms"][0]
    sizes = sorted({int(n) for a in arms for n in a["sizes"]})
    others = arms[1:]
    head = ["non-embedding params", *(a["arm"] for a in arms)]
    for a in others:
        head += [f"{a['arm']} - {ref['arm']}", f"{ref['arm']} params for {a['arm']}'s loss"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for n in sizes:
        row = [human(n)]
        row += [_loss((a["sizes"].get(str(n)) or {}).get("loss")) for a in arms]
        for a in others:
            mine = (a["sizes"].get(str(n)) or {}).get("loss")
            theirs = (ref["sizes"].get(str(n)) or {}).get("loss")
            row += ["-" if mine is None or theirs is None else f"{mine - theirs:+.4f}",
                    _multiple(a["vs_reference"].get(str(n)))]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Fitted `L(N) = (N_c / N) ** alpha` (least squares in log-log):", ""]
    for a in arms:
        fit = a["fit"]
        if fit is None:
            lines.append(f"- {a['arm']}: fewer than two sizes, no fit")
            continue
        n_c = "-" if fit["n_c"] is None else f"{fit['n_c']:.3g}"
        r2 = "" if fit["r2"] is None else f", R^2 {fit['r2']:.4f}"
        lines.append(f"- {a['arm']}: alpha {fit['alpha']:.4f}, N_c {n_c} "
                     f"({fit['sizes']} sizes{r2})")
    return lines


def plot(summary: dict, path: Path) -> None:
    """Loss against non-embedding parameters (log-log): each arm's points and fit."""
    from .plots import _legend, _pyplot, _save

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for i, a in enumerate(summary["arms"]):
        points = [(int(n), s["loss"]) for n, s in a["sizes"].items() if s["loss"] is not None]
        ax.plot([n for n, _ in points], [v for _, v in points], "o", color=f"C{i}",
                label=a["arm"])
        fit = a["fit"]
        if fit is not None:
            lo, hi = min(n for n, _ in points), max(n for n, _ in points)
            xs = [lo * (hi / lo) ** (k / 40) for k in range(41)]
            ax.plot(xs, [math.exp(fit["intercept"] + fit["slope"] * math.log(x)) for x in xs],
                    "-", color=f"C{i}", lw=1.2, alpha=0.8,
                    label=f"{a['arm']} fit: alpha {fit['alpha']:.3f}")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    as_number = FuncFormatter(lambda v, _: f"{v:.3g}")  # losses, not powers of ten
    ax.yaxis.set_major_formatter(as_number)
    ax.yaxis.set_minor_formatter(as_number)
    ax.set_xlabel("non-embedding parameters")
    ax.set_ylabel("validation loss" + (f" ({summary['valid_set']})" if summary["valid_set"]
                                       else ""))
    ax.set_title("scaling: loss against model size")
    ax.grid(alpha=0.3, which="both")
    _legend(ax, fontsize=8)
    _save(fig, path)
    plt.close(fig)


def report_markdown(summary: dict, title: str = "kvtrain scaling") -> str:
    what = f"validation set `{summary['valid_set']}`" if summary["valid_set"] else "validation"
    lines = [f"# {title}", "", f"Final {what} loss of each run against its non-embedding "
             "parameters (runs of one arm and size: their mean), as the paper's Figure 6a.", ""]
    lines += report_lines(summary)
    if summary["notes"]:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in summary["notes"]]
    return "\n".join(lines + ["", "![scaling](scaling.png)", ""])


def write_scaling(summary: dict, out: Path, title: str = "kvtrain scaling") -> None:
    """Writes ``scaling.md``, ``scaling.json`` and ``scaling.png`` into ``out``."""
    from kvtrain.output import write_whole

    plot(summary, out / "scaling.png")
    write_whole(out / "scaling.md", report_markdown(summary, title))
    write_whole(out / "scaling.json", json.dumps(summary, indent=1) + "\n")


def run_folders(paths: Sequence[str | Path]) -> list[Path]:
    """The run folders given: a folder of ``kvtrain sweep`` or ``kvtrain experiment``
    (``arms/*/run``) stands for its cells' runs."""
    out: list[Path] = []
    for given in paths:
        path = Path(given).expanduser()
        cells = sorted(path.glob("arms/*/run")) if path.is_dir() else []
        out += [c for c in cells if (c / "metrics.jsonl").is_file()] if cells else [path]
    return out


def _default_out(paths: Sequence[str | Path], folders: list[Path]) -> Path:
    """``scaling/`` in the runs' common parent; for one sweep folder, in it (not its arms/)."""
    if len(paths) == 1 and Path(paths[0]).resolve() not in [f.resolve() for f in folders]:
        return Path(paths[0]) / "scaling"
    return _common_parent(folders) / "scaling"


def scaling(paths: Sequence[str | Path], out: Optional[str | Path] = None,
            valid_set: Optional[str] = None) -> tuple[dict, str]:
    """Reads the runs and writes the report into ``out`` (default:
    :func:`_default_out`); returns (summary, printed text)."""
    folders = run_folders(paths)
    for path in folders:  # named first: one missing path is not "two runs needed"
        checked_folder(path)
    if len(folders) < 2:
        raise ConfigError("kvtrain scaling needs at least two runs (models of different sizes)")
    runs = [read_run(p, label) for p, label in zip(folders, unique_labels(folders))]
    summary = summarize(runs, valid_set)
    if all(a["fit"] is None for a in summary["arms"]):
        sizes = sorted({p["non_embedding"] for p in summary["runs"]})
        left = "; ".join(f"{p['label']} ({p['left_out']})" for p in summary["runs"]
                         if p["left_out"])
        raise ConfigError(f"kvtrain scaling: no arm has runs of two model sizes with a "
                          f"validation loss (sizes: {', '.join(map(str, sizes))} non-embedding "
                          "parameters): a fit needs two" + (f"; left out: {left}" if left else ""))
    target = Path(out) if out else _default_out(paths, folders)
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {target}: cannot create it ({e.strerror})") from None
    write_scaling(summary, target)
    text = "\n".join(report_lines(summary) + [f"- note: {n}" for n in summary["notes"]]
                     + [f"wrote {target}/scaling.md, scaling.json, scaling.png"])
    return summary, text


__all__ = ["Fit", "Point", "arm_name", "fit_power_law", "model_params", "run_folders", "size_of",
           "scaling", "size_multiple", "summarize", "write_scaling"]
