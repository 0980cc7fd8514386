"""``kvtrain experiment induction --preset fig1a|fig1b|ngram|fig8 [--scale cpu|paper]
[--set KEY=VALUE ...] [--arms A,B] [--workers N] [--run-dir DIR] [--no-wandb]``, and
``kvtrain experiment landscape [--rest 0,10,100] [--run-dir DIR]`` (Figure 2: the
analytic loss of Theorem 3.4, ``kvtrain.experiments.landscape``).

Generates one ``kvtrain train`` run config per arm of one of the paper's toy
grids (Figure 1a, Figure 1b, the 3-gram control of Appendix E.3, the k-hop task
of Appendix E.1 / Figure 8; same seed and data for every arm), trains each with the trainer, and writes
``DIR/results.csv``, ``DIR/accuracy.png``, ``DIR/loss.png`` and
``DIR/summary.json`` (see ``kvtrain.experiments``). ``--set`` takes
``kvtrain train``'s keys and grammar (``--set train.max_steps=100``) and
applies to every arm.
"""

from __future__ import annotations

import os
import time

# O(T) past it: the loss differs by ~1/O(T) across Figure 2's landscape, under float64's
# precision beside log O(T) (1e20 put its minimum at (0, 0))
MAX_REST = 1e12


def register(sub) -> None:
    p = sub.add_parser("experiment", help="reproduce the paper's toy experiments",
                       description="Reproduce the paper's toy experiments.")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    q = esub.add_parser(
        "induction", help="induction heads: Figure 1a/1b, the 3-gram control, k hops (Fig. 8)",
        description="Train every arm of a preset grid (same seed and data) with kvtrain train "
                    "and write results.csv, accuracy.png, loss.png and summary.json to the "
                    "run folder.")
    q.add_argument("--preset", required=True, choices=["fig1a", "fig1b", "ngram", "fig8"],
                   help="fig1a: KV shift 1 layer vs vanilla 1/2/4 layers; fig1b: hidden 8, "
                        "vanilla 2 layers vs KV shift 1 layer; ngram: vanilla vs KV shift "
                        "on the 3-gram task; fig8: vanilla vs KV shift at 2/3/4 layers on "
                        "the k-hop task (error rate by hop count)")
    q.add_argument("--scale", default="cpu", choices=["cpu", "paper"],
                   help="cpu: fits 30 minutes on 2 cores (fig1a); paper: the paper's "
                        "setting (hidden 1024, vocab 8000, length 512), for GPUs")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a kvtrain train config value for every arm, e.g. "
                        "--set train.max_steps=300 --set data.induction.length=256 "
                        "(repeatable; the keys the arms vary are refused)")
    q.add_argument("--arms", default=None, metavar="A,B",
                   help="run only these arms of the preset (comma separated names)")
    q.add_argument("--run-dir", default=None, metavar="DIR",
                   help="output folder (default: runs/induction-<preset>-<scale>)")
    q.add_argument("--workers", type=int, default=1,
                   help="arms trained side by side (one process each); 1 = one after another")
    q.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS of each arm's process (0: inherited)")
    q.add_argument("--nproc", type=int, default=1,
                   help="processes per arm (torchrun; e.g. GPUs per arm with --set parallel.*)")
    q.add_argument("--no-wandb", action="store_true",
                   help="do not log to wandb (the same as --set wandb.enabled=false)")
    q.set_defaults(func=run_induction)
    s = esub.add_parser(
        "landscape", help="Figure 2: the coefficients' loss landscape (Theorem 3.4)",
        description="Draw the contour lines and descent directions of Theorem 3.4's loss "
                    "over (alpha1, beta1) for each O(T) (landscape.png) and write what they "
                    "show, with where gradient descent from U(0,1) starts ends "
                    "(landscape.json). No training: the analytic loss.")
    s.add_argument("--rest", default="0,10,100", metavar="O1,O2,...",
                   help="the O(T) of each panel, >= 0 (default: the paper's 0,10,100)")
    s.add_argument("--run-dir", default=os.path.join("runs", "landscape"), metavar="DIR",
                   help="output folder (default: runs/landscape)")
    s.set_defaults(func=run_landscape)


