"""``kvtrain sweep CONFIG --grid KEY=V1,V2,... [--grid ...] [--set KEY=VALUE ...]
[--run-dir DIR] [--workers N] [--threads T] [--nproc N] [--dry-run] [--no-wandb]``.

Trains ``CONFIG`` at every combination of the grid's values, each cell a
``kvtrain train`` run (``DIR/arms/<cell>/run``, its config ``arm.yaml`` and log
``train.log`` beside it), and tabulates the cells' final validation losses
(``DIR/sweep.md``, ``DIR/sweep.json``; printed): the paper's Appendix H tables, e.g.

    kvtrain sweep configs/blagpt/kv_shift.yaml --grid model.attention=vanilla,kv_shift \\
        --grid optimizer.lr=1e-4,2e-4,4e-4 --grid train.seq_length=256,512,1024

A rerun continues the cells that did not finish and keeps the others; a grid
extended by values trains only the new cells. ``--dry-run`` prints each cell's
``kvtrain train`` command and writes nothing (for a cluster: one job a line); once
they have run, the same command without it writes the tables (every cell's run is
finished, so its trainer has nothing to do).
See ``kvtrain.experiments.sweep``.
"""

from __future__ import annotations

import json
import os
import shlex


def register(sub) -> None:
    p = sub.add_parser(
        "sweep", help="train one config over a grid of settings and tabulate the losses",
        description="Train CONFIG at every combination of the --grid values (each cell a "
                    "kvtrain train run) and write the final validation losses as tables "
                    "(sweep.md, sweep.json).")
    p.add_argument("config", metavar="CONFIG.yaml")
    p.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                   help="a config key and its values (repeatable; kvtrain train's keys and "
                        "value grammar), e.g. --grid optimizer.lr=1e-4,2e-4")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value in every cell (repeatable)")
    p.add_argument("--run-dir", default=None, metavar="DIR",
                   help="the sweep's folder (default: runs/sweep-<config name>)")
    p.add_argument("--workers", type=int, default=1, help="cells trained side by side")
    p.add_argument("--threads", type=int, default=0,
                   help="OMP_NUM_THREADS of each cell's process (0: inherited)")
    p.add_argument("--nproc", type=int, default=1, help="processes per cell (torchrun)")
    p.add_argument("--arms", default=None, metavar="KEY",
                   help="the grid key whose values are the arms compared pair by pair "
                        "(default: model.attention, where in the grid); the first value is "
                        "the reference")
    p.add_argument("--replicates", default=None, metavar="KEY",
                   help="the grid key whose values are replicates, averaged in the arms' "
                        "table (default: train.seed, where in the grid)")
    p.add_argument("--dry-run", action="store_true",
                   help="print each cell's kvtrain train command; train and write nothing")
    p.add_argument("--no-wandb", action="store_true",
                   help="do not log to wandb (the same as --set wandb.enabled=false)")
    p.set_defaults(func=run)


def _command(args, cell, run_dir: str) -> str:
    sets = " ".join(f"--set {shlex.quote(o)}" for o in cell.overrides)
    return (f"kvtrain train {shlex.quote(args.config)} {sets} "
            f"--set name={shlex.quote(cell.cfg.name)} "
            f"--run-dir {shlex.quote(os.path.join(run_dir, 'arms', cell.name, 'run'))}")


