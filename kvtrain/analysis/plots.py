"""The PNGs of ``kvtrain compare`` (matplotlib, Agg backend; written atomically)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from kvtrain.config import ConfigError

from .runs import Curve, RunData

LOSS = "loss.png"
DIFFERENCE = "loss_difference.png"
COEFFICIENTS = "kv_shift_coefficients.png"
VALID_SETS = "valid_sets.png"
POSITIONS = "loss_by_position.png"


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("kvtrain compare draws with matplotlib, which is not installed: "
                          "pip install -e '.[dev]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    from kvtrain.output import written_whole

    fig.tight_layout()
    with written_whole(path, "wb") as f:
        fig.savefig(f, format="png", dpi=110)


def _legend(ax, **kwargs) -> None:
    """The axes' legend, where it has labelled lines (an empty one is a matplotlib
    warning on the user's terminal)."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (train losses are per-step noisy)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _window(curve: Curve) -> int:
    return max(1, len(curve) // 20)


def plot_losses(plt, runs: Sequence[RunData], path: Path) -> None:
    """Train (thin) and validation (markers) loss against tokens, one color per run."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, run in enumerate(runs):
        color = f"C{i}"
        ax.plot(run.train.tokens, run.train.loss, color=color, lw=0.8, alpha=0.45,
                label=f"{run.label} train")
        if run.valid:
            ax.plot(run.valid.tokens, run.valid.loss, "-o", color=color, ms=3.5, lw=1.6,
                    label=f"{run.label} validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss")
    ax.set_title("loss against tokens")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    _save(fig, path)
    plt.close(fig)


def plot_differences(plt, runs: Sequence[RunData], path: Path) -> None:
    """B - A against tokens: validation (markers) and smoothed train loss."""
    from .compare import difference

    a = runs[0]
    fig, ax = plt.subplots(figsize=(7.5, 4.0))
    ax.axhline(0.0, color="grey", lw=0.8)
    for i, run in enumerate(runs[1:], start=1):
        color = f"C{i}"
        train = difference(a.train, run.train)
        if train:
            window = _window(train)
            ax.plot(train.tokens, smooth(train.loss, window), color=color, lw=1.0, alpha=0.6,
                    label=f"{run.label} - {a.label}, train"
                          + (f" (moving mean of {window} logs)" if window > 1 else ""))
        valid = difference(a.valid, run.valid)
        if valid:
            ax.plot(valid.tokens, valid.loss, "-o", color=color, ms=3.5,
                    label=f"{run.label} - {a.label}, validation")
    ax.set_xlabel("tokens")
    ax.set_ylabel("loss difference (below 0: better than A)")
    ax.set_title(f"loss difference against {a.label}")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)
    _save(fig, path)
    plt.close(fig)


def _panels(plt, count: int):
    """A figure of ``count`` panels, up to 3 a row; the panels in order, the grid's
    empty cells hidden."""
    cols = min(count, 3)
    rows = -(-count // cols)
    fig, axes = plt.subplots(rows, cols, squeeze=False, figsize=(4.6 * cols, 3.4 * rows))
    cells = [ax for row in axes for ax in row]
    for ax in cells[count:]:
        ax.axis("off")
    return fig, cells[:count]


def _close_panel(ax, title: str, xlabel: str) -> None:
    ax.set_title(title, fontsize=9)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    _legend(ax, fontsize=8)


def plot_valid_sets(plt, runs: Sequence[RunData], names: list[str], path: Path) -> None:
    """One panel per named validation set: each run's curve on it against tokens."""
    fig, panels = _panels(plt, len(names))
    for ax, name in zip(panels, names):
        for n, run in enumerate(runs):
            curve = run.valid_sets.get(name)
            if curve:
                ax.plot(curve.tokens, curve.loss, "-o", color=f"C{n}", ms=3.5, lw=1.4,
                        label=run.label)
        _close_panel(ax, f"validation set {name}", "tokens")
    _save(fig, path)
    plt.close(fig)


def _latest_positions(run: RunData) -> dict[str, dict]:
    """Each task's ``by_position`` of the run's latest checkpoint scored
    (``kvtrain perplexity --by-position``)."""
    latest: dict[str, dict] = {}
    for entry in run.evals:
        if "by_position" in entry:
            held = latest.get(entry["task"])
            if held is None or (entry["iteration"] or 0) >= (held["iteration"] or 0):
                latest[entry["task"]] = entry
    return latest


def plot_positions(plt, runs: Sequence[RunData], path: Path) -> bool:
    """One panel per scored task: each run's loss against tokens of context (log
    scale; token-weighted means over 1, 2-3, 4-7, ...). False when no run has any."""
    from .positions import binned

    latest = [_latest_positions(run) for run in runs]
    tasks = sorted({task for held in latest for task in held})
    if not tasks:
        return False
    fig, panels = _panels(plt, len(tasks))
    for ax, task in zip(panels, tasks):
        context = "sequence"
        for n, (run, held) in enumerate(zip(runs, latest)):
            if task not in held:
                continue
            by = held[task]["by_position"]
            context = by.get("context", context)
            points = [(a, m) for a, _, m in binned(by["loss"], by["tokens"]) if m is not None]
            ax.plot([a for a, _ in points], [m for _, m in points], "-o", color=f"C{n}",
                    ms=3.5, lw=1.4, label=f"{run.label} (iter {held[task]['iteration']})")
        ax.set_xscale("log", base=2)
        _close_panel(ax, task, f"tokens of context (in the {context})")
    _save(fig, path)
    plt.close(fig)
    return True


def _head_values(summary: dict, greek: str, index: int) -> dict[int, list[float]]:
    """{layer: values of coefficient ``index`` over the layer's heads}, or the
    layer means when the record has no per-head values."""
    out: dict[int, list[float]] = {}
    if summary.get("heads"):
        for layer, tensors in summary["heads"].items():
            rows = tensors.get(greek) or []
            values = [row[index] for row in rows if len(row) > index]
            if values:
                out[int(layer)] = values
        return out
    for layer, means in summary["layer_means"].items():
        if f"{greek}{index + 1}" in means:
            out[int(layer)] = [means[f"{greek}{index + 1}"]]
    return out


def plot_coefficients(plt, runs: Sequence[tuple[RunData, dict]], path: Path) -> None:
    """Per layer, every KV head's coefficients (α: K, β: V; 1 = current token,
    2 = previous, ...), one row of panels per KV-shift run."""
    greeks = ["alpha", "beta", "gamma"]
    present = [g for g in greeks if any(_head_values(s, g, 0) for _, s in runs)]
    fig, axes = plt.subplots(len(runs), len(present), squeeze=False,
                             figsize=(4.2 * len(present), 3.4 * len(runs)))
    for row, (run, summary) in enumerate(runs):
        for col, greek in enumerate(present):
            ax = axes[row][col]
            for index in range(4):
                values = _head_values(summary, greek, index)
                if not values:
                    break
                offset = (index - 0.5) * 0.18
                name = f"{greek}{index + 1} " + ("(token t)" if index == 0 else f"(token t-{index})")
                for layer, vs in values.items():
                    ax.scatter([layer + offset] * len(vs), vs, s=14, color=f"C{index}",
                               alpha=0.7, label=name if layer == min(values) else None)
            ax.axhline(0.0, color="grey", lw=0.6)
            ax.set_xticks(sorted(int(layer) for layer in summary["layer_means"]))
            ax.set_xlabel("layer (one point per KV head)")
            ax.set_title(f"{run.label}: {greek} (iteration {summary['iteration']})", fontsize=9)
            ax.grid(alpha=0.3)
            _legend(ax, fontsize=7)
    _save(fig, path)
    plt.close(fig)


def write_plots(runs: Sequence[RunData], out: Path) -> dict[str, str]:
    """Draws the PNGs into ``out``; returns {title: file name} of those drawn."""
    from .compare import shift_summary

    plt = _pyplot()
    plots = {}
    plot_losses(plt, runs, out / LOSS)
    plots["Loss against tokens"] = LOSS
    plot_differences(plt, runs, out / DIFFERENCE)
    plots[f"Difference against {runs[0].label}"] = DIFFERENCE
    names = sorted({name for r in runs for name, curve in r.valid_sets.items() if curve})
    if names:
        plot_valid_sets(plt, runs, names, out / VALID_SETS)
        plots["Validation sets (data.valid_sets)"] = VALID_SETS
    if plot_positions(plt, runs, out / POSITIONS):
        plots["Loss by position in the context (kvtrain perplexity --by-position)"] = POSITIONS
    shifted = [(r, shift_summary(r)) for r in runs if r.shift]
    shifted = [(r, s) for r, s in shifted if s and (s["heads"] or s["layer_means"])]
    if shifted:
        plot_coefficients(plt, shifted, out / COEFFICIENTS)
        plots["KV shift coefficients per layer"] = COEFFICIENTS
    return plots


__all__ = ["write_plots", "smooth"]
