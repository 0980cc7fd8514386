"""``kvtrain plan CONFIG``: parameters, layout, memory per GPU, steps and wall time.

Runs anywhere (no GPU, no torch import). Exits 1 with one line on stderr when
the layout cannot work on the given cluster, 2 on a config error.
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    from kvtrain.plan.flops import GPUS

    p = sub.add_parser(
        "plan",
        help="check a config's layout on a cluster: parameters, memory per GPU, steps, time",
        description="Parameters, parallel layout, per-GPU memory, global batch, steps, FLOPs "
                    "and wall time of CONFIG on NODES x GPUS_PER_NODE GPUs. Exits non-zero "
                    "with one line when the layout cannot work.",
    )
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--gpu", choices=sorted(GPUS), default="a100",
                   help="GPU kind: memory and peak bf16 FLOP/s (default a100)")
    p.add_argument("--mfu", type=float, default=0.4,
                   help="model FLOPs utilisation assumed for the wall time (default 0.4)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable), e.g. --set parallel.tensor=4")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from kvtrain.config import load_config
    from kvtrain.plan import PlanError, as_dict, make_plan, render

    cfg = load_config(args.config, args.overrides)  # ConfigError: one line from the CLI
    try:
        plan = make_plan(cfg, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                         gpu=args.gpu, mfu=args.mfu)
    except PlanError as e:
        print(f"kvtrain plan: {args.config}: layout refused: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(as_dict(plan), indent=2))
    else:
        print(render(plan, source=args.config))
    return 0
