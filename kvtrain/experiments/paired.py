"""Arms against a reference across a sweep's settings and seeds (the paper's Figure 4).

Figure 4a trains vanilla and KV shift at five seeds (each pair with the same
initialisation and data) and finds KV shift lower under every seed; Figure 4b
repeats the pair at four learning rates. In a sweep whose grid holds the arms' key
(``model.attention``) this is a table: for each setting of the other keys, each
arm's final validation loss (over the replicate key, ``train.seed``: mean ± sd of
the seeds), the difference to the reference arm (the key's first value) paired
seed by seed, and in how many pairs the arm is lower, with the sign test's
two-sided p-value over all pairs (no assumption on the losses' distribution).
``sweep_curves.png`` draws the runs' curves, a panel per setting, an arm a color.
``analyse`` adds these to a sweep's report, and ``kvtrain scaling``'s where the
cells' model sizes differ.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError

from .sweep import NONFINITE_EXIT, Axis

ARMS = "model.attention"  # the key whose values are the arms, by default
REPLICATES = "train.seed"  # the key whose values are replicates, by default


def roles(axes: list[Axis], arms: Optional[str], replicates: Optional[str]
          ) -> tuple[Optional[Axis], Optional[Axis]]:
    """The arm and replicate axes of a grid: the keys given (``--arms``,
    ``--replicates``; refused when not in the grid), else the defaults where present."""
    by_key = {a.key: a for a in axes}
    found = []
    for given, default, flag in ((arms, ARMS, "--arms"), (replicates, REPLICATES, "--replicates")):
        if given is not None and given not in by_key:
            raise ConfigError(f"{flag} {given}: not a --grid key ({', '.join(by_key)})")
        found.append(by_key.get(given or default))
    arm, rep = found
    if arm is not None and rep is not None and arm.key == rep.key:
        raise ConfigError(f"--arms and --replicates are one key ({arm.key})")
    if arm is not None and len(arm.texts) < 2:
        arm = None  # one arm: nothing to pair
    return arm, rep


def _stats(values: list[float]) -> dict:
    n = len(values)
    mean = sum(values) / n if n else None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else None
    return {"mean": mean, "sd": sd, "n": n}


def sign_test(lower: int, pairs: int) -> Optional[float]:
    """Two-sided p-value of ``lower`` of ``pairs`` under no difference (p = 1/2);
    ``pairs``: the untied ones."""
    if pairs == 0:
        return None
    k = min(lower, pairs - lower)
    tail = sum(math.comb(pairs, i) for i in range(k + 1)) / 2 ** pairs
    return min(1.0, 2 * tail)


def paired(axes: list[Axis], entries: list[dict], arm: Axis,
           rep: Optional[Axis]) -> dict:
    """Each setting of the other axes: every arm's loss over the replicates and each
    arm's differences to the reference (``arm.texts[0]``), paired by replicate."""
    others = [a for a in axes if a.key not in (arm.key, rep.key if rep else None)]
    index = {a.key: i for i, a in enumerate(axes)}
    losses: dict[tuple, float] = {}  # (setting, arm, replicate) -> finite final loss
    # a cell stopped short (diverged, crashed, stopped) has no final loss: its last
    # validation's, taken steps before, would pass for one (a diverged vanilla's loss
    # of step 40 in the arm's mean and pairs), so it is named instead
    left_out = [e for e in entries if not e.get("finished", True)]
    for e in entries:
        loss = e.get("val_loss")
        if loss is not None and math.isfinite(loss) and e.get("finished", True):
            texts = e["texts"]
            setting = tuple(texts[index[a.key]] for a in others)
            losses[(setting, texts[index[arm.key]],
                    texts[index[rep.key]] if rep else None)] = loss
    reps = rep.texts if rep else (None,)
    ref, rows, lower, pairs, ties = arm.texts[0], [], {}, {}, {}
    for setting in itertools.product(*(a.texts for a in others)):
        row = {"setting": dict(zip((a.key for a in others), setting)), "arms": {}, "diffs": {}}
        for name in arm.texts:
            row["arms"][name] = _stats([losses[(setting, name, r)] for r in reps
                                        if (setting, name, r) in losses])
        for name in arm.texts[1:]:
            diffs = [losses[(setting, name, r)] - losses[(setting, ref, r)] for r in reps
                     if (setting, name, r) in losses and (setting, ref, r) in losses]
            row["diffs"][name] = {**_stats(diffs), "lower": sum(d < 0 for d in diffs)}
            lower[name] = lower.get(name, 0) + row["diffs"][name]["lower"]
            pairs[name] = pairs.get(name, 0) + len(diffs)
            ties[name] = ties.get(name, 0) + sum(d == 0 for d in diffs)
        rows.append(row)
    # a tie (bit-identical runs: an arm key that changes nothing) is neither lower nor
    # higher: the sign test drops it; counted as "not lower", identical arms read as
    # one significantly worse (6 ties: p = 0.03)
    overall = {name: {"lower": lower[name], "pairs": pairs[name], "ties": ties[name],
                      "sign_test_p": sign_test(lower[name], pairs[name] - ties[name])}
               for name in arm.texts[1:]}
    return {"arms_key": arm.key, "replicates_key": rep.key if rep else None,
            "reference": ref, "rows": rows, "overall": overall,
            "left_out": [{"cell": e["cell"], "step": e.get("step"),
                          "exit_code": e.get("exit_code")} for e in left_out]}


