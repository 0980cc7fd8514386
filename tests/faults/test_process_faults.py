"""Item 4: the ranks and their helpers die with the launcher, and a run folder
has one writer.

A 2-rank torchrun training (asynchronous saves every step, so the checkpoint
writer's processes exist; wandb offline, so wandb-core runs) has its torchrun
SIGKILLed - torchrun alone, not its process group, as when a node agent or an
OOM killer takes the launcher: every process that descended from torchrun
must be gone within seconds. While it runs, a second ``kvtrain train`` on the
same run folder is refused in one line naming the holder's host and pid; a
dead holder's lock is taken over (the second test, with a plain process).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import psutil

from tests.scripts import python_path
from tests.train.conftest import metrics, run, start, tiny_config, wait_for, write_config


def _descendants(pid: int) -> set[tuple[int, float]]:
    try:
        procs = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    out = set()
    for p in procs:
        try:
            out.add((p.pid, p.create_time()))
        except psutil.NoSuchProcess:
            pass
    return out


def _alive(procs: set[tuple[int, float]]) -> list[str]:
    left = []
    for pid, created in procs:
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {' '.join(p.cmdline())[:120]}")
        except psutil.NoSuchProcess:
            pass
    return left


def test_launcher_kill_takes_ranks_and_helpers_and_the_folder_has_one_writer(
        tmp_path, corpus, cache_dir):
    run_dir = tmp_path / "run"
    cfg = tiny_config(corpus, cache_dir, train={"max_steps": 100000, "log_interval": 1},
                      checkpoint={"save_interval": 1, "keep_last": 2, "async_save": True},
                      wandb={"enabled": True, "mode": "offline"})
    config = write_config(tmp_path / "c.yaml", cfg)
    args = ["train", str(config), "--run-dir", str(run_dir)]
    holder = start(args, nproc=2, log=tmp_path / "holder.log")
    seen: set[tuple[int, float]] = set()
    try:
        wait_for(lambda: len(metrics(run_dir)) >= 2 or holder.poll() is not None, 180,
                 "the holder's first steps")
        assert holder.poll() is None, (tmp_path / "holder.log").read_text()[-3000:]

        # a second writer is refused, in one line naming the holder
        # (beside the 2-rank holder on 2 slow cores a start took over 120 s)
        second = run(args + ["--set", "train.max_steps=1"], timeout=300)
        assert second.returncode == 2, second.stdout[-1000:] + second.stderr[-2000:]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "in use" in lines[0], second.stderr[-2000:]
        assert socket.gethostname() in lines[0] and "pid" in lines[0], lines[0]

        deadline = time.monotonic() + 1.5  # catch the writer's short-lived processes too
        while time.monotonic() < deadline:
            seen |= _descendants(holder.pid)
            time.sleep(0.05)
        names = {psutil.Process(p).name() for p, _ in seen if _alive({(p, _)})}
        assert len(seen) >= 3, names  # two ranks and their helpers
        os.kill(holder.pid, signal.SIGKILL)  # torchrun only, not its process group
        holder.wait(timeout=30)
        deadline = time.monotonic() + 10
        while _alive(seen) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _alive(seen), f"left running after torchrun was killed: {_alive(seen)}"
    finally:
        seen |= _descendants(holder.pid)
        for pid, _ in seen:  # never leave them behind, even when the test fails
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            os.killpg(holder.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_run_lock_names_its_holder_and_a_dead_holders_lock_is_taken_over(tmp_path):
    from kvtrain.config import ConfigError
    from kvtrain.train.runlock import hold_run_folder

    holder = _hold_lock(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "locked"
        try:
            hold_run_folder(tmp_path)
            raise AssertionError("a folder in use was not refused")
        except ConfigError as e:
            message = str(e)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message, message
        assert "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    lock = hold_run_folder(tmp_path)  # the holder died: its lock is free
    assert lock is not None
    lock.release()


def test_a_refusal_under_torchrun_is_one_line_a_node(tmp_path, cache_dir):
    """Bare torchrun, 2 ranks: a config error (each rank reads the same file), a
    missing shard (each rank finds it as the run is built) and a run folder in use
    (rank 0 finds it, a collective tells the others) are said once, by the node's
    first rank; every rank printed them."""
    config = write_config(tmp_path / "c.yaml", tiny_config(None, cache_dir))
    run_dir = tmp_path / "run"
    bad = run(["train", str(config), "--run-dir", str(run_dir), "--set", "train.max_step=3"],
              nproc=2, timeout=300)
    assert bad.returncode != 0
    lines = [line for line in bad.stderr.splitlines() if line.startswith("kvtrain: ")]
    assert lines == ["kvtrain: config error: --set: unknown key 'train.max_step' (did you "
                     "mean 'train.max_steps'?)"], bad.stderr[-3000:]
    missing = tmp_path / "shards" / "gone_text_document"  # found as the run is built
    data = {"type": "gpt", "paths": [str(missing)], "tokenizer": str(tmp_path / "t.model"),
            "num_workers": 0, "cache_dir": str(cache_dir)}
    shardless = write_config(tmp_path / "d.yaml", tiny_config(None, cache_dir, data=data))
    gone = run(["train", str(shardless), "--run-dir", str(run_dir)], nproc=2, timeout=300)
    assert gone.returncode != 0
    lines = [line for line in gone.stderr.splitlines() if line.startswith("kvtrain: ")
             and "error" in line]
    assert lines == [f"kvtrain: config error: data.paths: shard {missing}.idx does not "
                     "exist"], gone.stderr[-3000:]
    assert not run_dir.exists()  # refused: no new folder left
    holder = _hold_lock(run_dir)
    try:
        assert holder.stdout.readline().strip() == "locked"
        busy = run(["train", str(config), "--run-dir", str(run_dir)], nproc=2, timeout=300)
    finally:
        holder.kill()
        holder.wait()
    assert busy.returncode != 0
    lines = [line for line in busy.stderr.splitlines() if line.startswith("kvtrain: ")]
    assert len(lines) == 1 and f"is in use by kvtrain pid {holder.pid}" in lines[0], \
        busy.stderr[-3000:]


def test_a_nodes_other_rank_says_an_agreed_refusal_when_left_alone(monkeypatch, capsys):
    """Without a torchrun that ends it (or a first rank that says it), a node's other
    rank says the line itself after its wait; the line of a refusal not marked as
    every rank's is said at once by every rank."""
    from kvtrain.cli import report
    from kvtrain.config import ConfigError, on_every_rank

    monkeypatch.setenv("LOCAL_RANK", "1")
    report(on_every_rank(ConfigError("agreed")), others_wait=0.01)
    report(on_every_rank(ConfigError("unsaid")), others_wait=None)
    report(ConfigError("own"))
    assert capsys.readouterr().err == "kvtrain: config error: agreed\nkvtrain: config error: own\n"


