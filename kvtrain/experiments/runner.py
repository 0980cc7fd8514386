"""Runs an experiment's arms through the trainer and writes its results.

Each arm's ``RunConfig`` is written to ``arms/<arm>/arm.yaml`` and trained by
``kvtrain train arms/<arm>/arm.yaml --run-dir arms/<arm>/run`` in its own
process (under ``torchrun`` with ``nproc`` > 1), ``workers`` arms side by
side; its log is ``arms/<arm>/train.log``. A process per arm isolates the
arms (megatron's global state, a crash) and is the exact command a user can
rerun. The curve of an arm is read from its ``metrics.jsonl``.

Outputs in the run folder: ``results.csv``, ``accuracy.png``, ``loss.png``
(and ``hop_errors.png`` for the k-hop task), ``summary.json``, ``spec.json`` (preset, scale, overrides, arms, command) and
per arm ``arm.yaml``, ``curve.csv``, ``train.log`` (the output of every
attempt, each after a line ``===== attempt N, <time>: <command> =====``),
``result.json`` (exit code, wall time of all attempts, their start times) and
the run folder ``run/`` (config.yaml, metrics.jsonl, wandb/ with one wandb run
per arm). A rerun into the folder continues the experiment (``arm_jobs``). Stopped
(Ctrl-C, SIGTERM) or killed, the runner's arms stop at a step with a checkpoint
(``children``).
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

from kvtrain.output import written_whole
from kvtrain.config import (ConfigError, RunConfig, checkpoint_folder, dump_yaml, load_config,
                            to_dict)
from kvtrain.config.compat import config_changes
from kvtrain.config.layout import total_steps
from kvtrain.plan.params import count_params
from kvtrain.train.integrity import iteration_of, read_tracker

from .children import ended, run_all, start_run
from .presets import Arm
from .results import (ArmResult, curve_from_metrics, hop_errors_from_metrics, plot_curves,
                      plot_hop_errors, summarize, summary_json, write_results)

RESULT = "result.json"  # per arm: the runner's record of its process (exit code, wall time)
ATTEMPT = "===== attempt "  # starts the line that opens each attempt's output in train.log


@dataclass
class ArmJob:
    """One arm of an experiment's folder: its config, its folder (``arms/<arm>``)
    and, for an arm not trained by this command, what its earlier run gave."""

    arm: Arm
    cfg: RunConfig
    folder: Path
    earlier: Optional[ArmResult] = None

    @property
    def run_dir(self) -> Path:
        return self.folder / "run"


def earlier_group(run_dir: str | Path, preset: str, scale: str) -> Optional[str]:
    """The wandb group of the experiment a folder holds (its arms stay one group),
    None for a new folder; refuses a folder of another preset or scale."""
    path = Path(run_dir) / "spec.json"
    if not path.exists():
        return None
    try:
        spec = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"{path}: not JSON ({e}); choose another --run-dir") from None
    if (spec.get("preset"), spec.get("scale")) != (preset, scale):
        raise ConfigError(f"{run_dir} holds an experiment of preset {spec.get('preset')} (scale "
                          f"{spec.get('scale')}), not {preset} ({scale}); choose another --run-dir")
    return spec.get("wandb_group")


def _check_same_config(job: ArmJob) -> None:
    """An arm already in the folder must be the arm this command would train:
    otherwise the grid's results would mix settings. Logging (wandb) may differ."""
    saved = to_dict(load_config(job.folder / "arm.yaml"))
    keys = tuple(k for k in saved if k != "wandb")
    changes = config_changes(saved, to_dict(job.cfg), keys)
    if changes:
        raise ConfigError(
            f"{job.folder / 'arm.yaml'} differs from this command's config of arm {job.arm.name} "
            f"({'; '.join(map(str, changes[:3]))}): the arms of an experiment share one config; "
            "rerun with its --set values, or choose another --run-dir")


def _record(folder: Path) -> dict:
    """The arm's ``result.json`` ({} when none): ``exit_code`` (None while an
    attempt runs), ``wall_s`` (of every attempt that ended) and ``starts`` (the
    time each attempt started)."""
    path = folder / RESULT
    try:
        result = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); remove it to train the arm again") from None
    if not isinstance(result, dict):
        raise ConfigError(f"{path}: not a JSON object; remove it to train the arm again")
    if "started" in result:  # written before attempts were counted: one attempt
        result.setdefault("starts", [result.pop("started")])
    return result


