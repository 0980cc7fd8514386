"""Ctrl-C of ``kvtrain train``: the first saves a checkpoint at the step boundary
and exits 0, as SIGTERM does; a second quits at once and says where the run
continues from (exit 130). Before, the first Ctrl-C killed the run mid-step,
silently, with nothing saved since the last interval's checkpoint."""

from __future__ import annotations

import json
import os
import signal
import time

from .conftest import finish, latest, metrics, run_driver, start, tiny_config, wait_for, \
    write_config

LINE = "kvtrain: Ctrl-C: stopping after this step with a checkpoint"


def test_ctrl_c_saves_a_checkpoint_at_the_step_boundary(tmp_path, cache_dir):
    """SIGINT to the run's whole process group, as a terminal sends it (a data
    loader worker gets it too), twice within a few milliseconds, as a launcher
    relaying it does (bare torchrun): one stop, one line, a checkpoint of the
    step it stopped after, exit 0."""
    config = write_config(tmp_path / "c.yaml", tiny_config(
        None, cache_dir, train={"max_steps": 10_000}, checkpoint={"save_interval": 1000},
        data={"type": "mock", "num_workers": 1, "cache_dir": str(cache_dir)}))
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    proc = start(["train", str(config), "--run-dir", str(run_dir)], log=log)
    wait_for(lambda: len(metrics(run_dir)) >= 2 or proc.poll() is not None, timeout=240,
             what="step 2")
    os.killpg(proc.pid, signal.SIGINT)
    time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGINT)  # the same press, relayed
    assert finish(proc, timeout=240) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]
    assert text.count(LINE) == 1, text[-3000:]
    its = [r["iteration"] for r in metrics(run_dir)]
    stopped = its[-1]
    assert its == list(range(1, stopped + 1)) and stopped < 10_000
    assert (f"stopped at iteration {stopped}/10000 because of Ctrl-C (SIGINT); checkpoint "
            f"{run_dir / 'checkpoints'}/latest = iteration {stopped}") in text, text[-2000:]
    assert latest(run_dir) == f"iter_{stopped:07d}"


def test_a_second_ctrl_c_quits_at_once_and_says_where_the_run_continues(tmp_path, cache_dir):
    """The second Ctrl-C (a second past the first) at the start of step 5: no
    checkpoint of step 4, exit 130, one line naming the checkpoint of 3 that the
    run continues from, an event in the records, no traceback and no folder left
    half-written; the same command then resumes from 3. With no checkpoint yet
    the line says the run starts over."""
    runs = []
    for name, save_interval in (("saved", 3), ("unsaved", None)):
        config = write_config(tmp_path / f"{name}.yaml", tiny_config(
            None, cache_dir, train={"max_steps": 8},
            checkpoint={"save_interval": save_interval}))
        runs.append((config, tmp_path / name))
    jobs = [{"config": str(c), "run_dir": str(r), "faults": {"ctrl_c_twice_at": 5},
             "expect": 130} for c, r in runs]
    jobs.append({"config": str(runs[0][0]), "run_dir": str(runs[0][1])})  # the resume
    result = run_driver(jobs, tmp_path / "plan.json")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert out.count(LINE) == 2, out[-4000:]
    saved, unsaved = runs[0][1], runs[1][1]
    ck = saved / "checkpoints"
    assert (f"kvtrain: interrupted at iteration 4/8 with no checkpoint of it; it continues "
            f"from its checkpoint of iteration 3 ({ck / 'iter_0000003'})") in out, out[-3000:]
    assert ("kvtrain: interrupted at iteration 4/8 with no checkpoint of it; with no "
            "checkpoint, it starts over") in out, out[-3000:]
    assert not list(ck.glob("*.incomplete")) and not (unsaved / "checkpoints" / "latest").exists()
    events = [json.loads(line) for line in (unsaved / "metrics.jsonl").read_text().splitlines()]
    assert any(e.get("kind") == "event" and e["message"].startswith("interrupted at iteration 4/8")
               for e in events), events
    # the resume (the folder's lock was released): from 3 to the end
    assert f"resumed from {ck / 'iter_0000003'} at iteration 3" in out, out[-3000:]
    assert latest(saved) == "iter_0000008"
    assert [r["iteration"] for r in metrics(saved)] == list(range(1, 9))
