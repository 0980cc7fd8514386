"""Runs an experiment's arms through the trainer and writes its results.

Each arm's ``RunConfig`` is written to ``arms/<arm>/arm.yaml`` and trained by
``kvtrain train arms/<arm>/arm.yaml --run-dir arms/<arm>/run`` in its own
process (under ``torchrun`` with ``nproc`` > 1), ``workers`` arms side by
side; its log is ``arms/<arm>/train.log``. A process per arm isolates the
arms (megatron's global state, a crash) and is the exact command a user can
rerun. The curve of an arm is read from its ``metrics.jsonl``.

Outputs in the run folder: ``results.csv``, ``accuracy.png``, ``loss.png``,
``summary.json``, ``spec.json`` (preset, scale, overrides, arms, command) and
per arm ``arm.yaml``, ``curve.csv``, ``train.log`` and the run folder ``run/``
(config.yaml, metrics.jsonl, wandb/ with one wandb run per arm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError, RunConfig, dump_yaml
from kvtrain.plan.params import count_params

from .presets import Arm
from .results import ArmResult, curve_from_metrics, plot_curves, summarize, write_results

# Launcher variables of an enclosing torchrun/SLURM job: an arm is its own job.
_LAUNCHER_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                 "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


@dataclass
class ArmJob:
    """One arm to train: its config and its folder (``arms/<arm>``)."""

    arm: Arm
    cfg: RunConfig
    folder: Path

    @property
    def run_dir(self) -> Path:
        return self.folder / "run"


def arm_jobs(configs: list[tuple[Arm, RunConfig]], run_dir: Path) -> list[ArmJob]:
    """The jobs of an experiment; refuses a run folder that already holds an
    arm's run (its results would be appended to, not replaced), or runs of
    other arms (the folder's results.csv, summary.json and plots would be
    replaced by this selection's, without them)."""
    jobs = [ArmJob(arm, cfg, run_dir / "arms" / arm.name) for arm, cfg in configs]
    taken = [str(j.run_dir) for j in jobs if j.run_dir.exists()]
    if taken:
        raise ConfigError(f"{run_dir} already holds runs of this experiment ({', '.join(taken)}); "
                          "choose another --run-dir or remove them")
    names = {j.arm.name for j in jobs}
    others = sorted(p.parent.name for p in (run_dir / "arms").glob("*/run")
                    if p.parent.name not in names)
    if others:
        raise ConfigError(f"{run_dir} holds runs of arm(s) {', '.join(others)} of an earlier "
                          "experiment: this one's results.csv, summary.json and plots would "
                          "replace theirs; choose another --run-dir")
    return jobs


def arm_command(cfg_path: Path, run_dir: Path, nproc: int = 1) -> list[str]:
    """``kvtrain train CFG --run-dir DIR`` (under torchrun for ``nproc`` > 1)."""
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={nproc}", "-m", "kvtrain.cli"]
    else:
        launcher = [sys.executable, "-m", "kvtrain.cli"]
    return launcher + ["train", str(cfg_path), "--run-dir", str(run_dir)]


def _start(job: ArmJob, threads: int, nproc: int) -> tuple[subprocess.Popen, float]:
    job.folder.mkdir(parents=True, exist_ok=True)
    cfg_path = job.folder / "arm.yaml"
    cfg_path.write_text(dump_yaml(job.cfg))
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_ENV}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    with open(job.folder / "train.log", "w") as log:
        proc = subprocess.Popen(arm_command(cfg_path, job.run_dir, nproc), stdout=log,
                                stderr=subprocess.STDOUT, env=env)
    return proc, time.time()


def _finish(job: ArmJob, code: int, started: float) -> ArmResult:
    wall = time.time() - started
    metrics = job.run_dir / "metrics.jsonl"
    rows = curve_from_metrics(metrics, job.arm.name, job.cfg.data.type, started) \
        if metrics.exists() else []
    write_results(rows, job.folder / "curve.csv")
    n = count_params(job.cfg.model)
    params = {"total": int(n.total), "non_embedding": int(n.non_embedding)}
    status = "done" if code == 0 else f"FAILED (exit {code}; see {job.folder / 'train.log'})"
    print(f"[{job.arm.name}] {status} in {wall:.0f} s", flush=True)
    return ArmResult(job.arm.name, rows, wall, code, params)


def run_arms(jobs: list[ArmJob], workers: int = 1, threads: int = 0,
             nproc: int = 1) -> list[ArmResult]:
    """Trains every job, ``workers`` at a time; results in the jobs' order.
    If this process is interrupted, the running arms are stopped with it."""
    pending = list(jobs)
    running: dict[int, tuple[ArmJob, subprocess.Popen, float]] = {}
    done: dict[str, ArmResult] = {}
    try:
        while pending or running:
            while pending and len(running) < max(1, workers):
                job = pending.pop(0)
                print(f"[{job.arm.name}] kvtrain train {job.folder / 'arm.yaml'} "
                      f"--run-dir {job.run_dir}", flush=True)
                proc, started = _start(job, threads, nproc)
                running[proc.pid] = (job, proc, started)
            for pid, (job, proc, started) in list(running.items()):
                if proc.poll() is not None:
                    del running[pid]
                    done[job.arm.name] = _finish(job, proc.returncode, started)
            time.sleep(0.2)
    finally:
        for job, proc, _ in running.values():  # interrupted: no orphan keeps training
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    return [done[j.arm.name] for j in jobs]


def run_experiment(configs: list[tuple[Arm, RunConfig]], run_dir: str | Path,
                   spec: dict, workers: int = 1, threads: int = 0, nproc: int = 1,
                   title: Optional[str] = None) -> dict:
    """Trains the arms and writes results.csv, accuracy.png, loss.png,
    summary.json and spec.json (``spec`` plus the run's layout). Returns the summary."""
    run_dir = Path(run_dir)
    jobs = arm_jobs(configs, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "arms": [j.arm.name for j in jobs], "workers": workers, "threads": threads,
            "nproc": nproc, "commands": [" ".join(arm_command(j.folder / "arm.yaml", j.run_dir,
                                                                nproc)) for j in jobs]}
    (run_dir / "spec.json").write_text(json.dumps(spec, indent=2))
    t0 = time.time()
    results = run_arms(jobs, workers, threads, nproc)
    rows = [row for r in results for row in r.rows]
    write_results(rows, run_dir / "results.csv")
    names = [r.arm for r in results]
    title = title or run_dir.name
    plot_curves(rows, run_dir / "accuracy.png", "accuracy", title=title, arms=names)
    plot_curves(rows, run_dir / "loss.png", "loss", title=title, arms=names)
    summary = summarize(results, time.time() - t0)
    summary.update(run_dir=str(run_dir), **{k: spec[k] for k in ("workers", "threads", "nproc")})
    for key in ("preset", "scale", "overrides"):
        if key in spec:
            summary[key] = spec[key]
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
