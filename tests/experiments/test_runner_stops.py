"""A runner of training runs (``kvtrain sweep``, ``kvtrain experiment``, ``kvtrain
demo``) stopped or killed takes its runs with it, each stopping at a step with a
checkpoint: none goes on training as an orphan in a folder the next command
continues (it found the folder locked by the orphan)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtrain.train.checkpoint import is_complete
from kvtrain.train.integrity import checkpoint_folders
from kvtrain.train.signals import SAME_PRESS_S
from tests.launch.conftest import REPO

TINY = str(REPO / "configs" / "tiny.yaml")
LONG = ["--set", "train.max_steps=100000", "--set", "train.log_interval=1",
        "--set", "checkpoint.save_interval=100000"]


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _trainer_pid(run: Path) -> int | None:
    """The pid of the trainer holding ``run`` once it has logged a step, else None."""
    lock, metrics = run / ".kvtrain.lock", run / "metrics.jsonl"
    if not (lock.exists() and metrics.exists() and '"train"' in metrics.read_text()):
        return None
    return json.loads(lock.read_text() or "{}").get("pid")


def _wait(what, seconds: float, proc: subprocess.Popen | None = None, out: Path | None = None):
    """``what()`` once it is truthy, within ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        value = what()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"the runner ended early ({proc.returncode}): {out.read_text()}")
        time.sleep(0.2)
    pytest.fail(f"not within {seconds} s")


def _stop_runner(command: list[str], runs: list[Path], stop: str, log: Path,
                 env: dict | None = None) -> tuple[int, str]:
    """Starts the runner ``command``, stops it with ``stop`` once every run of ``runs``
    has trained a step, and waits for the runs to end; (its exit code, its output)."""
    with open(log, "w") as out:  # its own session: a terminal's Ctrl-C goes to the job's group
        proc = subprocess.Popen([sys.executable, "-m", "kvtrain.cli", *command], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=REPO,
                                env={**os.environ, **(env or {})})
    try:
        pids = [_wait(lambda r=r: _trainer_pid(r), 120, proc, log) for r in runs]
        if stop == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # the runner and, as before, every child
        elif stop == "SIGTERM twice":  # one stop, delivered twice: timeout(1), scancel and a
            proc.send_signal(signal.SIGTERM)  # terminal signal the process and its group;
            while "at their next step" not in log.read_text():  # the copy (it may merge
                time.sleep(0.01)  # with the first) once the runner acts on the first
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(getattr(signal, stop))
        code = proc.wait(timeout=120)
        _wait(lambda: not any(map(_alive, pids)), 120)  # after a SIGKILL: on their own
    finally:
        if proc.poll() is None:
            proc.kill()
        for r in runs:
            pid = _trainer_pid(r)
            if pid and _alive(pid):
                os.kill(pid, signal.SIGKILL)
    return code, log.read_text()


def _checkpoints(run: Path) -> list[Path]:
    """The complete checkpoints of ``run``."""
    return [p for p in checkpoint_folders(run / "checkpoints") if is_complete(p)]


@pytest.mark.parametrize("stop, nproc", [("SIGTERM", 1), ("ctrl-c", 1), ("SIGKILL", 1),
                                         ("SIGTERM", 2), ("SIGKILL", 2), ("SIGTERM twice", 1)])
def test_a_stopped_or_killed_sweep_stops_its_cells_at_a_step_with_a_checkpoint(tmp_path, stop,
                                                                              nproc):
    """Two cells side by side (one process each), or one under torchrun (two ranks:
    the stop goes to the ranks, not to torchrun, which would exit 1). A SIGTERM twice
    within ``SAME_PRESS_S`` is one stop (it used to kill the cells, some steps after
    their last checkpoint)."""
    run_dir = tmp_path / "sweep"
    seeds = (1, 2) if nproc == 1 else (1,)
    runs = [run_dir / "arms" / f"seed={s}" / "run" for s in seeds]
    code, out = _stop_runner(["sweep", TINY, "--grid", f"train.seed={','.join(map(str, seeds))}",
                              *LONG, "--no-wandb", "--run-dir", str(run_dir), "--workers", "2",
                              "--threads", "1", "--nproc", str(nproc)],
                             runs, stop, tmp_path / "out.txt")
    assert code == {"SIGTERM": 143, "SIGTERM twice": 143, "ctrl-c": 130, "SIGKILL": -9}[stop], out
    names = ", ".join(f"seed={s}" for s in seeds)
    for r in runs:  # each stopped at a step of its own, with a checkpoint of it
        assert _checkpoints(r), (r, out)
    if stop != "SIGKILL":  # the runner waited for them and says how to go on
        assert f"stopping {names} at their next step" in out, out
        assert f"{names} stopped: the same command continues them" in out, out
        for cell in names.split(", "):
            record = json.loads((run_dir / "arms" / cell / "result.json").read_text())
            assert record["exit_code"] == 0, record
            assert f"[{cell}] stopped short of step 100000; it continues from its checkpoint " \
                f"of step " in out, out
        assert "kvtrain: killed" not in out and "FAILED" not in out, out


