"""``kvtrain compare RUN_A RUN_B [...] [--out DIR]``: a report of runs side by side.

The first run is the reference (A). Writes ``DIR/report.md`` (markdown with
PNG plots) and ``DIR/summary.json``, and prints a summary. Reads only the run
folders (config.yaml, metrics.jsonl, eval/*.json): no torch, any machine.
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "compare", help="compare runs: loss curves, speed-up, KV-shift coefficients, evals",
        description="Compare run folders side by side; the first is the reference A.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders (A first)")
    p.add_argument("--out", metavar="DIR",
                   help="report folder (default: compare/ in the runs' common parent folder)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtrain.analysis.compare import compare

    _, text = compare(args.runs, args.out)
    print(text, flush=True)
    return 0
