"""The export that ``kvtrain eval`` caches in a run folder, with several
evaluations of one checkpoint at once (a task list each, started together):
one exports while the others wait, and no export replaces a folder another
evaluation still reads. The export itself is a stand-in here (a folder with a
``config.json`` that says which export wrote it); the real one is
``tests/eval/test_eval_run.py``'s."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from kvtrain.evaluate import source


@pytest.fixture
def exports(tmp_path, monkeypatch):
    """The stand-in export: slow enough for the others to arrive while it runs;
    a list of (start, end) times, one per export."""
    done = []

    def export(checkpoint, out_dir, dtype):
        started = time.monotonic()
        time.sleep(0.4)
        work = out_dir.with_name(f".{out_dir.name}.partial")
        work.mkdir()
        (work / "config.json").write_text(f"export {len(done)}")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        work.rename(out_dir)
        done.append((started, time.monotonic()))
        return out_dir

    monkeypatch.setattr(source, "_export", export)
    checkpoint = tmp_path / "run" / "checkpoints" / "iter_0000004"
    checkpoint.mkdir(parents=True)
    (checkpoint / "common.pt").write_bytes(b"weights")
    return checkpoint, done


def _evaluate(checkpoint, seen, hold=0.0, holding=None):
    with source.cached_export(checkpoint, 4, checkpoint.parent.parent, "fp32") as folder:
        text = (folder / "config.json").read_text()
        if holding is not None:
            holding.set()
        time.sleep(hold)  # the evaluation, reading the export
        seen.append((text, (folder / "config.json").read_text(), time.monotonic()))


def test_evaluations_started_together_export_once(exports, capfd):
    checkpoint, done = exports
    seen = []
    threads = [threading.Thread(target=_evaluate, args=(checkpoint, seen)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(done) == 1, done  # without the lock, each thread exported it
    assert [s[:2] for s in seen] == [("export 0", "export 0")] * 3
    # the others said why they waited: for the export, or (when all came before it
    # started) for the one that took it first
    assert "kvtrain eval: waiting for another kvtrain eval that " in capfd.readouterr().err


def test_a_stale_export_is_not_replaced_while_it_is_read(exports):
    """The checkpoint changed (saved again under the same name) while an
    evaluation reads the old export: the new export waits for it to finish."""
    checkpoint, done = exports
    seen = []
    _evaluate(checkpoint, seen)
    holding = threading.Event()
    reader = threading.Thread(target=_evaluate, args=(checkpoint, seen, 1.0, holding))
    reader.start()
    assert holding.wait(30)  # the reader holds the export
    (checkpoint / "common.pt").write_bytes(b"weights, saved again")
    _evaluate(checkpoint, seen)
    reader.join()
    assert len(done) == 2
    assert seen[1][:2] == ("export 0", "export 0")  # the reader's folder stayed whole
    assert done[1][0] >= seen[1][2]  # the new export started after the reader finished
    assert seen[2][:2] == ("export 1", "export 1")