def run_landscape(args) -> int:
    import math

    from kvtrain.config import ConfigError, make_folder
    from kvtrain.experiments.landscape import format_panels, write_landscape

    try:
        rests = [float(x) for x in args.rest.split(",") if x.strip()]
    except ValueError:
        rests = []
    if not rests or any(not math.isfinite(r) or r < 0 for r in rests):
        raise ConfigError(f"--rest {args.rest!r}: give finite O(T) values >= 0, e.g. 0,10,100")
    if max(rests) > MAX_REST:
        raise ConfigError(f"--rest {args.rest!r}: O(T) above {MAX_REST:g} leaves the landscape's "
                          "differences (~1/O(T)) below float64's precision")
    out = make_folder(args.run_dir, "--run-dir")
    print(format_panels(write_landscape(out, rests)))
    print(f"wrote {out}/landscape.png, {out}/landscape.json")
    return 0


def run_induction(args) -> int:
    from kvtrain.config import ConfigError, make_folder
    from kvtrain.config.layout import total_steps
    from kvtrain.experiments.presets import arm_configs, select_arms
    from kvtrain.experiments.runner import earlier_group

    if args.workers < 1 or args.nproc < 1 or args.threads < 0:
        raise ConfigError("--workers and --nproc must be >= 1, --threads >= 0")
    overrides = list(args.overrides) + (["wandb.enabled=false"] if args.no_wandb else [])
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else None
    if args.arms is not None and not arms:  # ',' or '': it ran every arm
        raise ConfigError(f"--arms {args.arms!r}: no arm names")
    selected = [a.name for a in select_arms(args.preset, args.scale, arms)]
    run_dir = args.run_dir or os.path.join("runs", f"induction-{args.preset}-{args.scale}")
    # a folder's experiment is continued: its arms stay one wandb group
    group = earlier_group(run_dir, args.preset, args.scale) or \
        f"{args.preset}-{args.scale}-{time.strftime('%Y%m%d-%H%M%S')}"
    # Every arm's config is built and validated before anything is trained (all
    # of the preset's: those the folder already holds are checked against them).
    configs = arm_configs(args.preset, args.scale, overrides, world_size=args.nproc,
                          extra={"wandb": {"group": group}})
    make_folder(run_dir, "--run-dir")
    steps = total_steps(configs[0][1])[0]  # train.max_steps or train.train_tokens
    print(f"experiment induction --preset {args.preset} --scale {args.scale}: {len(selected)} "
          f"arms ({', '.join(selected)}), {steps} steps each, "
          f"{args.workers} at a time -> {run_dir}", flush=True)
    from kvtrain.experiments.results import format_summary
    from kvtrain.experiments.runner import run_experiment

    spec = {"preset": args.preset, "scale": args.scale, "overrides": overrides,
            "wandb_group": group}
    summary = run_experiment(configs, run_dir, spec, workers=args.workers, threads=args.threads,
                             nproc=args.nproc, title=f"{args.preset} ({args.scale})",
                             selected=selected)
    print(format_summary(summary))
    hops = f"{run_dir}/hop_errors.png, " if args.preset == "fig8" else ""
    print(f"wrote {run_dir}/results.csv, {run_dir}/accuracy.png, {run_dir}/loss.png, {hops}"
          f"{run_dir}/summary.json")
    # an arm trained short of its steps (a stop request) failed too: it has no result yet
    failed = [arm for arm, a in summary["arms"].items() if a["exit_code"] != 0
              or (arm in selected and not a["final_step"] >= steps)]
    if failed:
        print(f"kvtrain: arm(s) {', '.join(failed)} failed or did not finish; see "
              f"{run_dir}/arms/<arm>/train.log (the same command continues them)", flush=True)
        return 1
    return 0
