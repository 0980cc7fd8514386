"""Where a run's checkpoints go (``checkpoint.dir``): ``~`` is the user's home
folder, as for ``--run-dir``; the data cache and wandb folders expand it too.

Each test is one launch of the test driver (tests/train/driver.py), with the
working directory and ``HOME`` it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import DRIVER, run, tiny_config, write_config


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