def test_a_requeued_job_waits_for_its_own_earlier_starts_lock(tmp_path, monkeypatch, capsys):
    """On NFS the server keeps a dead node's lock until its lease ends (90 s): the
    requeued job (same SLURM job id, restart count + 1) found its own earlier
    start's lock and was refused. It now waits for it, saying so; another job's
    lock, or one of the same start, is refused at once; a wait that runs out
    says how long it waited."""
    from kvtrain.config import ConfigError
    from kvtrain.train.runlock import hold_run_folder

    def refused(wait):
        started = time.monotonic()
        try:
            hold_run_folder(tmp_path, wait=wait)
        except ConfigError as e:
            return str(e), time.monotonic() - started
        raise AssertionError("a folder in use was not refused")

    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    holder = _hold_lock(tmp_path, seconds=600)  # restart 0 of job 4242
    try:
        assert holder.stdout.readline().strip() == "locked"
        message, seconds = refused(30)  # the same start: not waited for
        assert seconds < 5 and "(SLURM job 4242 restart 0)" in message, message
        monkeypatch.setenv("SLURM_JOB_ID", "4243")
        monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
        message, seconds = refused(30)  # another job
        assert seconds < 5 and "did not drop" not in message, message
        monkeypatch.setenv("SLURM_JOB_ID", "4242")
        message, seconds = refused(2)  # the earlier start of this job: waited for
        assert seconds >= 2 and "\n" not in message, message
        assert f"pid {holder.pid} on host {socket.gethostname()} (SLURM job 4242 restart 0)" \
            ", since " in message, message
        assert message.endswith(f"(lock {tmp_path.resolve()}/.kvtrain.lock); this job's "
                                "earlier start did not drop it within 2 s; one run writes "
                                "to a folder at a time"), message
    finally:
        holder.kill()
        holder.wait()
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    holder = _hold_lock(tmp_path, seconds=2)
    assert holder.stdout.readline().strip() == "locked"
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    capsys.readouterr()
    lock = hold_run_folder(tmp_path, wait=60)  # restart 1 waits, then holds it
    holder.wait()
    assert lock is not None
    out = capsys.readouterr().out
    assert f"is still locked by this job's earlier start, pid {holder.pid} on host " in out, out
    assert json.loads((tmp_path / ".kvtrain.lock").read_text())["slurm_restart"] == 1
    lock.release()