def run(args) -> int:
    from kvtrain.config import ConfigError, make_folder, read_yaml

    if args.workers < 1 or args.nproc < 1 or args.threads < 0:
        raise ConfigError("--workers and --nproc must be >= 1, --threads >= 0")
    from kvtrain.experiments.sweep import check_shards, parse_grid, sweep_cells

    overrides = list(args.overrides) + (["wandb.enabled=false"] if args.no_wandb else [])
    axes = parse_grid(args.grid, overrides)
    from kvtrain.experiments.paired import roles

    roles(axes, args.arms, args.replicates)  # a key not in the grid: refused before training
    cells = sweep_cells(args.config, overrides, axes, world_size=args.nproc)
    name = (read_yaml(args.config).get("name") or "run") if args.config else "run"
    run_dir = args.run_dir or os.path.join("runs", f"sweep-{name}")
    print(f"kvtrain sweep: {len(cells)} cells ({' x '.join(str(len(a.texts)) for a in axes)}) "
          f"-> {run_dir}", flush=True)
    from data_tools.fileio import not_a_folder

    if why := not_a_folder(run_dir):  # before a --dry-run prints commands that would fail
        raise ConfigError(f"--run-dir {why}")
    _check_runs_of_dry_run_jobs(cells, run_dir)
    if args.dry_run:
        from pathlib import Path

        from kvtrain.experiments.runner import arm_jobs
        from kvtrain.experiments.sweep import as_arms

        # what the sweep's own command would refuse, before jobs resume its cells' runs
        # under other settings (reads the folder only)
        arm_jobs(as_arms(cells), Path(run_dir))
        for cell in cells:
            print(_command(args, cell, run_dir))
        return 0
    check_shards(cells)
    make_folder(run_dir, "--run-dir")
    return _train_and_tabulate(args, axes, cells, run_dir)


def _check_runs_of_dry_run_jobs(cells, run_dir: str) -> None:
    """A cell's run that a --dry-run job trained has no ``arm.yaml`` (which the runner
    compares), only the run's own ``config.yaml``: run with other --set values, it
    would be resumed at its last step with nothing to do and tabulated under this
    command's settings. Compared as the runner compares ``arm.yaml`` (wandb may differ)."""
    from pathlib import Path

    from kvtrain.config import ConfigError, load_config, to_dict
    from kvtrain.config.compat import config_changes

    for cell in cells:
        folder = Path(run_dir) / "arms" / cell.name
        recorded = folder / "run" / "config.yaml"
        if (folder / "arm.yaml").exists() or not recorded.exists():
            continue
        saved = to_dict(load_config(recorded))
        changes = config_changes(saved, to_dict(cell.cfg), tuple(k for k in saved if k != "wandb"))
        if changes:
            raise ConfigError(
                f"{recorded} (the cell's run, trained without arm.yaml: a --dry-run job) "
                f"differs from this command's config of cell {cell.name} "
                f"({'; '.join(map(str, changes[:3]))}): the cells of a sweep share one config; "
                "rerun with the --set values its jobs ran with, or choose another --run-dir")


def _train_and_tabulate(args, axes, cells, run_dir: str) -> int:
    from pathlib import Path

    from kvtrain.output import written_whole
    from kvtrain.experiments.paired import analyse
    from kvtrain.experiments.runner import arm_jobs, run_arms
    from kvtrain.experiments.sweep import as_arms, entries, report, tables

    jobs = arm_jobs(as_arms(cells), Path(run_dir))
    for job in jobs:
        if job.earlier is not None:
            print(f"[{job.arm.name}] finished earlier: kept ({job.run_dir})", flush=True)
    trained = {r.arm: r for r in run_arms([j for j in jobs if j.earlier is None],
                                          args.workers, args.threads, args.nproc)}
    results = [j.earlier or trained[j.arm.name] for j in jobs]
    done = entries(cells, results)
    extra, analyses = analyse(axes, done, {j.arm.name: j.run_dir for j in jobs}, Path(run_dir),
                              args.arms, args.replicates)
    with written_whole(Path(run_dir) / "sweep.md") as f:
        f.write(report(args.config, args.overrides, axes, done, extra))
    with written_whole(Path(run_dir) / "sweep.json") as f:
        f.write(json.dumps({"config": args.config, "grid": {a.key: list(a.texts) for a in axes},
                            "overrides": args.overrides, "cells": done, **analyses},
                           indent=1, default=str) + "\n")
    print("\n".join(tables(axes, done) + [""] + extra))
    print(f"wrote {run_dir}/sweep.md, {run_dir}/sweep.json"
          + "".join(f", {run_dir}/{f}" for f in analyses.get("files", [])))
    failed = [e["cell"] for e in done if e["exit_code"] != 0 or not e["finished"]]
    if failed:
        print(f"kvtrain: cell(s) {', '.join(failed)} failed or did not finish; see "
              f"{run_dir}/arms/<cell>/train.log (the same command continues them)", flush=True)
        return 1
    return 0