def _stopped(cell: dict) -> str:
    """``seed=3 (stopped at step 40: non-finite losses)``: a cell left out (a sweep
    entry, or ``paired``'s record of one)."""
    step, code = cell.get("step"), cell.get("exit_code")
    at = f"at step {step}" if step is not None else "before any validation"
    if code == NONFINITE_EXIT:
        why = f"stopped {at}: non-finite losses"
    elif code not in (0, None):
        why = f"exit code {code} {at}"
    else:
        why = f"stopped {at}, unfinished"
    return f"{cell['cell']} ({why})"


def _value(stats: dict, signed: bool = False) -> str:
    if not stats["n"]:
        return "-"
    text = f"{stats['mean']:+.4f}" if signed else f"{stats['mean']:.4f}"
    if stats["sd"] is not None:
        text += f" ± {stats['sd']:.4f}"
    return text + (f" ({stats['n']})" if stats["n"] > 1 else "")


def paired_lines(summary: dict) -> list[str]:
    """Markdown: the table and a line per arm over all pairs."""
    ref, rows = summary["reference"], summary["rows"]
    setting_keys = list(rows[0]["setting"]) if rows else []
    names = list(rows[0]["arms"]) if rows else []
    over = f", over {summary['replicates_key']} (mean ± sd (runs))" \
        if summary["replicates_key"] else ""
    head = [*setting_keys, *names]
    for name in names[1:]:
        head += [f"{name} - {ref}", f"{name} lower"]
    lines = [f"## {' vs '.join(names)} ({summary['arms_key']}){over}", "",
             "| " + " | ".join(head or ["-"]) + " |", "|" + "---|" * len(setting_keys)
             + "---:|" * (len(head) - len(setting_keys))]
    for row in rows:
        cells = [str(v) for v in row["setting"].values()]
        cells += [_value(row["arms"][n]) for n in names]
        for name in names[1:]:
            d = row["diffs"][name]
            cells += [_value(d, signed=True), f"{d['lower']}/{d['n']}" if d["n"] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, o in summary["overall"].items():
        tied = o.get("ties", 0)
        over = f" over the {o['pairs'] - tied} untied" if tied else ""
        p = "" if o["sign_test_p"] is None else \
            f" (sign test{over}, two-sided: p = {o['sign_test_p']:.3g})"
        lines.append(f"{name} is lower than {ref} in {o['lower']} of {o['pairs']} pairs"
                     + (f", {tied} tied" if tied else "") + f"{p}.")
    if summary.get("left_out"):
        lines.append("Left out (no final loss): "
                     + ", ".join(map(_stopped, summary["left_out"])) + ".")
    return lines


MAX_PANELS = 12  # sweep_curves.png: settings beyond this are not drawn (said in sweep.md)


def _panel_axes(axes: list[Axis], arm: Optional[Axis], rep: Optional[Axis]
                ) -> tuple[Axis, list[Axis]]:
    """The axis of the curves' colors (the arms', else the last) and those of the panels."""
    color_axis = arm or axes[-1]
    return color_axis, [a for a in axes
                        if a.key not in (color_axis.key, rep.key if rep else None)]


def cell_runs(entries: list[dict], run_dirs: dict[str, Path]) -> dict:
    """{cell: RunData} of the cells whose runs have train records (read once, for the
    curves and the scaling)."""
    from kvtrain.analysis.runs import read_run

    runs = {}
    for e in entries:
        folder = run_dirs.get(e["cell"])
        if folder is not None and (folder / "metrics.jsonl").is_file():
            try:
                runs[e["cell"]] = read_run(folder, e["cell"])
            except ConfigError:
                continue  # no train records yet
    return runs


def plot_curves(axes: list[Axis], entries: list[dict], runs: dict, arm: Optional[Axis],
                rep: Optional[Axis], path: Path) -> None:
    """``sweep_curves.png``: a panel per setting of the axes but the arms' and the
    replicates', each run's train loss (thin, smoothed) and validation (markers)
    against tokens, one color per arm (per value of the last axis without arms);
    ``runs``: ``cell_runs``."""
    from kvtrain.analysis.plots import _close_panel, _panels, _pyplot, _save, _window, smooth

    color_axis, panel_axes = _panel_axes(axes, arm, rep)
    settings = list(itertools.product(*(a.texts for a in panel_axes)))
    index = {a.key: i for i, a in enumerate(axes)}
    runs = {e["cell"]: (e, runs[e["cell"]]) for e in entries if e["cell"] in runs}
    plt = _pyplot()
    fig, panels = _panels(plt, len(settings))
    for ax, setting in zip(panels, settings):
        labelled = set()
        for e, run in runs.values():
            texts = e["texts"]
            if tuple(texts[index[a.key]] for a in panel_axes) != setting:
                continue
            name = texts[index[color_axis.key]]
            color = f"C{color_axis.texts.index(name)}"
            label = None if name in labelled else name
            labelled.add(name)
            ax.plot(run.train.tokens, smooth(run.train.loss, _window(run.train)), color=color,
                    lw=0.8, alpha=0.5, label=label)
            if run.valid:
                ax.plot(run.valid.tokens, run.valid.loss, "o", color=color, ms=3)
        title = ", ".join(f"{a.short}={t}" for a, t in zip(panel_axes, setting)) or "all cells"
        if rep is not None:
            title += f" ({len(rep.texts)} {rep.short}s)"
        _close_panel(ax, title, "tokens")
    _save(fig, path)
    plt.close(fig)


def analyse(axes: list[Axis], done: list[dict], run_dirs: dict[str, Path], run_dir: Path,
            arms: Optional[str] = None, replicates: Optional[str] = None
            ) -> tuple[list[str], dict]:
    """What sweep.md adds below its tables, and sweep.json beside its cells: the arms
    pair by pair (the grid has the arms' key), their curves, and the loss against
    model size where the cells' sizes differ (``scaling.md``); ``done``: the cells'
    ``sweep.entries``, ``run_dirs``: each cell's run folder."""
    from kvtrain.analysis.scaling import report_lines as scaling_lines
    from kvtrain.analysis.scaling import summarize as scaling_summary
    from kvtrain.analysis.scaling import write_scaling

    arm, rep = roles(axes, arms, replicates)
    lines, out, files = [], {}, []
    if arm is not None:
        out["paired"] = paired(axes, done, arm, rep)
        lines += paired_lines(out["paired"]) + [""]
    runs = cell_runs(done, run_dirs)
    panels = math.prod(len(a.texts) for a in _panel_axes(axes, arm, rep)[1])
    if runs and panels > MAX_PANELS:
        lines += [f"(sweep_curves.png not drawn: {panels} settings, more than {MAX_PANELS} "
                  "panels; `kvtrain compare` draws any cells' curves)", ""]
    elif runs:
        plot_curves(axes, done, runs, arm, rep, run_dir / "sweep_curves.png")
        files.append("sweep_curves.png")
        lines += ["![curves](sweep_curves.png)", ""]
    # as in the pairs: a cell stopped short has no final loss to fit
    stopped = [e for e in done if not e.get("finished", True) and e["cell"] in runs]
    sized = [runs[e["cell"]] for e in done if e["cell"] in runs and e not in stopped]
    if len({e["params"] for e in done}) > 1 and len(sized) > 1:
        summary = scaling_summary(sized)
        if stopped:
            summary["notes"].append(
                "left out of the fit (stopped short of their steps: no final loss): "
                + ", ".join(map(_stopped, stopped)))
        write_scaling(summary, run_dir, title="kvtrain sweep: scaling")
        out["scaling"] = summary
        files += ["scaling.md", "scaling.png"]
        lines += ["## Loss against model size ([scaling.md](scaling.md))", "",
                  *scaling_lines(summary), *(f"- note: {n}" for n in summary["notes"]),
                  "", "![scaling](scaling.png)", ""]
    if files:
        out["files"] = files
    return lines, out


__all__ = ["ARMS", "MAX_PANELS", "REPLICATES", "analyse", "cell_runs", "paired", "paired_lines",
           "plot_curves", "roles", "sign_test"]
