"""``kvtrain experiment induction --preset fig1a|fig1b|ngram [--scale cpu|paper] [--run-dir DIR]``.

Runs one of the paper's toy grids (Figure 1a, Figure 1b, the 3-gram control
of Appendix E.3) with the same seed and data for every arm, and writes
``DIR/results.csv``, ``DIR/accuracy.png``, ``DIR/loss.png`` and
``DIR/summary.json`` (see ``kvtrain.experiments.induction``).
"""

from __future__ import annotations

import os


def register(sub) -> None:
    p = sub.add_parser("experiment", help="reproduce the paper's toy experiments",
                       description="Reproduce the paper's toy experiments.")
    esub = p.add_subparsers(dest="experiment", metavar="EXPERIMENT", required=True)
    q = esub.add_parser(
        "induction", help="induction heads: Figure 1a/1b and the 3-gram control",
        description="Train every arm of a preset grid (same seed and data) and write "
                    "results.csv, accuracy.png, loss.png and summary.json to the run folder.")
    q.add_argument("--preset", required=True, choices=["fig1a", "fig1b", "ngram"],
                   help="fig1a: KV shift 1 layer vs vanilla 1/2/4 layers; fig1b: hidden 8, "
                        "vanilla 2 layers vs KV shift 1 layer; ngram: vanilla vs KV shift "
                        "on the 3-gram task")
    q.add_argument("--scale", default="cpu", choices=["cpu", "paper"],
                   help="cpu: fits 30 minutes on 2 cores (fig1a); paper: the paper's "
                        "setting (hidden 1024, vocab 8000, length 512), for GPUs")
    q.add_argument("--run-dir", default=None, metavar="DIR",
                   help="output folder (default: runs/induction-<preset>-<scale>)")
    q.add_argument("--steps", type=int, default=None, help="training steps per arm")
    q.add_argument("--eval-interval", type=int, default=None, metavar="N",
                   help="steps between evaluations")
    q.add_argument("--eval-samples", type=int, default=None, metavar="N",
                   help="sequences in the fixed evaluation set")
    q.add_argument("--seed", type=int, default=None, help="weight-init seed (all arms)")
    q.add_argument("--data-seed", type=int, default=None, help="training-data seed (all arms)")
    q.add_argument("--arms", default=None, metavar="A,B",
                   help="run only these arms of the preset (comma separated names)")
    q.add_argument("--workers", type=int, default=1,
                   help="arms trained side by side (processes); 1 = one after another")
    q.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (0: torch's default)")
    q.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a setting, e.g. --set lr=1e-3 --set hidden_size=32 "
                        "--set task.length=256 (repeatable)")
    q.add_argument("--backend", default="standalone", choices=["standalone", "trainer"],
                   help="standalone: the experiment's own one-process loop (torch AdamW); "
                        "trainer: one `kvtrain train` run per arm (data.type induction|ngram; "
                        "multi-GPU, checkpoints, metrics.jsonl), see docs/induction.md")
    q.add_argument("--no-wandb", action="store_true", help="do not log to wandb")
    q.set_defaults(func=run_induction)


def _parse_value(text: str):
    """int, float (1e-2 included, which YAML 1.1 reads as a string), bool/null/str."""
    import yaml

    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return yaml.safe_load(text)


def run_induction(args) -> int:
    import warnings

    from kvtrain.config import ConfigError
    from kvtrain.experiments.induction import experiment_spec, format_summary, run_experiment
    from kvtrain.experiments.standalone import Settings

    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        key = key.strip()
        if not key.startswith("task.") and key not in Settings.__dataclass_fields__:
            raise ConfigError(f"unknown experiment setting {key!r}; one of "
                              f"{', '.join(Settings.__dataclass_fields__)} or task.<option>")
        overrides[key] = _parse_value(value)
    for key, value in (("steps", args.steps), ("eval_interval", args.eval_interval),
                       ("eval_samples", args.eval_samples), ("seed", args.seed),
                       ("data_seed", args.data_seed)):
        if value is not None:
            overrides[key] = value
    try:
        settings, arms = experiment_spec(args.preset, args.scale, **overrides)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if args.arms:
        wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
        unknown = sorted(set(wanted) - {a.name for a in arms})
        if unknown:
            raise ConfigError(f"--arms: unknown arm(s) {unknown}; the preset has "
                              f"{[a.name for a in arms]}")
        arms = [a for a in arms if a.name in wanted]
    if settings.steps < 1 or settings.eval_interval < 1 or settings.eval_samples < 1:
        raise ConfigError("steps, eval_interval and eval_samples must be positive")
    if args.no_wandb:
        os.environ["KVTRAIN_NO_WANDB"] = "1"
    for pattern in (".*Transformer Engine and Apex are not installed.*",
                    ".*Apex is not installed.*", ".*full scope is deprecated.*"):
        warnings.filterwarnings("ignore", message=pattern)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    run_dir = args.run_dir or os.path.join("runs", f"induction-{args.preset}-{args.scale}")
    print(f"experiment induction --preset {args.preset} --scale {args.scale} "
          f"(backend {args.backend}): {len(arms)} arms ({', '.join(a.name for a in arms)}), "
          f"{settings.steps} steps each -> {run_dir}", flush=True)
    summary = run_experiment(settings, arms, run_dir, workers=args.workers, threads=args.threads,
                             preset=args.preset, scale=args.scale, backend=args.backend)
    print(format_summary(summary))
    print(f"wrote {run_dir}/results.csv, {run_dir}/accuracy.png, {run_dir}/loss.png, "
          f"{run_dir}/summary.json")
    return 0
