"""A checkpoint that another process reads (``kvtrain eval``, ``export``,
``generate`` of a run still training) is not deleted under it by the
trainer's ``keep_last``: the reader holds it (``checkpoint_readers.reading``),
the trainer's pruning (``checkpoint.prune``) keeps it until a later save, and
a reader whose checkpoint went before it held it looks again."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvtrain.config import ConfigError
from kvtrain.inference import loading
from kvtrain.train.checkpoint import prune
from kvtrain.train.checkpoint_readers import reading
from kvtrain.train.integrity import MARKER


def _complete(root: Path, iteration: int) -> Path:
    """A folder that counts as a complete checkpoint (its marker, no files listed)."""
    path = root / f"iter_{iteration:07d}"
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"iteration": iteration,
                                           "manifest": {"files": {}}}))
    (path / "metadata.json").write_text("{}")
    (root / "latest").write_text(path.name + "\n")
    (root / ".kvtrain.lock").touch()  # a trainer's checkpoint folder
    return path


def test_keep_last_keeps_a_checkpoint_while_it_is_read(tmp_path):
    root = tmp_path / "checkpoints"
    two, four, six = (_complete(root, i) for i in (2, 4, 6))
    with reading(two) as there:  # an export loading iter 2 while the run saves iter 6
        assert there
        prune(root, keep=six, keep_last=1)
        assert two.is_dir() and not four.exists()  # read: kept; not read: removed
        assert (two / MARKER).is_file()
    prune(root, keep=six, keep_last=1)  # the next save
    assert sorted(p.name for p in root.iterdir()) == [".kvtrain.lock", "iter_0000006", "latest"]


def test_a_checkpoint_outside_a_trainers_folder_gets_no_lock_file(tmp_path):
    """An exported or copied checkpoint (no trainer's .kvtrain.lock beside it):
    nothing prunes there, and nothing is written beside it."""
    copy = tmp_path / "ckpt"
    copy.mkdir()
    with reading(copy) as there:
        assert there
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_a_reader_whose_checkpoint_went_looks_again(tmp_path, monkeypatch):
    """keep_last removed the checkpoint between the reader finding it and holding
    it: the reader takes the one found next, and says so in one line when every
    try lost its checkpoint that way."""
    run = tmp_path / "run"
    root = run / "checkpoints"
    _complete(root, 2)
    _complete(root, 4)
    real_find = loading.find_checkpoint
    found = []

    def find_then_lose(source):  # the trainer's save removes what was just found
        path = real_find(source)
        found.append(path.name)
        if len(found) == 1:
            shutil.rmtree(path)
            (root / "latest").write_text("iter_0000002\n")
        return path

    monkeypatch.setattr(loading, "find_checkpoint", find_then_lose)
    monkeypatch.setattr(loading, "_load", lambda path, backend, dtype: path)
    assert loading.load_model(run) == root / "iter_0000002"
    assert found == ["iter_0000004", "iter_0000002"]

    def lose_every_time(source):
        path = real_find(source)
        return path.with_name("iter_0000009")  # found, then gone

    monkeypatch.setattr(loading, "find_checkpoint", lose_every_time)
    with pytest.raises(ConfigError, match="its checkpoints were deleted as they were found, "
                                          "three times"):
        loading.load_model(run)


def test_a_lock_file_that_cannot_be_opened_reads_as_before(tmp_path):
    """Where the reader cannot make its lock file (another user's run folder; here a
    folder in its place, as root may write anywhere) it reads unprotected."""
    from kvtrain.train.checkpoint_readers import lock_file

    two = _complete(tmp_path / "checkpoints", 2)
    lock_file(two).mkdir()
    with reading(two) as there:
        assert there


def _rank_loads(rank: int, world: int, run: str) -> str:
    """One rank of a TP=2 `kvtrain generate`: the trainer saves iter 6 between the
    two ranks' lookups, so each rank on its own would find another checkpoint."""
    root = Path(run) / "checkpoints"
    own = {0: root / "iter_0000004", 1: root / "iter_0000006"}[rank]
    loading.find_checkpoint = lambda source: own
    loading._load = lambda path, backend, dtype: path
    return loading.load_model(run).name


def test_every_rank_loads_the_checkpoint_rank_0_found(tmp_path):
    """Ranks that each looked the checkpoint up loaded different ones when a save
    came between their lookups: a model of mixed weights, silently."""
    from kvtrain.testing import run_distributed

    run = tmp_path / "run"
    for iteration in (4, 6):
        _complete(run / "checkpoints", iteration)
    assert run_distributed(_rank_loads, 2, str(run)) == ["iter_0000004", "iter_0000004"]
