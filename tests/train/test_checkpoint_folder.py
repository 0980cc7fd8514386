"""Where a run's checkpoints go (``checkpoint.dir``): ``~`` is the user's home
folder, as for ``--run-dir`` (the data cache and wandb folders expand it too);
a relative folder is under the run folder, not the working directory.

Each test is one launch of the test driver (tests/train/driver.py), with the
working directory and ``HOME`` it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import DRIVER, metrics, run, run_driver, tiny_config, write_config


def _launch(tmp_path: Path, config: Path, run_dir: Path, cwd: Path, name: str = "plan",
            overrides: tuple = (), env: dict | None = None):
    """One training of ``config`` in ``run_dir``, started from ``cwd``."""
    cwd.mkdir(exist_ok=True)
    plan = tmp_path / f"{name}.json"
    plan.write_text(json.dumps([{"config": str(config), "run_dir": str(run_dir),
                                 "overrides": list(overrides), "env": env or {}}]))
    done = run([str(plan)], script=DRIVER, cwd=cwd)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def test_a_checkpoint_dir_under_home_is_expanded(tmp_path, cache_dir):
    """``checkpoint.dir: ~/ck`` and ``data.cache_dir: ~/cache`` are folders of the
    home folder, not folders named '~' in the working directory. (HOME is the
    session's folder, where the shared index cache is: no index is built again.)"""
    home, cwd, ck = cache_dir.parent, tmp_path / "cwd", f"{tmp_path.name}-ck"
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 2}, data={"cache_dir": f"~/{cache_dir.name}"},
        checkpoint={"save_interval": 2, "keep_last": None, "dir": f"~/{ck}"}))
    _launch(tmp_path, config, tmp_path / "run", cwd, env={"HOME": str(home)})
    assert not (cwd / "~").exists(), "a folder named '~' in the working directory"
    assert (home / ck / "latest").read_text().strip() == "iter_0000002"


def test_a_relative_checkpoint_dir_is_under_the_run_folder(tmp_path, cache_dir):
    """``checkpoint.dir: ck`` is ``<run_dir>/ck`` whatever the working directory:
    the same run restarted from another directory (a job script that changes
    directory) resumes. A start that finds no checkpoint in a run folder with
    records (here: checkpoint.dir changed) drops them, and keeps them in a copy."""
    from kvtrain.config import checkpoint_folder

    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 4},
        checkpoint={"save_interval": 2, "keep_last": None, "dir": "ck"}))
    run_dir = tmp_path / "run"
    job = {"config": str(config), "run_dir": str(run_dir)}
    jobs = [dict(job, cwd=str(tmp_path / "here")),
            dict(job, cwd=str(tmp_path / "there"), overrides=["train.max_steps=6"]),
            dict(job, overrides=["checkpoint.dir=elsewhere", "train.max_steps=2"])]
    for where in ("here", "there"):
        (tmp_path / where).mkdir()
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {run_dir / 'ck' / 'iter_0000004'} at iteration 4" in result.stdout
    assert not (tmp_path / "here" / "ck").exists() and not (tmp_path / "there" / "ck").exists()
    assert (run_dir / "elsewhere" / "latest").read_text().strip() == "iter_0000002"
    assert [r["iteration"] for r in metrics(run_dir)] == [1, 2]
    (copy,) = run_dir.glob("metrics.jsonl.before-0-*")
    kept = [json.loads(line) for line in copy.read_text().splitlines()]
    assert [r["iteration"] for r in kept if r["kind"] == "train"] == list(range(1, 7))
    assert checkpoint_folder("~/ck", run_dir) == Path("~/ck").expanduser()
    assert checkpoint_folder(None, run_dir) == run_dir / "checkpoints"