def test_a_refused_start_removes_only_what_it_wrote_into_a_folder_it_made(tmp_path):
    """``removed_on_bad_input``: the folder this process made (atomic mkdir) goes
    with the start's own files; anything else keeps it; a folder that existed
    keeps everything."""
    import pytest

    from kvtrain.config import ConfigError
    from kvtrain.train.runlock import removed_on_bad_input, try_lock

    def refused(run_dir, extra=()):
        lock, _ = try_lock(run_dir)
        (run_dir / "data_cache").mkdir(exist_ok=True)
        (run_dir / "config.yaml").write_text("name: x\n")
        for name in extra:
            (run_dir / name).write_text("{}")
        with pytest.raises(ConfigError):
            with removed_on_bad_input(run_dir, lock):
                raise ConfigError("a missing shard")
        assert lock.fd == -1  # released
        return lock.fresh

    assert refused(tmp_path / "new") and not (tmp_path / "new").exists()
    assert refused(tmp_path / "other", ["metrics.jsonl"])  # not the start's: stays
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["metrics.jsonl"]
    (tmp_path / "old").mkdir()
    assert not refused(tmp_path / "old")
    assert {p.name for p in (tmp_path / "old").iterdir()} >= {"config.yaml", "data_cache"}


def test_a_refused_start_removes_a_checkpoint_folder_it_made_elsewhere(tmp_path):
    """checkpoint.dir outside the run folder, made by this start: a refused start
    left it behind, empty but for its lock file; now it goes like the run folder
    (one that existed, or holds anything else, stays)."""
    import pytest

    from kvtrain.config import ConfigError
    from kvtrain.train.runlock import removed_on_bad_input, try_lock

    def refused(run_dir, ck):
        lock, _ = try_lock(run_dir)
        lock.hold_too(try_lock(ck)[0])
        with pytest.raises(ConfigError):
            with removed_on_bad_input(run_dir, lock):
                raise ConfigError("no room for config.yaml")

    refused(tmp_path / "run", tmp_path / "scratch" / "ck")
    assert not (tmp_path / "run").exists() and not (tmp_path / "scratch" / "ck").exists()
    (tmp_path / "old-ck").mkdir()
    refused(tmp_path / "run", tmp_path / "old-ck")
    assert (tmp_path / "old-ck" / ".kvtrain.lock").exists()


def test_a_checkpoint_folder_in_use_by_another_run_is_refused(tmp_path, cache_dir):
    """checkpoint.dir outside the run folder (scratch storage) is locked too: a run
    in another run folder on a checkpoint folder in use (held here by a plain
    process, as a running trainer holds it) is refused in one line before it
    touches anything: no run folder made, nothing added to the checkpoint folder."""
    shared = tmp_path / "scratch" / "ck"
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 2}, checkpoint={"dir": str(shared)}))
    holder = _hold_lock(shared)
    try:
        assert holder.stdout.readline().strip() == "locked"
        second = run(["train", str(config), "--run-dir", str(tmp_path / "b")])
    finally:
        holder.kill()
        holder.wait()
    lines = second.stderr.strip().splitlines()
    assert second.returncode == 2 and len(lines) == 1, second.stdout[-1500:] + second.stderr
    assert lines[0].startswith(f"kvtrain: config error: checkpoint folder {shared} is in use "
                               f"by kvtrain pid {holder.pid}"), lines[0]
    assert not (tmp_path / "b").exists()
    assert [p.name for p in shared.iterdir()] == [".kvtrain.lock"]


