"""Where a run's checkpoints go (``checkpoint.dir``): ``~`` is the user's home
folder, as for ``--run-dir`` (the data cache and wandb folders expand it too);
a relative folder is under the run folder, not the working directory (so is a
relative ``wandb.dir``).

Both are jobs of one launch of the test driver (tests/train/driver.py), each with
the working directory and ``HOME`` it needs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtrain.model import native_shift

from .conftest import metrics, run_driver, tiny_config, write_config


@pytest.fixture(scope="module")
def launched(tmp_path_factory, cache_dir):
    """One launch of the driver for both tests: the relative folder's three jobs,
    then the home folder's."""
    tmp_path = tmp_path_factory.mktemp("ck")
    relative = write_config(tmp_path / "rel.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 4},
        checkpoint={"save_interval": 2, "keep_last": None, "dir": "ck"}))
    # HOME is the session's folder, where the shared index cache is: no index is
    # built again
    home, ck = cache_dir.parent, f"{tmp_path.name}-ck"
    homed = write_config(tmp_path / "home.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 2}, data={"cache_dir": f"~/{cache_dir.name}"},
        checkpoint={"save_interval": 2, "keep_last": None, "dir": f"~/{ck}"}))
    run_dir = tmp_path / "run"
    job = {"config": str(relative), "run_dir": str(run_dir)}
    wandb = ["wandb.enabled=true", "wandb.mode=offline"]  # the two starts from step 0
    jobs = [dict(job, cwd=str(tmp_path / "here"), overrides=wandb),
            dict(job, cwd=str(tmp_path / "there"), overrides=["train.max_steps=6"]),
            dict(job, overrides=["checkpoint.dir=elsewhere", "train.max_steps=2", *wandb]),
            # the KV shift's native operators from the user's cache, as in every
            # other run: under a new HOME they were compiled again (~35 s of CPU)
            {"config": str(homed), "run_dir": str(tmp_path / "homed"),
             "cwd": str(tmp_path / "cwd"),
             "env": {"HOME": str(home), "KVTRAIN_KERNEL_CACHE": str(native_shift.cache_dir())},
             "overrides": ["wandb.dir=wb", *wandb]}]
    for where in ("here", "there", "cwd"):
        (tmp_path / where).mkdir()
    result = run_driver(jobs, tmp_path / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return {"root": tmp_path, "run_dir": run_dir, "home": home, "ck": ck,
            "stdout": result.stdout}


def test_a_checkpoint_dir_under_home_is_expanded(launched):
    """``checkpoint.dir: ~/ck`` and ``data.cache_dir: ~/cache`` are folders of the
    home folder, not folders named '~' in the working directory."""
    assert not (launched["root"] / "cwd" / "~").exists(), "a folder named '~' in the cwd"
    assert (launched["home"] / launched["ck"] / "latest").read_text().strip() == "iter_0000002"


def test_a_relative_wandb_dir_is_under_the_run_folder(launched):
    """``wandb.dir: wb`` is ``<run_dir>/wb``, as a relative ``checkpoint.dir`` is:
    it went to the working directory, so a job script that changes directory
    split a run's wandb files between folders (and, in a container, wrote them
    where nothing is mounted)."""
    from kvtrain.config import wandb_folder

    root = launched["root"]
    assert not (root / "cwd" / "wb").exists()
    assert len(list((root / "homed" / "wb" / "wandb").glob("offline-run-*"))) == 1
    assert wandb_folder("wb", root) == root / "wb"
    assert wandb_folder(None, root) == root
    assert wandb_folder("~/wb", root) == Path("~/wb").expanduser()


def test_a_relative_checkpoint_dir_is_under_the_run_folder(launched):
    """``checkpoint.dir: ck`` is ``<run_dir>/ck`` whatever the working directory:
    the same run restarted from another directory (a job script that changes
    directory) resumes. A start that finds no checkpoint in a run folder with
    records (here: checkpoint.dir changed) drops them, and keeps them in a copy;
    it opens a new wandb run."""
    from kvtrain.config import checkpoint_folder

    root, run_dir = launched["root"], launched["run_dir"]
    assert f"resumed from {run_dir / 'ck' / 'iter_0000004'} at iteration 4" in launched["stdout"]
    assert not (root / "here" / "ck").exists() and not (root / "there" / "ck").exists()
    assert (run_dir / "elsewhere" / "latest").read_text().strip() == "iter_0000002"
    assert [r["iteration"] for r in metrics(run_dir)] == [1, 2]
    (copy,) = run_dir.glob("metrics.jsonl.before-0-*")
    kept = [json.loads(line) for line in copy.read_text().splitlines()]
    assert [r["iteration"] for r in kept if r["kind"] == "train"] == list(range(1, 7))
    # ... and logs to a new wandb run: its steps from 0 would go backwards in the old one
    first, fresh = (p.name.rsplit("-", 1)[1] for p in
                    sorted((run_dir / "wandb").glob("offline-run-*")))
    assert first != fresh == (run_dir / "wandb_run_id").read_text().strip()
    assert f"a start from step 0 logs to a new wandb run {fresh}" in launched["stdout"]
    assert checkpoint_folder("~/ck", run_dir) == Path("~/ck").expanduser()
    assert checkpoint_folder(None, run_dir) == run_dir / "checkpoints"
