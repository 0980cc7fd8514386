"""launch/slurm.sbatch and `kvtrain submit` on a real one-node SLURM cluster
(started by the `slurm` fixture): a 2-process CPU job runs to completion, and a
job told to stop mid-run (the --signal=B:USR1 path) checkpoints, requeues
itself and finishes from its checkpoint with every iteration logged once."""

from __future__ import annotations

import time

import pytest

from .conftest import (
    REFERENCE_STEPS, REPO, VENV_BIN, free_port, losses, short_overrides, train_records,
)


pytestmark = pytest.mark.slow


def _done(fields) -> bool:
    return fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                      "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")


def test_sbatch_runs_the_demo_to_completion(slurm, tmp_path, train_args, reference_run):
    run_dir = tmp_path / "run"
    env = dict(slurm.env, RUN_DIR=str(run_dir), RDZV_PORT=str(free_port()))
    out = slurm.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out",
                     str(REPO / "launch" / "slurm.sbatch"), *train_args,
                     *short_overrides(REFERENCE_STEPS)], cwd=REPO, env=env)
    job = out.stdout.strip().split(";")[0]
    fields = slurm.wait(job, _done, timeout=600)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", \
        log[-3000:] + slurm.logs()
    # 2 processes (the node's 2 CPUs), one torchrun, one log folder for the job.
    assert "NPROC_PER_NODE" not in env
    assert (run_dir / "logs" / f"slurm-{job}" / "node0.log").exists()
    assert "--nproc-per-node=2" in (run_dir / "logs" / f"slurm-{job}" / "node0.log").read_text()
    # Same config, same layout: the losses of the torchrun.sh run, exactly.
    assert losses(run_dir) == reference_run["losses"]


def test_stop_signal_checkpoints_requeues_and_resumes(slurm, tmp_path, train_args):
    """`scancel --batch --signal=USR1` is what `#SBATCH --signal=B:USR1@300` does
    before the time limit: the batch script passes it on, the trainer saves at a
    step boundary, the job requeues itself and its second start resumes."""
    run_dir = tmp_path / "run"
    # the stop lands ~3 steps after it is sent (~1.5 s): 24 leave the first start
    # 20 steps of margin, and the second start little to redo
    steps = 24
    env = dict(slurm.env, RDZV_PORT=str(free_port()))
    submit = slurm.run([str(VENV_BIN / "kvtrain"), "submit", *train_args[:1], "--nodes", "1",
                        "--gpus-per-node", "0", "--run-dir", str(run_dir), "--job-name",
                        f"kvtrain-test-{tmp_path.name}", "--signal-seconds", "120",
                        *[a for o in train_args[1:] + short_overrides(steps, save_interval=1000)
                          for a in ("--set", o)]],
                       cwd=REPO, env=env)
    job = submit.stdout.split("submitted job ")[1].split(":")[0].strip()

    # Mid-run: a few iterations logged, far from the end.
    deadline = time.monotonic() + 600
    polls = 0
    while time.monotonic() < deadline:
        if (run_dir / "metrics.jsonl").exists() and len(train_records(run_dir)) >= 3:
            break
        polls += 1
        if polls % 10 == 0:
            fields = slurm.job(job)
            assert not _done(fields), fields
        time.sleep(0.2)
    slurm.run(["scancel", "--batch", "--signal=USR1", job])

    # The job requeues itself (same id, Restarts=1). SLURM holds a requeued job
    # for a couple of minutes (its BeginTime): release it once it is pending again
    # (while it is still completing, the update does not apply), a few seconds
    # ahead: slurmd revokes the killed start's credential, and a relaunch whose
    # credential is from the same second is refused ("Job credential revoked";
    # seen here with StartTime=now).
    deadline = time.monotonic() + 900
    released = False
    while True:
        fields = slurm.job(job)
        if _done(fields) or time.monotonic() > deadline:
            break
        if fields.get("JobState") == "PENDING" and fields.get("Restarts") == "1" and not released:
            out = slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"],
                            check=False)
            released = out.returncode == 0
        time.sleep(1.0)
    log = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", \
        log[-4000:] + slurm.logs()
    assert fields["Restarts"] == "1"

    # Every iteration once, in order, across the two starts.
    its = [r["iteration"] for r in train_records(run_dir)]
    assert its == list(range(1, steps + 1)), its
    assert "requeueing job" in log and "(restart 1)" in log
    job_log = (run_dir / "logs" / f"slurm-{job}" / "job.log").read_text()
    assert "restart 0" in job_log and "restart 1" in job_log
    assert (run_dir / "logs" / f"slurm-{job}" / "stop-requested.restart0").exists()
    # the trainer's word on each start, which the requeue went by
    stopped = (run_dir / "logs" / f"slurm-{job}" / "status.restart0").read_text()
    assert stopped.startswith("stopped ") and stopped.endswith(f"/{steps}\n"), stopped
    assert (run_dir / "logs" / f"slurm-{job}" / "status.restart1").read_text() == \
        f"finished {steps}/{steps}\n"
    node_log = (run_dir / "logs" / f"slurm-{job}" / "node0.log").read_text()
    assert "stopped on request, torchrun exit code 0" in node_log
