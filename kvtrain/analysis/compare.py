"""``kvtrain compare``: runs side by side, the paper's way (vanilla vs KV shift).

The first run is the reference A; every other run B is compared with it:

* final train / validation loss and their difference B - A;
* "tokens for B to reach A's final validation loss": the first point where B's
  validation curve (linear between evaluations) gets down to A's last
  validation loss, and the speed-up = A's tokens / B's tokens (A's own first
  point at that loss: A's last unless its curve touched it before; "not reached"
  when B's curve never gets there);
* for KV-shift runs, the paper's Table 5 quadrant counts (α1 vs α2 against
  β1 vs β2 over all KV heads) and the coefficients per layer, from the latest
  ``kv_shift`` statistics record;
* each named validation set (``data.valid_sets``: records with ``set: NAME``)
  the same way: final loss, B - A and the tokens for B to reach A on it, for every
  set the runs share;
* evaluation results (``RUN/eval/*.json``) when present, one row per task and
  setting (checkpoint iteration, shots, limit, dtype): only results of one setting
  are compared.

Output: ``DIR/report.md`` with ``loss.png``, ``loss_difference.png``,
``valid_sets.png`` (runs with named validation sets) and ``kv_shift_coefficients.png``, ``DIR/summary.json``, and a printed summary.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from statistics import NormalDist
from typing import Optional, Sequence

from kvtrain.config import ConfigError
from kvtrain.config.compat import IGNORED  # the kernels and padding: how a model runs

from .runs import EVAL_KEY, Curve, RunData, eval_key, interpolate, key_order, read_run, \
    unique_labels

QUADRANTS = ("a1>a2,b1>b2", "a1<=a2,b1>b2", "a1>a2,b1<=b2", "a1<=a2,b1<=b2")


def tokens_to_reach(curve: Curve, target: float) -> Optional[float]:
    """Tokens at which ``curve`` first gets down to ``target`` (linear between
    points; None if it never does)."""
    pts = list(zip(curve.tokens, curve.loss))
    for i, (tokens, loss) in enumerate(pts):
        if loss <= target:
            if i == 0:
                return tokens
            t0, l0 = pts[i - 1]
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
    return None


def speedup(a: RunData, b: RunData) -> dict:
    """B against A on the validation curves."""
    return curve_speedup(a.valid, b.valid)


def curve_speedup(a: Curve, b: Curve) -> dict:
    """B against A on one validation curve (the run's, or a named set's)."""
    out = {"target_loss": a.final, "a_tokens": None, "b_tokens": None, "speedup": None,
           "speedup_at_least": False,
           "a_not_finite_from": None if a else next(iter(a.nonfinite), None)}
    if not a:
        return out
    # A's tokens by the rule applied to B (first crossing), not A's last point: on
    # a curve that is not monotone a run would otherwise beat a copy of itself
    out["a_tokens"] = tokens_to_reach(a, a.final)
    if not b:
        return out
    reached = tokens_to_reach(b, a.final)
    if reached is not None and reached > 0:
        out.update(b_tokens=reached, speedup=out["a_tokens"] / reached)
        # B already at A's loss at its first validation: it got there unseen, at some
        # point up to it, so the ratio is the least speed-up (runs validated only at
        # their end read 1.00x however much lower B ended); unless A's own crossing is
        # an earlier first point of A's: a bound on both sides, no side to tell
        out["speedup_at_least"] = b.loss[0] <= a.final and (len(a) == 1
                                                            or a.loss[0] > a.final)
    return out


def difference(a: Curve, b: Curve) -> Curve:
    """B - A at A's tokens, where B's curve covers them (B linear in between)."""
    diff = Curve()
    for it, tokens, loss in zip(a.iterations, a.tokens, a.loss):
        other = interpolate(tokens, b.tokens, b.loss)
        if other is not None:
            diff.iterations.append(it)
            diff.tokens.append(tokens)
            diff.loss.append(other - loss)
    return diff


def shift_summary(run: RunData) -> Optional[dict]:
    """Quadrant counts, per-layer means and every head's coefficients of the
    latest kv_shift record (None for a run without one)."""
    rec = run.shift
    if not rec:
        return None
    quadrants = {q: rec.get(f"kv_shift/quadrant/{q}") for q in QUADRANTS}
    means: dict[str, dict[str, float]] = {}
    for key, value in rec.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[1].startswith("layer_") and isinstance(value, (int, float)):
            means.setdefault(parts[1][len("layer_"):], {})[parts[2]] = float(value)
    heads = rec.get("kv_shift/coefficients")
    return {"iteration": rec.get("iteration"), "kv_heads": rec.get("kv_shift/kv_heads"),
            "quadrants": quadrants if all(isinstance(v, int) for v in quadrants.values()) else None,
            "layer_means": dict(sorted(means.items())),
            "heads": heads if isinstance(heads, dict) else None}


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _tokens(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.2f}{unit}"
    return f"{value:.0f}"


# What the comparison holds equal: the model but its attention, the data, the optimizer,
# what sizes the run, and what its curves are over (the sequences a validation scores,
# train.eval_iters: 4 or 8 batches of the same run differed by 0.015, read as a 1.02x
# speed-up; the steps a train record is the mean of, train.log_interval). How a run ran
# (backend, kernels, the vocabulary's padding multiple, layout, workers, the other
# intervals: what a resume need not compare either) changes no loss beyond the last bits.
SETTINGS = ("model", "data", "optimizer", "train.seq_length", "train.global_batch_size",
            "train.seed", "train.precision", "train.train_tokens", "train.max_steps",
            "train.eval_iters", "train.log_interval")
HOW_IT_RAN = ("model.attention", *IGNORED, "data.num_workers", "data.cache_dir")


def _settings(config: dict, shifted: bool) -> dict:
    """The ``SETTINGS`` of a run's config.yaml, flattened (``model.kv_shift`` only
    when both runs shift: a vanilla run's shift section is unused)."""
    flat: dict = {}

    def walk(node, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{key}.{k}")
        elif not key.startswith(HOW_IT_RAN) and (shifted or not key.startswith("model.kv_shift")):
            flat[key] = node

    for key in SETTINGS:
        node = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        walk(node, key)
    return flat


def setting_differences(a: RunData, b: RunData) -> list[str]:
    """``key: A -> B`` for every setting of B that is not A's (keys ``SETTINGS``)."""
    shifted = a.attention == b.attention == "kv_shift"
    sa, sb = _settings(a.config, shifted), _settings(b.config, shifted)
    return [f"{k}: {sa.get(k)} -> {sb.get(k)}" for k in sorted(set(sa) | set(sb))
            if sa.get(k) != sb.get(k)]


def _notes(run: RunData, a: RunData) -> list[str]:
    """The run's notes, and for B, the settings in which it is not A's."""
    if run is a or not a.config or not run.config:
        return list(run.notes)
    diffs = setting_differences(a, run)
    if not diffs:
        return list(run.notes)
    listed = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    return [f"differs from A beyond model.attention: {listed} (the losses compare more than "
            f"the attention)", *run.notes]


def summarize(runs: Sequence[RunData]) -> dict:
    """Everything the report says, as JSON-able data."""
    a = runs[0]
    out = {"reference": a.label, "runs": []}
    for run in runs:
        entry = {"label": run.label, "path": str(run.path), "attention": run.attention,
                 "iterations": run.train.iterations[-1], "tokens": run.final_tokens,
                 "train_loss": run.train.final, "val_loss": run.valid.final,
                 "val_ppl": math.exp(min(run.valid.final, 80.0)) if run.valid else None,
                 "kv_shift": shift_summary(run), "eval": run.evals, "notes": _notes(run, a)}
        entry["valid_sets"] = {name: {"iteration": curve.iterations[-1], "val_loss": curve.final}
                               for name, curve in run.valid_sets.items() if curve}
        if run is not a:
            entry["eval_vs_reference"] = eval_vs_reference(out["runs"][0], entry)
            entry["vs_reference"] = {
                "train_loss_diff": _diff(run.train.final, a.train.final),
                "val_loss_diff": _diff(run.valid.final, a.valid.final),
                **speedup(a, run),
                "valid_sets": {name: {"val_loss_diff": _diff(curve.final, a.valid_sets[name].final),
                                      **curve_speedup(a.valid_sets[name], curve)}
                               for name, curve in run.valid_sets.items()
                               if curve and name in a.valid_sets}}
        out["runs"].append(entry)
    return out


def _diff(b: Optional[float], a: Optional[float]) -> Optional[float]:
    return None if a is None or b is None else b - a


def _speed_text(vs: dict, ref: str, val_loss: Optional[float]) -> str:
    # without a curve on either side nothing was measured: "not reached" would
    # call B slower than A
    if vs.get("a_not_finite_from") is not None:
        # A diverged: B's curve is there, A's gives nothing to measure it against
        return (f"A = {ref} has no finite final validation loss (not finite from iteration "
                f"{vs['a_not_finite_from']}: diverged?): no speed-up or difference against it")
    if vs.get("target_loss") is None or val_loss is None:
        return "no validation curve"
    if vs["speedup"] is None:
        return f"not reached (A = {ref} ends at {_fmt(vs['target_loss'])})"
    if vs.get("speedup_at_least"):
        return (f"{_tokens(vs['b_tokens'])} tokens or fewer vs {_tokens(vs['a_tokens'])}: "
                f"at least {vs['speedup']:.2f}x (at B's first validation)")
    return (f"{_tokens(vs['b_tokens'])} tokens vs {_tokens(vs['a_tokens'])}: "
            f"{vs['speedup']:.2f}x")


def loss_table(summary: dict) -> list[str]:
    """The markdown table of the runs' final numbers."""
    ref = summary["reference"]
    lines = ["| run | attention | iterations | tokens | train loss | val loss | val ppl "
             "| val loss - A | tokens to reach A's val loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in summary["runs"]:
        vs = r.get("vs_reference")
        delta = _fmt(vs["val_loss_diff"]) if vs else "(A)"
        speed = _speed_text(vs, ref, r["val_loss"]) if vs else "-"
        lines.append(f"| {r['label']} | {r['attention']} | {r['iterations']} | "
                     f"{_tokens(r['tokens'])} | {_fmt(r['train_loss'])} | {_fmt(r['val_loss'])} "
                     f"| {_fmt(r['val_ppl'], 2)} | {delta} | {speed} |")
    return lines


def valid_set_table(summary: dict) -> list[str]:
    """The named validation sets' final losses, one row per set and run (empty when
    no run has one); B - A and the tokens to reach A where A has the set too."""
    ref = summary["reference"]
    rows = [(name, r) for name in sorted({n for r in summary["runs"] for n in r["valid_sets"]})
            for r in summary["runs"] if name in r["valid_sets"]]
    if not rows:
        return []
    lines = ["| set | run | iteration | val loss | val loss - A | tokens to reach A's val loss |",
             "|---|---|---:|---:|---:|---|"]
    for name, r in rows:
        vs = (r.get("vs_reference") or {}).get("valid_sets", {}).get(name)
        own = r["valid_sets"][name]
        delta = "(A)" if "vs_reference" not in r else _fmt(vs["val_loss_diff"]) if vs else "-"
        speed = _speed_text(vs, ref, own["val_loss"]) if vs else "-"
        lines.append(f"| {name} | {r['label']} | {own['iteration']} | {_fmt(own['val_loss'])} "
                     f"| {delta} | {speed} |")
    return lines


def shift_tables(summary: dict) -> list[str]:
    """Table 5 quadrants and per-layer coefficient means of each KV-shift run."""
    lines = []
    for r in summary["runs"]:
        s = r["kv_shift"]
        if not s:
            continue
        lines += ["", f"**{r['label']}** (iteration {s['iteration']}, {s['kv_heads']} KV heads)", ""]
        if s["quadrants"]:
            q = s["quadrants"]
            lines += ["| | β1 > β2 | β1 ≤ β2 |", "|---|---:|---:|",
                      f"| α1 > α2 | {q['a1>a2,b1>b2']} | {q['a1>a2,b1<=b2']} |",
                      f"| α1 ≤ α2 | {q['a1<=a2,b1>b2']} | {q['a1<=a2,b1<=b2']} |", ""]
        names = sorted({k for m in s["layer_means"].values() for k in m})
        if names:
            lines += ["| layer | " + " | ".join(names) + " |",
                      "|---:|" + "---:|" * len(names)]
            for layer, m in s["layer_means"].items():
                lines.append(f"| {layer} | " + " | ".join(_fmt(m.get(n), 3) for n in names) + " |")
    return lines


def _setting(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        return value
    return str(value) if isinstance(value, int) else f"{value:g}"  # 1000000, not 1e+06


def eval_table(summary: dict) -> list[str]:
    """One row per task, setting (iteration, shots, limit, dtype, window) and metric, one column
    per run: a run's result sits only in its own setting's row, so results of
    different settings never meet; empty when no run has results."""
    runs = summary["runs"]
    by_key = [{eval_key(e): e["metrics"] for e in r["eval"]} for r in runs]
    rows = sorted({(key, m) for table in by_key for key, ms in table.items() for m in ms},
                  key=lambda row: (key_order(row[0]), row[1]))
    if not rows:
        return []
    lines = ["| task | iteration | shots | limit | dtype | window | metric | "
             + " | ".join(r["label"] for r in runs) + " |",
             "|---|---:|---:|---:|---|---:|---|" + "---:|" * len(runs)]
    for key, metric in rows:
        task, *setting = key
        values = [_fmt(table.get(key, {}).get(metric)) for table in by_key]
        lines.append(f"| {task} | " + " | ".join(_setting(v) for v in setting)
                     + f" | {metric} | " + " | ".join(values) + " |")
    return lines


Z95 = NormalDist().inv_cdf(0.975)  # a two-sided 95 % interval of a normal difference


def _stderr_name(metric: str) -> str:
    """lm-eval's stderr of ``metric`` as ``metrics_of`` names it (``acc/<filter>``:
    ``acc_stderr/<filter>``)."""
    base, sep, filt = metric.partition("/")
    return f"{base}_stderr{sep}{filt}"


def eval_vs_reference(a: dict, run: dict) -> list[dict]:
    """``run``'s evaluation metrics minus A's in the same setting, where both carry
    lm-eval's stderr: the difference, its 95 % interval (z x the two stderrs in
    quadrature: unpaired, so wider than a paired test of the same documents) and
    whether it lies beyond."""
    mine = {eval_key(e): e for e in a["eval"]}
    out = []
    for entry in run["eval"]:
        ref = mine.get(eval_key(entry))
        for metric, value in (entry["metrics"] if ref else {}).items():
            se, ref_se = entry["metrics"].get(_stderr_name(metric)), \
                ref["metrics"].get(_stderr_name(metric))
            if "_stderr" in metric or metric not in ref["metrics"] or se is None \
                    or ref_se is None:
                continue
            diff, half = value - ref["metrics"][metric], Z95 * math.hypot(se, ref_se)
            out.append({**{k: entry[k] for k in EVAL_KEY}, "metric": metric, "diff": diff,
                        "interval95": half, "beyond": abs(diff) > half})
    return out


def eval_difference_table(summary: dict) -> list[str]:
    """One row per run, setting and metric with a stderr: run - A and its interval."""
    rows = [(r["label"], d) for r in summary["runs"][1:] for d in r.get("eval_vs_reference", [])]
    if not rows:
        return []
    lines = ["| task | iteration | shots | limit | dtype | window | metric | run | run - A | "
             "95 % interval | beyond it |", "|---|---:|---:|---:|---|---:|---|---|---:|---:|---|"]
    for label, d in sorted(rows, key=lambda r: (key_order(eval_key(r[1])), r[1]["metric"])):
        setting = " | ".join(_setting(d[k]) for k in EVAL_KEY[1:])
        lines.append(f"| {d['task']} | {setting} | {d['metric']} | {label} | {d['diff']:+.4f} | "
                     f"±{d['interval95']:.4f} | {'yes' if d['beyond'] else 'no'} |")
    return lines


def report_markdown(summary: dict, plots: dict[str, str]) -> str:
    """``report.md``: the tables and the plots (``plots``: title -> file name)."""
    lines = ["# kvtrain compare", "",
             f"Reference A: **{summary['reference']}**. Losses are the last logged train loss "
             "and the last validation loss; \"tokens to reach A's val loss\" reads each run's "
             "validation curve (linear between evaluations) at A's final validation loss; the "
             "speed-up is A's tokens over that.", ""]
    lines += loss_table(summary)
    sets = valid_set_table(summary)
    if sets:
        lines += ["", "## Validation sets (data.valid_sets)", ""] + sets
    for title, name in plots.items():
        lines += ["", f"## {title}", "", f"![{title}]({name})"]
    shift = shift_tables(summary)
    if shift:
        lines += ["", "## KV shift coefficients (paper Table 5 quadrants; per-layer means)"]
        lines += shift
    evals = eval_table(summary)
    if evals:
        lines += ["", "## Evaluation", ""] + evals
    differences = eval_difference_table(summary)
    if differences:
        lines += ["", "## Evaluation: differences from A", "",
                  "Each run's metric minus A's in the same setting, with a 95 % interval from "
                  "the two stderrs lm-eval reports (unpaired: wider than a paired test of the "
                  "same documents); \"beyond it\": the difference is larger than the "
                  "interval.", ""] + differences
    notes = [n for r in summary["runs"] for n in r["notes"]]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def printed_summary(summary: dict, out: Path, plots: dict[str, str]) -> str:
    """The lines ``kvtrain compare`` prints."""
    ref = summary["reference"]
    lines = ["kvtrain compare: A = " + ref]
    for r in summary["runs"]:
        line = (f"  {r['label']:<20} {r['attention']:<9} {_tokens(r['tokens']):>8} tokens  "
                f"train {_fmt(r['train_loss'])}  val {_fmt(r['val_loss'])}")
        vs = r.get("vs_reference")
        if vs:
            speed = _speed_text(vs, ref, r["val_loss"])
            line += f"  (val - A {_fmt(vs['val_loss_diff'])}; to reach A: {speed})"
        lines.append(line)
        for name, own in r["valid_sets"].items():
            line = f"  {'':<20} set {name}: val {_fmt(own['val_loss'])}"
            on = (vs or {}).get("valid_sets", {}).get(name)
            if on:
                line += (f"  (val - A {_fmt(on['val_loss_diff'])}; to reach A: "
                         f"{_speed_text(on, ref, own['val_loss'])})")
            lines.append(line)
        s = r["kv_shift"]
        if s and s["quadrants"]:
            lines.append(f"  {'':<20} Table 5 quadrants: {s['quadrants']}")
        lines += [f"  {'':<20} note: {n}" for n in r["notes"]]
    lines.append(f"  report: {out / 'report.md'}")
    for name in plots.values():
        lines.append(f"  plot:   {out / name}")
    return "\n".join(lines)


def compare(paths: Sequence[str | Path], out: Optional[str | Path] = None) -> tuple[dict, str]:
    """Reads the runs, writes the report into ``out`` (default: ``compare/`` in
    the runs' common parent folder); returns (summary, printed text)."""
    from kvtrain.output import write_whole
    from .plots import write_plots

    if len(paths) < 2:
        raise ConfigError("kvtrain compare needs at least two run folders")
    paths = [Path(p).expanduser() for p in paths]
    runs = [read_run(p, label) for p, label in zip(paths, unique_labels(paths))]
    given, out = out, Path(out) if out else _common_parent(paths) / "compare"
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if given:
            raise ConfigError(f"--out {out}: cannot create it ({e.strerror})") from None
        raise ConfigError(f"{out}: cannot create the report folder ({e.strerror}): name "
                          "another with --out") from None
    summary = summarize(runs)
    plots = write_plots(runs, out)
    write_whole(out / "report.md", report_markdown(summary, plots))
    write_whole(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    return summary, printed_summary(summary, out, plots)


def _common_parent(paths: Sequence[Path]) -> Path:
    parents = [p.resolve().parent for p in paths]
    common = parents[0]
    while not all(common == p or common in p.parents for p in parents):
        common = common.parent
    return common if len(common.parts) > 1 else Path.cwd()


__all__ = ["compare", "curve_speedup", "difference", "report_markdown", "shift_summary",
           "speedup", "summarize", "tokens_to_reach"]