def _curve(job: ArmJob, starts: list[float]) -> list[dict]:
    metrics = job.run_dir / "metrics.jsonl"
    return curve_from_metrics(metrics, job.arm.name, job.cfg.data.type, starts) \
        if metrics.exists() else []


def _earlier_result(job: ArmJob) -> ArmResult:
    """What the arm's earlier run in the folder gave."""
    result = _record(job.folder)
    # no exit code: the runner was stopped while the arm trained
    return ArmResult(job.arm.name, _curve(job, result.get("starts", [])),
                     result.get("wall_s", 0.0), result.get("exit_code"), _params(job.cfg),
                     hop_errors_from_metrics(job.run_dir / "metrics.jsonl"))


def _finished(result: ArmResult, cfg: RunConfig) -> bool:
    """Whether an arm's earlier run exited cleanly at its last step."""
    return result.exit_code == 0 and bool(result.rows) and \
        result.rows[-1]["step"] >= total_steps(cfg)[0]


def arm_jobs(configs: list[tuple[Arm, RunConfig]], run_dir: Path,
             selected: Optional[list[str]] = None) -> list[ArmJob]:
    """The arms of an experiment's folder, in the preset's order: the
    ``selected`` ones (None: all) and those it already holds. A finished arm
    keeps its earlier result (``earlier``); an unfinished selected one is
    trained again (the trainer resumes its run from its latest checkpoint, if
    any); an unselected one is kept as it is. Refuses an arm whose config
    differs from the one it was trained with, or arms of another preset."""
    known = {arm.name for arm, _ in configs}
    strangers = sorted(p.parent.name for p in (run_dir / "arms").glob("*/arm.yaml")
                       if p.parent.name not in known)
    if strangers:
        raise ConfigError(f"{run_dir} holds arm(s) {', '.join(strangers)}, not arms of this "
                          f"preset or grid ({', '.join(sorted(known))}); choose another --run-dir")
    jobs = []
    for arm, cfg in configs:
        job = ArmJob(arm, cfg, run_dir / "arms" / arm.name)
        present = (job.folder / "arm.yaml").exists()
        chosen = selected is None or arm.name in selected
        if present:
            _check_same_config(job)
            earlier = _earlier_result(job)
            if _finished(earlier, cfg) or not chosen:
                job.earlier = earlier
        if present or chosen:
            jobs.append(job)
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
    with written_whole(cfg_path) as f:
        f.write(dump_yaml(job.cfg))
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    command = arm_command(cfg_path, job.run_dir, nproc)
    log_path = job.folder / "train.log"
    # Appended: an arm trained again (the same command continues a grid) keeps
    # the output of its earlier attempts, the failure a user debugs among them.
    attempt = 1 + _attempts_logged(log_path)
    earlier, started = _record(job.folder), time.time()
    # recorded before it runs: if the runner is stopped, the curve still tells
    # this attempt's records from those of the attempt before
    _write_record(job, None, earlier.get("wall_s", 0.0), earlier.get("starts", []) + [started])
    with open(log_path, "a") as log:
        log.write(f"{ATTEMPT}{attempt}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}: "
                  f"{' '.join(command)} =====\n")
        log.flush()
        proc = start_run(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, started


def _attempts_logged(log_path: Path) -> int:
    if not log_path.exists():
        return 0
    with open(log_path, errors="replace") as log:
        return sum(line.startswith(ATTEMPT) for line in log)


def _write_record(job: ArmJob, code: Optional[int], wall: float, starts: list[float]) -> None:
    with written_whole(job.folder / RESULT) as f:
        f.write(json.dumps({"exit_code": code, "wall_s": round(wall, 1), "starts": starts}))


def _finish(job: ArmJob, code: int, started: float, how: str) -> ArmResult:
    """``how``: how its process ended, in words (``children.ended``)."""
    wall = time.time() - started
    record = _record(job.folder)
    starts = record.get("starts") or [started]
    total = record.get("wall_s", 0.0) + wall  # an arm trained again: all its attempts
    rows = _curve(job, starts)
    write_results(rows, job.folder / "curve.csv")
    _write_record(job, code, total, starts)
    result = ArmResult(job.arm.name, rows, total, code, _params(job.cfg),
                       hop_errors_from_metrics(job.run_dir / "metrics.jsonl"))
    if code != 0:
        status = f"FAILED ({how}; see {job.folder / 'train.log'})"
    elif _finished(result, job.cfg):
        status = "done"
    else:  # stopped on request (a signal, train.exit_duration_minutes): it saved a checkpoint
        done, steps = _checkpointed(job), total_steps(job.cfg)[0]
        status = (f"stopped short of step {steps}; it continues from its checkpoint of step "
                  f"{done}" if done is not None else
                  f"stopped short of step {steps}, with no checkpoint: it starts over")
    print(f"[{job.arm.name}] {status} in {wall:.0f} s", flush=True)
    return result


def _checkpointed(job: ArmJob) -> Optional[int]:
    """The iteration of the arm's latest checkpoint (None: none)."""
    latest, _ = read_tracker(checkpoint_folder(job.cfg.checkpoint.dir, job.run_dir))
    return iteration_of(latest) if latest is not None else None


def _params(cfg: RunConfig) -> dict:
    """The arm's parameters as it trains them: the vocabulary padded for its TP."""
    n = count_params(cfg.model, cfg.parallel.tensor)
    return {"total": int(n.total), "non_embedding": int(n.non_embedding)}


def run_arms(jobs: list[ArmJob], workers: int = 1, threads: int = 0,
             nproc: int = 1) -> list[ArmResult]:
    """Trains every job, ``workers`` at a time; results in the jobs' order. Stopped
    (Ctrl-C, SIGTERM), it stops the running arms at a step with a checkpoint, records
    them and raises the stop (``children``); killed, its arms stop by themselves."""
    by_name = {j.arm.name: j for j in jobs}
    started: dict[str, float] = {}
    done: dict[str, ArmResult] = {}

    def start(name: str) -> subprocess.Popen:
        job = by_name[name]
        print(f"[{name}] kvtrain train {job.folder / 'arm.yaml'} --run-dir {job.run_dir}",
              flush=True)
        proc, started[name] = _start(job, threads, nproc)
        return proc

    def finish(name: str, proc: subprocess.Popen) -> None:
        done[name] = _finish(by_name[name], proc.returncode, started[name], ended(proc))

    run_all(list(by_name), start, finish, workers,
            lambda names: f"kvtrain: {', '.join(names)} stopped: the same command continues them")
    return [done[j.arm.name] for j in jobs]


def run_experiment(configs: list[tuple[Arm, RunConfig]], run_dir: str | Path,
                   spec: dict, workers: int = 1, threads: int = 0, nproc: int = 1,
                   title: Optional[str] = None, selected: Optional[list[str]] = None) -> dict:
    """Trains the ``selected`` arms (None: all) that are not finished in the
    folder and writes results.csv, accuracy.png, loss.png, summary.json and
    spec.json (``spec`` plus the run's layout) of every arm the folder then
    holds (``arm_jobs``). Returns the summary."""
    run_dir = Path(run_dir)
    jobs = arm_jobs(configs, run_dir, selected)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "arms": [j.arm.name for j in jobs], "workers": workers, "threads": threads,
            "nproc": nproc, "commands": [" ".join(arm_command(j.folder / "arm.yaml", j.run_dir,
                                                                nproc)) for j in jobs]}
    with written_whole(run_dir / "spec.json") as f:
        f.write(json.dumps(spec, indent=2))
    t0 = time.time()
    for job in jobs:
        if job.earlier is not None:
            state = "finished earlier" if _finished(job.earlier, job.cfg) else "not selected"
            print(f"[{job.arm.name}] {state}: kept ({job.run_dir})", flush=True)
    trained = run_arms([j for j in jobs if j.earlier is None], workers, threads, nproc)
    by_name = {r.arm: r for r in trained}
    results = [j.earlier or by_name[j.arm.name] for j in jobs]
    rows = [row for r in results for row in r.rows]
    write_results(rows, run_dir / "results.csv")
    names = [r.arm for r in results]
    title = title or run_dir.name
    plot_curves(rows, run_dir / "accuracy.png", "accuracy", title=title, arms=names)
    plot_curves(rows, run_dir / "loss.png", "loss", title=title, arms=names)
    if any(r.hop_errors for r in results):  # the k-hop task: Figure 8
        plot_hop_errors(results, run_dir / "hop_errors.png", title=title)
    summary = summarize(results, time.time() - t0)
    summary.update(run_dir=str(run_dir), **{k: spec[k] for k in ("workers", "threads", "nproc")})
    for key in ("preset", "scale", "overrides"):
        if key in spec:
            summary[key] = spec[key]
    with written_whole(run_dir / "summary.json") as f:
        f.write(summary_json(summary))
    return summary
