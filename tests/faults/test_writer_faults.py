"""A process that writes a checkpoint dies (the kernel's out-of-memory killer
sends SIGKILL): the save fails in one line on every rank, naming the rank and
the process, and ``latest`` keeps naming the previous checkpoint. Before,
megatron's writer waited for a dead write-bucket process forever, and the run
hung silently at that save (synchronous) or at the next one (asynchronous)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.train.conftest import run_driver, tiny_config, write_config

CK = "checkpoints"


def _it(n: int) -> str:
    return f"iter_{n:07d}"


def _config(tmp_path, cache_dir, name: str, async_save: bool):
    return str(write_config(tmp_path / f"{name}.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 4},
        checkpoint={"save_interval": 2, "keep_last": None, "async_save": async_save})))


def _errors(out: str) -> list[str]:
    # (the two ranks share the pipe: their lines may run together)
    return re.findall(r"kvtrain: checkpoint error: (saving the checkpoint of iteration 4 .*?) "
                      r"is unchanged", out)


KILLED = (r" was killed by SIGKILL \(what the kernel's out-of-memory killer sends: "
          r"see dmesg\)")
LOST = (r" ended before writing its part, its exit status already taken \(the kernel's "
        r"out-of-memory killer is the likely cause: see dmesg\)")


def _failed(reason: str, latest: Path, removed: bool = True, how: str = KILLED) -> re.Pattern:
    return re.compile(r"saving the checkpoint of iteration 4 \(iter_0000004.incomplete\) "
                      rf"failed: rank 0: {reason}{how}; "
                      + ("the incomplete folder was removed and " if removed else "")
                      + re.escape(str(latest)) + "$")


def test_an_async_writer_that_dies_fails_the_save_on_every_rank(tmp_path, cache_dir):
    """Two ranks, asynchronous saves: on rank 0 a write bucket's process dies; rank 1
    stops with rank 0's reason. (Rank 1 of this layout writes nothing: rank 0
    writes the replicated state.)"""
    config = _config(tmp_path, cache_dir, "async", True)
    jobs = [{"config": config, "run_dir": str(tmp_path / "bucket"), "expect": 2,
             "faults": {"kill_writer_in_save": [4, 0, "bucket"]}}]
    result = run_driver(jobs, tmp_path / "plan.json", nproc=2, timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = _errors(out)
    ck = tmp_path / "bucket" / CK
    bucket = _failed(r"a checkpoint writer process \(pid \d+, forked by the writer \d+\)",
                     ck / "latest")
    assert len(errors) == 1 and all(bucket.match(e) for e in errors), out[-4000:]  # once
    assert (ck / "latest").read_text().strip() == _it(2)
    assert not list(ck.glob("*.incomplete")) and not (ck / _it(4)).exists()


def _one_process_saves(tmp_path, cache_dir, async_fault: str, sync_fault: str):
    """One rank: an asynchronous run whose save of 4 loses ``async_fault``'s process,
    a synchronous one that loses ``sync_fault``'s, then that one's resume to the end.
    The two lines; each run keeps ``latest`` at its last good save, no incomplete
    folder left."""
    writer, sync = tmp_path / "writer", tmp_path / "sync"
    jobs = [{"config": _config(tmp_path, cache_dir, "async", True), "run_dir": str(writer),
             "expect": 2, "faults": {"kill_writer_in_save": [4, 0, async_fault]}},
            {"config": _config(tmp_path, cache_dir, "sync", False), "run_dir": str(sync),
             "expect": 2, "faults": {"kill_writer_in_save": [4, 0, sync_fault]}},
            {"config": _config(tmp_path, cache_dir, "sync", False), "run_dir": str(sync)}]
    result = run_driver(jobs, tmp_path / "plan.json", timeout=300)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    errors = _errors(out)
    assert len(errors) == 2, out[-4000:]
    assert (writer / CK / "latest").read_text().strip() == _it(2)
    assert (sync / CK / "latest").read_text().strip() == _it(4)  # the resume's
    for ck in (writer / CK, sync / CK):
        assert not list(ck.glob("*.incomplete"))
    return errors, writer / CK / "latest", sync / CK / "latest"


def test_a_dead_writer_in_one_process_async_or_sync_is_one_line(tmp_path, cache_dir):
    """One rank. Asynchronous: megatron's writer itself dies (megatron said
    "CheckpointException ranks:dict_keys([0])"). Synchronous: the trainer itself
    waits for the write buckets, so the watch ends the process (exit 2) with the
    line; the resume goes on from the checkpoint of 2 to the end."""
    errors, writer, sync = _one_process_saves(tmp_path, cache_dir, "writer", "bucket")
    assert _failed(r"the checkpoint writer process \(pid \d+\)", writer).match(errors[0]), \
        errors[0]
    assert _failed(r"a checkpoint writer process \(pid \d+\)", sync, removed=False
                   ).match(errors[1]), errors[1]


def test_a_writer_whose_exit_status_is_gone_fails_the_save_not_hangs(tmp_path, cache_dir):
    """The first write bucket dies as it starts, and its parent waits for it as it
    starts the next one (multiprocessing does, at every start): no zombie is left
    to say how it ended, and megatron waits for its part forever. Its siblings
    ended and were not waited for: the save fails in one line, asynchronous (the
    writer's buckets) and synchronous (the trainer's own); the resume goes on."""
    errors, writer, sync = _one_process_saves(tmp_path, cache_dir, "first_bucket",
                                              "first_bucket")
    assert _failed(r"a checkpoint writer process \(forked by the writer \d+\)", writer,
                   how=LOST).match(errors[0]), errors[0]
    assert _failed("a checkpoint writer process", sync, removed=False, how=LOST
                   ).match(errors[1]), errors[1]


def test_dead_children_are_found_with_their_wait_status():
    """``/proc``: the children of a process (by ``task/*/children`` or by a scan),
    the wait status of one that died and was not waited for, and a parent left
    waiting by children that all ended."""
    import os
    import subprocess
    import time

    from kvtrain.train import writer_watch as w

    alive = subprocess.Popen(["sleep", "30"])
    killed = subprocess.Popen(["sh", "-c", "kill -9 $$"])
    failed = subprocess.Popen(["sh", "-c", "exit 3"])
    clean = subprocess.Popen(["true"])
    try:
        time.sleep(0.5)
        mine = {alive.pid, killed.pid, failed.pid, clean.pid}
        assert mine <= set(w.children(os.getpid())) and mine <= set(w._scan_children(os.getpid()))
        assert w.ended(alive.pid) is None  # running
        assert w.how(w.ended(killed.pid)).startswith("was killed by SIGKILL (what the kernel")
        assert w.how(w.ended(failed.pid)) == "exited with status 3"
        assert w.how(w.ended(clean.pid)) is None  # a clean exit is no failure
        reason = w.dead_writer((), forked_by=os.getpid(), since=frozenset({killed.pid}))
        assert reason == f"a checkpoint writer process (pid {failed.pid}) exited with status 3"
        # a save is left waiting once every process it forked has ended, unwaited for
        waits, me = w.LeftWaiting(after_s=0.3), os.getpid()
        assert waits.check({me: [clean.pid, alive.pid]}) is None  # one still writes
        assert waits.check({me: [clean.pid]}) is None  # all ended: the clock starts
        time.sleep(0.35)
        assert waits.check({me: [clean.pid, failed.pid], 1: [alive.pid]}) == me
        assert waits.check({me: []}) is None  # none forked (before the buckets, after their wait)
        assert waits.check({me: [clean.pid]}) is None  # the clock starts again
        time.sleep(0.35)
        assert waits.check({}) is None  # its save ended: forgotten, as its pid may come back
        assert waits.check({me: [clean.pid]}) is None
    finally:
        alive.kill()
        for p in (alive, killed, failed, clean):
            p.wait()
    assert w.ended(killed.pid) is None  # waited for: gone


def test_a_writer_that_dies_between_the_check_and_megatrons_finalize_is_named():
    """The watch looked before the writer died, megatron's finalize after it: its
    ``CheckpointException ranks:dict_keys([0])`` was the line, not the writer's death
    (a clean clone's run of the test above, once). The dead writer is named then too;
    an exception with every writer alive is megatron's own."""
    from types import SimpleNamespace

    import pytest
    from torch.distributed.checkpoint.api import CheckpointException

    from kvtrain.train import writer_watch as w
    from kvtrain.train.integrity import SaveFailed

    writer = SimpleNamespace(pid=4321, exitcode=None)

    def finalize(blocking):  # the writer dies as megatron looks
        writer.exitcode = -9
        raise CheckpointException("async save failed", {0: (RuntimeError("x"), "")})

    queue = SimpleNamespace(async_calls=[SimpleNamespace(
        async_caller=SimpleNamespace(process=writer))], maybe_finalize_async_calls=finalize)
    with pytest.raises(SaveFailed, match=r"^rank 0: the checkpoint writer process \(pid 4321\) "
                                         r"was killed by SIGKILL"):
        w.finalize_async(queue, rank=0)
    writer.exitcode = None
    queue.maybe_finalize_async_calls = lambda blocking: (_ for _ in ()).throw(
        CheckpointException("other", {}))
    with pytest.raises(CheckpointException):
        w.finalize_async(queue, rank=0)