def test_a_stopped_demo_stops_both_arms_at_a_step_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "demo"
    runs = [run_dir / arm for arm in ("vanilla", "kv_shift")]
    # started in a shell of an enclosing job (a SLURM script's exports): the arms are
    # runs of their own (with these, each would wait for a rank 1 that never comes)
    job = {"MASTER_ADDR": "localhost", "MASTER_PORT": "1", "WORLD_SIZE": "2", "RANK": "0"}
    code, out = _stop_runner(["demo", "--run-dir", str(run_dir), *LONG, "--set",
                              "wandb.enabled=false"], runs, "SIGTERM", tmp_path / "out.txt", job)
    assert code == 143, out
    assert all(_checkpoints(r) for r in runs), out
    assert "stopping vanilla, kv_shift at their next step" in out, out
    assert out.rstrip().endswith("kvtrain demo: stopped; the same command continues the arms "
                                 "from their checkpoints"), out


def _child(code: str) -> list[str]:
    return [sys.executable, "-c", "import signal, sys, time\n" + code]


def test_a_second_stop_kills_runs_that_do_not_stop_and_an_error_stops_them_silently(capsys):
    """``stop_runs`` as a runner calls it: a run that does not act on the stop request
    (its trainer still importing, say) is killed by a second Ctrl-C; a runner's own
    error (``why`` None) stops its runs without a line."""
    import threading

    from kvtrain.experiments.children import start_run, stop_runs

    stuck = start_run(_child("time.sleep(120)"))  # SIGUSR1 ignored: as before a handler is set
    # the second stop: a second press (sooner, it would be the first one, relayed)
    threading.Timer(2 * SAME_PRESS_S, os.kill, (os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    assert stop_runs({"stuck": stuck}, "Ctrl-C") == ["stuck"]
    assert stuck.returncode == -signal.SIGKILL and time.monotonic() - started < 30
    out = capsys.readouterr().out
    assert "kvtrain: Ctrl-C: stopping stuck at their next step" in out
    assert "kvtrain: killed stuck: each keeps its last complete checkpoint" in out
    obeys = start_run(_child("signal.signal(signal.SIGUSR1, lambda *a: sys.exit(0))\n"
                             "print('ready', flush=True)\ntime.sleep(120)"),
                      stdout=subprocess.PIPE, text=True)
    assert obeys.stdout.readline() == "ready\n"  # its handler is set
    assert stop_runs({"obeys": obeys}, None) == ["obeys"] and obeys.returncode == 0
    assert capsys.readouterr().out == ""


def test_a_stop_delivered_twice_is_one_stop_and_a_later_one_kills_saying_who_did(capsys):
    """``run_all`` stopped by a Ctrl-C that comes twice (a terminal's to the process
    group, a launcher's relay) asks its runs to stop once; a press ``SAME_PRESS_S``
    later kills them, and a run so killed is said to be, not the out-of-memory
    killer's SIGKILL (``ended``)."""
    import threading

    from kvtrain.experiments.children import ended, run_all, start_run

    ended_as, pressed = {}, []

    def press() -> None:
        pressed.append(time.monotonic())  # before the signal: it may act at once
        os.kill(os.getpid(), signal.SIGINT)

    presses = [threading.Timer(delay, press)  # one press, twice; a second press
               for delay in (0.5, 0.6, 0.5 + 2 * SAME_PRESS_S)]
    for timer in presses:
        timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_all(["stuck"], lambda _: start_run(_child("time.sleep(120)")),
                    lambda name, proc: ended_as.update({name: ended(proc)}), 1, lambda _: "")
        assert len(pressed) == 3  # killed on the second press, not on the copy of the first
    finally:
        for timer in presses:
            timer.cancel()
    out = capsys.readouterr().out
    assert out.count("stopping stuck at their next step") == 1, out
    assert "kvtrain: killed stuck: each keeps its last complete checkpoint" in out, out
    assert ended_as == {"stuck": "killed by the runner after a second stop request"}