def _hold_lock(folder, seconds: float = 600):
    """Another process holding ``folder``'s lock (a live run's) for ``seconds``, in
    this process's environment: kill it when done."""
    import subprocess
    import sys

    return subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from kvtrain.train.runlock import try_lock; "
         "assert try_lock(Path(sys.argv[1]))[0]; print('locked', flush=True); "
         "time.sleep(float(sys.argv[2]))", str(folder), str(seconds)],
        stdout=subprocess.PIPE, text=True)



def _start_orphan(tmp_path, argv: list[str], launcher_waits: bool = False):
    """python ``argv`` as a rank (WORLD_SIZE set) whose launcher, a bash, exits a
    second after starting it (or waits for it); the launcher and the rank's output."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "out"
    repo = Path(__file__).resolve().parents[2]
    line = f"{shlex.join([sys.executable, *argv])} > {shlex.quote(str(out))} 2>&1"
    line += "; echo rc=$? >> " + shlex.quote(str(out)) if launcher_waits else " & sleep 1"
    launcher = subprocess.Popen(["bash", "-c", line], cwd=repo, env=dict(
        os.environ, WORLD_SIZE="2", LOCAL_RANK="0", PYTHONPATH=python_path()))
    return launcher, out


def test_a_rank_whose_launcher_died_during_its_imports_exits_at_once(tmp_path):
    """bind_to_launcher() runs after torch and megatron are imported (seconds); a
    launcher killed meanwhile left the rank re-parented, bound to its new parent
    (init or a subreaper), training on as an orphan. The CLI records the parent
    first thing; a rank whose parent changed since exits in one line."""
    bind = "from kvtrain.train.processes import bind_to_launcher; bind_to_launcher(); "
    recorded = ("from kvtrain.train.processes import record_launcher; record_launcher(); "
                "import time; time.sleep(2); " + bind + "print('orphan alive', flush=True)")
    cli = ["-m", "kvtrain.cli", "train", "tests/launch/tiny.yaml", "--run-dir",
           str(tmp_path / "run")]
    for argv in (["-c", recorded], cli):
        launcher, out = _start_orphan(tmp_path, argv)
        launcher.wait(timeout=30)
        wait_for(lambda: out.exists() and "exiting" in out.read_text(), 60, "the exit")
        text = out.read_text()
        assert "kvtrain: this rank's launcher exited before it bound to it" in text, text
        assert "orphan alive" not in text and not (tmp_path / "run").exists(), text
    # a launcher that waits: the rank binds to it and goes on
    launcher, out = _start_orphan(tmp_path, ["-c", recorded.replace("orphan", "bound")],
                                  launcher_waits=True)
    assert launcher.wait(timeout=30) == 0
    assert out.read_text().splitlines() == ["bound alive", "rc=0"], out.read_text()


def test_the_async_writers_queue_outlives_the_stop_signals(monkeypatch):
    """SLURM signals every process of the job: the results queue's manager process
    must survive SIGTERM/SIGUSR1 like the trainer does, or the save the trainer
    makes on that stop finds its queue gone."""
    from kvtrain.train import writer_queue

    monkeypatch.setattr(writer_queue, "_MANAGER", None)
    queue = writer_queue.results_queue(async_save=True)
    manager = writer_queue._MANAGER
    try:
        for sig in (signal.SIGUSR1, signal.SIGTERM):
            os.kill(manager._process.pid, sig)
        time.sleep(0.3)
        queue.put("written")
        assert queue.get(timeout=5) == "written"
    finally:
        manager.shutdown()


def test_loader_workers_outlive_the_stop_signals():
    """A stop signal to every process of the job step (`scancel --signal=USR1 JOB`
    without --batch, the time limit's SIGTERM) reaches the data loader workers
    too: they must go on serving batches while the trainer finishes its step and
    saves (launch/slurm.sbatch's header said they die of it)."""
    import torch

    from kvtrain.data import micro_batches

    data = [{"tokens": torch.tensor([i])} for i in range(64)]
    batches = micro_batches(data, 0, 2, 0, 1, num_workers=1)
    assert next(batches)["tokens"].tolist() == [[0], [1]]
    (worker,) = batches._workers
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        os.kill(worker.pid, sig)
    assert [next(batches)["tokens"].tolist() for _ in range(8)][-1] == [[16], [17]]
    assert worker.is_alive()
