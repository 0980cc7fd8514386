"""``kvtrain scaling RUN... [--out DIR] [--valid-set NAME]``: loss against model size.

Each attention's final validation loss against its non-embedding parameters,
a power law fitted to each, and the parameters vanilla needs for the other arm's
loss (the paper's Figure 6a): ``DIR/scaling.md``, ``scaling.json``,
``scaling.png``. A ``kvtrain sweep`` folder stands for its cells' runs. Reads only
the run folders, like ``kvtrain compare``. See ``kvtrain.analysis.scaling``.
"""

from __future__ import annotations

import argparse


def register(sub) -> None:
    p = sub.add_parser(
        "scaling", help="loss against model size per attention: power-law fits (Figure 6a)",
        description="Fit each attention's final validation loss against its non-embedding "
                    "parameters over runs of several sizes (run folders, or a kvtrain sweep "
                    "folder for its cells).")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run folders, or sweep folders")
    p.add_argument("--out", metavar="DIR",
                   help="report folder (default: scaling/ in the runs' common parent folder; "
                        "for one sweep folder, in it)")
    p.add_argument("--valid-set", metavar="NAME", default=None,
                   help="fit the loss on this data.valid_sets entry (the paper's WebText) "
                        "instead of the run's own validation")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvtrain.analysis.scaling import scaling

    _, text = scaling(args.runs, args.out, args.valid_set)
    print(text, flush=True)
    return 0
