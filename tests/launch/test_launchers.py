"""launch/torchrun.sh, launch/slurm.sbatch and `kvtrain submit` without SLURM:
shellcheck, the commands they build, two simulated nodes reproducing the
single-node run, and a signal to torchrun.sh saving and resuming."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import time

import pytest

from .conftest import (
    REFERENCE_STEPS, REPO, TINY, VENV_BIN, ensure_tools, free_port, launch_env, losses,
    short_overrides, train_records,
)

TORCHRUN_SH = REPO / "launch" / "torchrun.sh"
SBATCH = REPO / "launch" / "slurm.sbatch"


def test_shellcheck_passes():
    if not ensure_tools(["shellcheck"], ["shellcheck"]):
        pytest.skip("shellcheck is not installed and cannot be installed here")
    files = sorted(str(p) for p in (REPO / "launch").iterdir() if p.is_file())
    files += sorted(str(p) for p in (REPO / "benchmarks" / "device").glob("*.sh"))
    assert files
    out = subprocess.run(["shellcheck", "--external-sources", *files], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def dry(script, *args, **env):
    out = subprocess.run(["bash", str(script), *args], cwd=REPO, capture_output=True, text=True,
                         env=launch_env(KVTRAIN_DRY_RUN="1", **env), timeout=60)
    return out


def test_torchrun_sh_builds_the_command():
    cfg = "configs/tiny.yaml" if (REPO / "configs/tiny.yaml").exists() else "tests/launch/tiny.yaml"
    single = dry(TORCHRUN_SH, cfg, "train.max_steps=3", "--set", "train.seed=7",
                 "--run-dir", "/tmp/x")
    assert single.returncode == 0, single.stderr
    assert "--standalone" in single.stdout and "--nproc-per-node=1" in single.stdout
    assert "--set train.max_steps=3 --set train.seed=7" in single.stdout
    assert "--run-dir /tmp/x" in single.stdout and "-m kvtrain.cli train" in single.stdout

    c10d = dry(TORCHRUN_SH, cfg, NNODES="2", NPROC_PER_NODE="2", RDZV_ENDPOINT="head:29400",
               RDZV_ID="job7")
    assert c10d.returncode == 0, c10d.stderr
    assert "--rdzv-backend=c10d --rdzv-endpoint=head:29400 --rdzv-id=job7" in c10d.stdout
    assert "--nnodes=2 --nproc-per-node=2" in c10d.stdout

    static = dry(TORCHRUN_SH, cfg, NNODES="2", NODE_RANK="1", NPROC_PER_NODE="2",
                 MASTER_ADDR="head", MASTER_PORT="1234")
    assert "--master-addr=head --master-port=1234 --node-rank=1" in static.stdout

    # Under SLURM: node rank and the process count come from SLURM's variables (CPU job).
    slurm = dry(TORCHRUN_SH, cfg, SLURM_NNODES="2", SLURM_NODEID="1", SLURM_CPUS_ON_NODE="2",
                RDZV_ENDPOINT="head:1")
    assert "NNODES=2 NODE_RANK=1 NPROC_PER_NODE=2" in slurm.stdout

    missing = dry(TORCHRUN_SH, cfg, NNODES="2")
    assert missing.returncode == 2 and "RDZV_ENDPOINT" in missing.stderr


def test_torchrun_sh_refuses_a_bad_config_in_one_line():
    out = dry(TORCHRUN_SH, "configs/paper/13b_vanilla.yaml", "parallel.tensor=3")
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "config error" in out.stderr
    out = dry(TORCHRUN_SH, "configs/paper/13b_vanilla.yaml", NPROC_PER_NODE="3")
    assert out.returncode == 2 and "world size 3" in out.stderr


@pytest.mark.parametrize("script", [TORCHRUN_SH, SBATCH], ids=["torchrun.sh", "slurm.sbatch"])
@pytest.mark.parametrize("stray", ["train.max_steps:50", "foo", "--max-steps"])
def test_a_stray_argument_is_one_line_before_torchrun_starts(script, stray):
    """An argument neither KEY=VALUE nor an option of `kvtrain train` (a ':' for '='):
    torchrun started, every rank printed argparse's usage and error, and torchrun
    ended with its ChildFailedError traceback. The pre-check parses the arguments
    with kvtrain train's own parser now: one line, before torchrun (no command)."""
    out = dry(script, str(TINY), "train.seed=3", stray, SLURM_JOB_ID="6")
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == (f"kvtrain: config error: unrecognized argument '{stray}': neither a "
                          "KEY=VALUE override nor an option of kvtrain train\n"), out.stderr


def test_the_options_of_kvtrain_train_pass_the_pre_check(tmp_path):
    """What the trainer accepts passes: --set, its abbreviation, --status-file; --help is
    kvtrain train's, printed once (on stderr), and nothing starts."""
    out = dry(TORCHRUN_SH, str(TINY), "--se=train.seed=5", "--status-file",
              str(tmp_path / "status"), "--run-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stderr
    assert f"--se=train.seed=5 --status-file {tmp_path}/status" in out.stdout, out.stdout
    bad = dry(TORCHRUN_SH, str(TINY), "--se=train.sed=5")  # the abbreviation is read: the
    assert bad.returncode == 2 and "train.sed" in bad.stderr, bad.stderr  # config refuses it
    helped = dry(TORCHRUN_SH, str(TINY), "--help")
    assert helped.returncode == 0 and helped.stdout == "", helped.stdout
    assert helped.stderr.startswith("usage: kvtrain train [-h]"), helped.stderr


@pytest.mark.parametrize("script, how, key", [
    (TORCHRUN_SH, "option", "--run-dir"), (TORCHRUN_SH, "env", "RUN_DIR"),
    (SBATCH, "option", "--run-dir"), (SBATCH, "env", "RUN_DIR"), (SBATCH, "config", "run_dir"),
], ids=lambda v: v.name if hasattr(v, "name") else v)
def test_a_run_dir_that_is_a_file_is_kvtrain_trains_one_line(tmp_path, script, how, key):
    """--run-dir FILE: torchrun.sh said mkdir's "cannot create directory ...: Not a
    directory" (exit 1), slurm.sbatch too, after the config check had passed. The
    pre-check refuses it as `kvtrain train --run-dir FILE` does
    (check_output_folders), naming where the folder came from; nothing is made."""
    taken = tmp_path / "t.yaml"
    taken.write_text(TINY.read_text() + (f"run_dir: {taken}\n" if how == "config" else ""))
    args = ["--run-dir", str(taken)] if how == "option" else []
    env = {"RUN_DIR": str(taken)} if how == "env" else {}
    out = subprocess.run(["bash", str(script), str(taken), *args], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env=launch_env(SLURM_JOB_ID="6", **env))
    assert out.returncode == 2, out.stdout + out.stderr
    assert out.stderr == f"kvtrain: config error: {key} {taken} is a file, not a folder\n", \
        out.stderr
    assert sorted(tmp_path.iterdir()) == [taken] and taken.read_text().startswith(
        TINY.read_text())


@pytest.mark.parametrize("script", [TORCHRUN_SH, SBATCH], ids=["torchrun.sh", "slurm.sbatch"])
@pytest.mark.parametrize("under", ["", "/logs"], ids=["file", "under-a-file"])
def test_a_log_dir_that_is_a_file_is_one_line(tmp_path, script, under):
    """LOG_DIR=FILE (or a folder under a file): torchrun.sh printed mkdir's "cannot
    create directory ...: File exists" with the config check passed, and not a word
    of LOG_DIR. Both scripts check it with the run's folders: one line naming
    LOG_DIR, before anything starts (here: before the dry run's command)."""
    taken = tmp_path / "notes.txt"
    taken.write_text("keep\n")
    out = dry(script, str(TINY), "--run-dir", str(tmp_path / "r"), SLURM_JOB_ID="6",
              LOG_DIR=f"{taken}{under}")
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr == f"{script.name}: LOG_DIR {taken}{under}: {taken} is a file, " \
        "not a folder\n", out.stderr
    assert taken.read_text() == "keep\n" and not (tmp_path / "r").exists()


def test_slurm_sbatch_builds_the_step():
    out = dry(SBATCH, "configs/paper/19b_kv_shift.yaml", "train.seed=3", SLURM_JOB_ID="4242",
              SLURM_JOB_NUM_NODES="30", SLURM_CPUS_ON_NODE="128", RUN_DIR="/shared/r",
              CONTAINER_IMAGE="/shared/kvtrain.sqsh")
    assert out.returncode == 0, out.stderr
    words = shlex.split(out.stdout.splitlines()[1])
    assert words[:6] == ["srun", "--nodes=30", "--ntasks=30", "--ntasks-per-node=1",
                         "--kill-on-bad-exit=1", "--cpu-bind=none"]
    assert "--cpus-per-task=128" in words
    assert "--container-image=/shared/kvtrain.sqsh" in words
    assert f"--container-mounts={REPO}:{REPO},/shared/r:/shared/r" in words
    assert words[-8:] == ["bash", str(TORCHRUN_SH), "configs/paper/19b_kv_shift.yaml",
                          "--run-dir", "/shared/r", "train.seed=3", "--status-file",
                          "/shared/r/logs/slurm-4242/status.restart0"]
    assert "LOG_DIR=/shared/r/logs/slurm-4242" in out.stdout
    assert "STOP_FILE=/shared/r/logs/slurm-4242/stop-requested.restart0" in out.stdout
    assert "RDZV_ENDPOINT=" in out.stdout and ":29642" in out.stdout
    text = SBATCH.read_text()
    assert "#SBATCH --signal=B:USR1@300" in text and "#SBATCH --requeue" in text
    assert "scontrol requeue" in text


def kvtrain(*args, **env):
    return subprocess.run([str(VENV_BIN / "kvtrain"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env=launch_env(**env))


def test_submit_dry_run():
    out = kvtrain("submit", "configs/paper/19b_kv_shift.yaml", "--nodes", "30", "--gpu", "a800",
                  "--time", "24:00:00", "--partition", "gpu", "--chain", "3",
                  "--container-image", "reg#kvtrain:1", "--set", "train.seed=5", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3 and len(set(lines)) == 1  # a chain of identical singleton jobs
    words = shlex.split(lines[0])
    env = dict(w.split("=", 1) for w in words[:words.index("sbatch")])
    args = words[words.index("sbatch"):]
    assert env["RUN_DIR"] == str(REPO / "runs" / "paper-19b-kv-shift")
    assert env["CHECKPOINT_DIR"] == env["RUN_DIR"] + "/checkpoints"  # read in the container
    assert env["CONTAINER_IMAGE"] == "reg#kvtrain:1" and env["KVTRAIN_REPO"] == str(REPO)
    # what submit blanks is shown blank: pasted into a shell that exports LOG_DIR or
    # KVTRAIN_DRY_RUN, the printed line submitted another job than submit's
    assert {k: env[k] for k in ("LOG_DIR", "KVTRAIN_DRY_RUN", "MAX_REQUEUES")} == \
        {"LOG_DIR": "", "KVTRAIN_DRY_RUN": "", "MAX_REQUEUES": ""}, env
    for flag in ("--nodes=30", "--ntasks-per-node=1", "--gpus-per-node=8", "--time=24:00:00",
                 "--partition=gpu", "--signal=B:USR1@300", "--dependency=singleton",
                 "--requeue"):
        assert flag in args, flag
    assert any(a.startswith("--job-name=kvtrain-paper-19b-kv-shift-") for a in args), args
    assert args[-3:] == [str(SBATCH), str(REPO / "configs/paper/19b_kv_shift.yaml"),
                         "train.seed=5"]


def test_submit_refuses_impossible_layouts_in_one_line():
    for args in (["configs/paper/19b_kv_shift.yaml", "--nodes", "29"],
                 ["configs/paper/2.9b_kv_shift.yaml", "--nodes", "64", "--set",
                  "parallel.tensor=1", "--set", "parallel.sequence_parallel=false"]):
        out = kvtrain("submit", *args, "--dry-run")
        assert out.returncode == 2, out.stdout
        assert out.stderr.strip().count("\n") == 0 and "config error" in out.stderr


@pytest.mark.slow
def test_two_simulated_nodes_reproduce_the_single_node_run(tmp_path, train_args, reference_run):
    """Two torchrun agents (node ranks 0 and 1, one process each, static rendezvous
    on node 0) give the losses of one agent with two processes, bit for bit."""
    run_dir = tmp_path / "run"
    port = str(free_port())
    cmd = ["bash", str(TORCHRUN_SH), *train_args, *short_overrides(REFERENCE_STEPS),
           "--run-dir", str(run_dir)]
    agents = [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env=launch_env(NNODES="2", NODE_RANK=str(rank),
                                                   NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1",
                                                   MASTER_PORT=port))
        for rank in (0, 1)
    ]
    outputs = []
    for agent in agents:
        try:
            outputs.append(agent.communicate(timeout=600)[0])
        finally:
            if agent.poll() is None:
                agent.kill()
    assert [a.returncode for a in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "node 0 of 2" in (run_dir / "logs" / "node0.log").read_text()
    assert "node 1 of 2" in (run_dir / "logs" / "node1.log").read_text()
    assert losses(run_dir) == reference_run["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("to,sig", [("script", signal.SIGTERM), ("group", signal.SIGTERM),
                                    ("group", signal.SIGINT)])
def test_signal_to_torchrun_sh_stops_at_a_step_with_a_checkpoint(tmp_path, train_args, to,
                                                                 sig):
    """SIGTERM to torchrun.sh (what a scheduler sends it), SIGTERM to its whole
    process group (a time limit such as `timeout`'s) or Ctrl-C (a terminal's
    SIGINT to the group): the workers alone get the stop (torchrun ignores the
    three), they stop at a step boundary, save, and all exit 0; Ctrl-C's line is
    said once. The group's SIGTERM made torchrun (torch 2.13 reads its handled
    signals from --signals-to-handle, not TORCHELASTIC_SIGNALS_TO_HANDLE) tear the
    workers down and exit 1 with a traceback; Ctrl-C killed the run mid-step,
    saving nothing. (Resuming from that checkpoint is the SLURM test's second half.)"""
    run_dir = tmp_path / "run"
    steps = 200
    cmd = ["bash", str(TORCHRUN_SH), *train_args, *short_overrides(steps, save_interval=1000),
           "--run-dir", str(run_dir)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=launch_env(NPROC_PER_NODE="2"),
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and len(train_records(run_dir)) >= 2:
                break
            time.sleep(0.2)
        if to == "script":
            proc.send_signal(sig)
        else:
            os.killpg(proc.pid, sig)
        output = proc.communicate(timeout=300)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its session's leftovers, if any
    assert proc.returncode == 0, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    its = [r["iteration"] for r in train_records(run_dir)]
    stopped = its[-1]
    assert its == list(range(1, stopped + 1)) and stopped < steps
    assert "stopped on request, torchrun exit code 0" in output
    latest = (run_dir / "checkpoints" / "latest").read_text()
    assert f"{stopped:07d}" in latest, latest
    ctrl_c = "kvtrain: Ctrl-C: stopping after this step with a checkpoint"
    assert output.count(ctrl_c) == (1 if sig == signal.SIGINT else 0), output[-3000:]


@pytest.mark.parametrize("time,message", [
    ("1h", "--time '1h' is not a SLURM time limit (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM "
           "or D-HH:MM:SS)"),
    ("1:00:00:00", "--time '1:00:00:00' is not a SLURM time limit"),
    ("00:04:00", "--signal-seconds 300 is not shorter than --time 00:04:00 (240 s): every job "
                 "would be told to stop as it starts (lower --signal-seconds or raise --time)"),
])
def test_submit_refuses_a_bad_time_limit_in_one_line(capsys, time, message):
    """Checked in the dry run too; a signal at or before the start would make
    every job save and requeue at once, over and over."""
    from kvtrain.cli import main

    assert main(["submit", str(REPO / "configs/tiny.yaml"), "--gpus-per-node", "0", "--nproc-per-node",
                 "1", "--time", time, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"kvtrain: config error: {message}") and "\n" not in err, err


@pytest.mark.parametrize("option,value,message", [
    ("--nproc-per-node", "0", "--nproc-per-node must be >= 1 (leave it out for the default), "
                              "got 0"),
    ("--nproc-per-node", "-2", "--nproc-per-node must be >= 1 (leave it out for the default), "
                               "got -2"),
    ("--max-requeues", "-1", "--max-requeues must be >= 0, got -1"),
    ("--signal-seconds", "-5", "--signal-seconds must be >= 1 (the seconds the trainer has to "
                                "save before the time limit), got -5"),
])
def test_submit_refuses_option_values_out_of_range(capsys, option, value, message):
    """--nproc-per-node 0 silently meant the default (-2 was blamed on the world
    size); --max-requeues -1 and --signal-seconds -5 went to the job as they were."""
    from kvtrain.cli import main

    assert main(["submit", str(TINY), "--gpus-per-node", "0", option, value, "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == f"kvtrain: config error: {message}"


def test_submit_refuses_a_run_folder_it_cannot_make_in_one_line(tmp_path, monkeypatch, capsys):
    """A --run-dir (or checkpoint.dir) that is a file, or a folder that cannot be
    made: one line before sbatch, not a NotADirectoryError traceback at mkdir
    (or a queued job failing on the cluster hours later)."""
    from kvtrain.cli import main

    blocker = tmp_path / "file"
    blocker.write_text("x")
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path}/called\necho 1\n")
    (tmp_path / "bin" / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    for extra, code, message in (
            (["--run-dir", str(blocker)], 2,
             f"kvtrain: config error: --run-dir {blocker} is a file, not a folder"),
            (["--run-dir", str(tmp_path / "r"), "--set", f"checkpoint.dir={blocker}/c"], 2,
             f"kvtrain: config error: checkpoint.dir {blocker}/c: {blocker} is a file, "
             "not a folder"),
            (["--run-dir", "/proc/kvtrain-run"], 1, "kvtrain submit: cannot make the log "
             "folder /proc/kvtrain-run/logs: No such file or directory")):
        assert main(["submit", str(TINY), "--gpus-per-node", "0", *extra]) == code
        assert capsys.readouterr().err.strip() == message
    assert not (tmp_path / "called").exists()  # sbatch never ran


@pytest.mark.parametrize("time,seconds", [("90", 5400), ("30:00", 1800), ("24:00:00", 86400),
                                          ("2-12", 216000), ("1-00:30", 88200),
                                          ("1-00:00:10", 86410), ("UNLIMITED", None),
                                          ("99:99:99", 362439), ("2-", 172800), ("-1", None)])
def test_slurm_time_limits(time, seconds):
    """SLURM's own reading (parse_time.c, sbatch 22.05 on the test cluster): fields
    are not range-checked (99:99:99 is a 4-04:41:00 limit), "D-" is D days and -1
    no limit (both were refused here)."""
    from kvtrain.commands.submit import slurm_seconds

    assert slurm_seconds(time) == seconds


def test_a_tilde_run_dir_is_the_trainers_folder_in_every_launcher(tmp_path, monkeypatch):
    """The trainer expands `run_dir: ~/...` (resolve_run_dir); kvtrain submit,
    torchrun.sh and slurm.sbatch must name the same folder for the run, its logs
    and stop files, not <cwd>/~/..."""
    from kvtrain.cli import build_parser
    from kvtrain.commands.submit import build

    home = tmp_path / "home"
    cfg = tmp_path / "tilde.yaml"
    cfg.write_text(TINY.read_text() + "run_dir: ~/kvt-runs/tilde\n")
    run = home / "kvt-runs" / "tilde"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    for extra, folder in (([], run), (["--run-dir", "~/other"], home / "other")):
        args = build_parser().parse_args(["submit", str(cfg), "--gpus-per-node", "0",
                                          *extra, "--dry-run"])
        cmd, env = build(args)
        assert env["RUN_DIR"] == str(folder) and f"--output={folder}/logs/slurm-%j.out" in cmd
    out = dry(TORCHRUN_SH, str(cfg), HOME=str(home))
    assert out.returncode == 0, out.stderr
    assert f"RUN_DIR={run} LOG_DIR={run}/logs\n" in out.stdout
    assert f"--run-dir {run} " in out.stdout
    for env in ({}, {"RUN_DIR": "~/kvt-runs/tilde"}):
        out = dry(SBATCH, str(cfg), HOME=str(home), SLURM_JOB_ID="7", **env)
        assert out.returncode == 0, out.stderr
        assert f"RUN_DIR={run} LOG_DIR={run}/logs/slurm-7 " in out.stdout
        assert f"--run-dir {run} " in out.stdout


def _fake_checkpoint(folder):
    from kvtrain.train.integrity import MARKER, TRACKER

    folder.mkdir(parents=True)
    (folder / MARKER).write_text("{}")
    (folder.parent / TRACKER).write_text(folder.name)


@pytest.mark.parametrize("resume", ["none", "INIT"])
@pytest.mark.parametrize("restart", ["1", "0"])  # requeued, or the next job of a chain
def test_a_requeued_or_chained_start_resumes_from_the_runs_own_checkpoints(
        tmp_path, resume, restart):
    """checkpoint.resume: none (a fresh start) or a path (a start from another run)
    is for the first start only: once the run has checkpoints, `none` is refused
    and the path would reload the initial checkpoint, throwing away the progress."""
    from kvtrain.config import checkpoint_folder, load_config
    from kvtrain.train.integrity import plan_resume

    init = tmp_path / "init" / "iter_0000002"
    _fake_checkpoint(init)
    value = str(init) if resume == "INIT" else resume
    run = tmp_path / "run"

    def start(**env):
        out = dry(SBATCH, str(TINY), f"checkpoint.resume={value}", "train.seed=3",
                  SLURM_JOB_ID="9", SLURM_RESTART_COUNT=restart, RUN_DIR=str(run), **env)
        assert out.returncode == 0, out.stderr
        words = shlex.split(out.stdout.splitlines()[1])
        assert words[-2] == "--status-file", words
        sets = words[words.index(str(TORCHRUN_SH)) + 4:-2]
        cfg = load_config(TINY, sets)
        return sets, plan_resume(cfg.checkpoint.resume, checkpoint_folder(cfg.checkpoint.dir, run))

    sets, plan = start()  # nothing saved yet: the configured start
    assert sets == [f"checkpoint.resume={value}", "train.seed=3"]
    assert plan.candidates == ([init] if resume == "INIT" else [])
    own = run / "checkpoints" / "iter_0000006"
    _fake_checkpoint(own)
    sets, plan = start()
    assert sets == [f"checkpoint.resume={value}", "train.seed=3", "checkpoint.resume=auto"]
    assert plan.candidates[:1] == [own], plan.candidates
    # in a container (no interpreter here) the checkpoints are CHECKPOINT_DIR's
    sets, _ = start(CONTAINER_IMAGE="img", CHECKPOINT_DIR=str(run / "checkpoints"))
    assert sets[-1] == "checkpoint.resume=auto"


@pytest.mark.parametrize("visible,nproc", [("", "4"), ("-1", "4"), ("0,1", "2"), ("1,-1,0", "1")])
def test_torchrun_sh_counts_the_gpus_cuda_visible_devices_leaves(tmp_path, visible, nproc):
    """CUDA_VISIBLE_DEVICES= (or -1) hides every GPU - how train.device: cpu runs on a
    GPU node (schema.py) - and CUDA stops at the first invalid id: not nvidia-smi's 8."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo \"GPU $i: H100 (UUID: x$i)\"; done\n")
    smi.chmod(0o755)
    path = f"{tmp_path}:{launch_env()['PATH']}"
    out = dry(TORCHRUN_SH, str(TINY), "train.device=cpu", "train.global_batch_size=16",
              "--run-dir", str(tmp_path / "r"), CUDA_VISIBLE_DEVICES=visible,
              SLURM_CPUS_ON_NODE="4", PATH=path)
    assert out.returncode == 0, out.stderr
    assert f"NPROC_PER_NODE={nproc} " in out.stdout, out.stdout


def test_submit_names_jobs_by_run_folder(tmp_path, monkeypatch):
    """--dependency=singleton serialises jobs of one name: a sweep of one config into
    separate run folders must run side by side, while two jobs of one run folder
    (a chain, or a second submit to continue it) must not overlap."""
    from kvtrain.cli import build_parser
    from kvtrain.commands.submit import build

    monkeypatch.chdir(tmp_path)

    def job(*args):
        cmd, _ = build(build_parser().parse_args(
            ["submit", str(TINY), "--gpus-per-node", "0", *args, "--dry-run"]))
        assert "--dependency=singleton" in cmd
        return next(a for a in cmd if a.startswith("--job-name="))

    sweep = {job("--run-dir", f"runs/lr{lr}", "--set", f"optimizer.lr={lr}")
             for lr in ("1e-3", "2e-3")}
    assert len(sweep) == 2 and all(n.startswith("--job-name=kvtrain-lr") for n in sweep), sweep
    assert len({job("--run-dir", f"{parent}/run") for parent in ("a", "b")}) == 2
    assert job("--run-dir", "runs/x") == job("--run-dir", str(tmp_path / "runs" / "x"))
    assert job("--job-name", "mine") == "--job-name=mine"


def test_a_container_job_mounts_every_folder_the_run_writes(tmp_path):
    """The trainer in the container is given host paths: a folder it writes that is
    not mounted is the container's own, and checkpoints saved there (checkpoint.dir
    on scratch storage) vanish with it - the requeued start finds none and trains
    from step 0. The user's CONTAINER_MOUNTS add to these mounts, they do not drop
    them (the repo, the run folder)."""
    def mounts(**env):
        out = dry(SBATCH, str(TINY), "checkpoint.dir=/scratch/ck", SLURM_JOB_ID="3",
                  RUN_DIR="/shared/r", CHECKPOINT_DIR="/scratch/ck", CONTAINER_IMAGE="img",
                  **env)
        assert out.returncode == 0, out.stderr
        words = shlex.split(out.stdout.splitlines()[1])
        return next(w for w in words if w.startswith("--container-mounts=")).split("=", 1)[1]

    assert mounts() == f"{REPO}:{REPO},/shared/r:/shared/r,/scratch/ck:/scratch/ck"
    assert mounts(LOG_DIR="/logs/k") == \
        f"{REPO}:{REPO},/shared/r:/shared/r,/scratch/ck:/scratch/ck,/logs/k:/logs/k"
    assert mounts(CONTAINER_MOUNTS="/data:/data:ro,/scratch:/scratch") == \
        f"/data:/data:ro,/scratch:/scratch,{REPO}:{REPO},/shared/r:/shared/r"
    assert mounts(CONTAINER_MOUNTS="/:/") == "/:/"


def test_a_container_job_refuses_a_checkpoint_dir_that_is_not_the_configs(tmp_path):
    """Without kvtrain's interpreter on the batch host, slurm.sbatch takes the
    checkpoint folder from CHECKPOINT_DIR (else <RUN_DIR>/checkpoints) to decide the
    resume and the mounts; a config's checkpoint.dir elsewhere would be saved into
    the container's own filesystem and lost. torchrun.sh, in the container, holds
    the config: it refuses the mismatch in one line before anything starts."""
    srun = tmp_path / "srun"  # runs the step's torchrun.sh here, as a dry run
    srun.write_text('#!/bin/sh\nwhile [ "$1" != bash ]; do shift; done\n'
                    'KVTRAIN_DRY_RUN=1 exec "$@"\n')
    srun.chmod(0o755)
    run, ck = tmp_path / "r", tmp_path / "scratch" / "ck"

    def job(*sets, **env):
        return subprocess.run(
            ["bash", str(SBATCH), str(TINY), *sets], cwd=REPO, capture_output=True, text=True,
            timeout=60, env=launch_env(SLURM_JOB_ID="5", RUN_DIR=str(run), CONTAINER_IMAGE="img",
                                       PATH=f"{tmp_path}:{launch_env()['PATH']}", **env))

    out = job(f"checkpoint.dir={ck}")
    assert out.returncode == 2, out.stdout + out.stderr
    line = [ln for ln in out.stderr.splitlines() if "kvtrain" in ln]
    assert line == [f"kvtrain: config error: checkpoint.dir: the run's checkpoint folder is "
                    f"{ck}, but slurm.sbatch took CHECKPOINT_DIR={run}/checkpoints (for "
                    f"the resume and the container's mounts): set CHECKPOINT_DIR={ck} "
                    f"(kvtrain submit does)"], out.stderr
    ok = job(f"checkpoint.dir={ck}", CHECKPOINT_DIR=str(ck))
    assert ok.returncode == 0 and "--run-dir" in ok.stdout, ok.stdout + ok.stderr
    assert job().returncode == 0


def test_submit_refuses_a_chain_without_singleton_in_one_line(capsys):
    """--chain K submits K identical jobs: without --dependency=singleton they would
    all start at once on one run folder, K-1 of them holding their nodes only to be
    refused by its lock."""
    from kvtrain.cli import main

    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--chain", "3",
                 "--no-singleton", "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("kvtrain: config error: --chain 3 with --no-singleton: the 3 jobs would start "
                   "at once on one run folder (--dependency=singleton runs them one after "
                   "another)"), err
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--no-singleton", "--dry-run"]) == 0


def _image_env() -> dict[str, str]:
    """The environment docker/Dockerfile's ENV instructions give the image."""
    text = (REPO / "docker" / "Dockerfile").read_text().replace("\\\n", " ")
    env = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(w.split("=", 1) for w in shlex.split(line[4:]))
    return env


def test_the_image_runs_its_interpreter_not_a_mounted_checkouts_venv(tmp_path):
    """docker/README: a checkout mounted over /opt/kvtrain runs with the image's
    packages. Its .venv (make's: a host interpreter, CPU torch) must not be taken:
    its python is missing in the image, or it is the CPU build."""
    repo = tmp_path / "kvtrain"
    (repo / "launch").mkdir(parents=True)
    for script in ("torchrun.sh", "precheck.sh", "folders.sh"):  # the launcher, its helpers
        (repo / "launch" / script).write_text((REPO / "launch" / script).read_text())
    venv_python = repo / ".venv" / "bin" / "python"
    venv_python.parent.mkdir(parents=True)
    venv_python.write_text("#!/bin/sh\necho 'the host .venv ran' >&2\nexit 1\n")
    venv_python.chmod(0o755)
    env = launch_env(KVTRAIN_DRY_RUN="1")
    del env["PYTHON"]  # launch_env's: the container has only the image's
    env.update(_image_env())
    out = subprocess.run(["bash", str(repo / "launch" / "torchrun.sh"), str(TINY), "--run-dir",
                          str(tmp_path / "r")], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    assert "python -m torch.distributed.run" in out.stdout and ".venv" not in out.stdout


def test_a_chain_cut_short_by_sbatch_names_the_jobs_it_submitted(tmp_path, monkeypatch, capsys):
    """sbatch refusing the 3rd job of --chain 3 (a QOS job limit): the first two are
    queued and will train; the user must learn which, not only that sbatch failed."""
    from kvtrain.cli import main

    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(f"#!/bin/sh\necho x >> {tmp_path}/calls\nn=$(wc -l < {tmp_path}/calls)\n"
                      "[ $n -le 2 ] || { echo 'sbatch: error: QOSMaxSubmitJobPerUserLimit' >&2; "
                      "exit 1; }\necho $((100 + n))\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}:{launch_env()['PATH']}")
    assert main(["submit", str(TINY), "--gpus-per-node", "0", "--chain", "3", "--run-dir",
                 str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("kvtrain submit: sbatch failed: sbatch: error: QOSMaxSubmitJobPerUserLimit "
                   "(job 3 of the chain of 3; submitted and queued: 101 102)"), err


def test_submit_is_not_overridden_by_the_submitting_shells_launcher_variables(
        tmp_path, monkeypatch, capsys):
    """sbatch passes the submitting shell's environment to the job, where
    slurm.sbatch and torchrun.sh read it: an NPROC_PER_NODE left from a workstation
    test ran 1 process on each 2-GPU node, a layout submit never checked (silently,
    when the config fits it), and a LOG_DIR put the logs elsewhere than submit said."""
    from kvtrain.cli import main

    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.parent.mkdir()
    sbatch.write_text(f"#!/bin/sh\nenv > {tmp_path}/env\necho 7\n")
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{sbatch.parent}:{launch_env()['PATH']}")
    for key, value in (("NPROC_PER_NODE", "1"), ("LOG_DIR", "/elsewhere"), ("MAX_REQUEUES", "0"),
                       ("CONTAINER_IMAGE", "img"), ("KVTRAIN_DRY_RUN", "1")):
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    assert main(["submit", str(TINY), "--gpus-per-node", "2", "--no-plan", "--run-dir",
                 str(run)]) == 0
    assert f"logs {run}/logs/slurm-<job id>" in capsys.readouterr().out
    env = dict(line.split("=", 1) for line in (tmp_path / "env").read_text().splitlines()
               if "=" in line)
    assert env["NPROC_PER_NODE"] == "2"
    assert [env.get(k) for k in ("LOG_DIR", "MAX_REQUEUES", "CONTAINER_IMAGE",
                                 "KVTRAIN_DRY_RUN")] == ["", "", "", ""]


def _fake_tool(folder, name, body):
    path = folder / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


@pytest.mark.parametrize("when", ["config check", "step"])
@pytest.mark.parametrize("restart,requeued", [("0", True), ("2", False)])
def test_a_stop_requeues_the_job_or_fails_it_when_no_requeue_is_left(
        tmp_path, when, restart, requeued):
    """SIGUSR1 to the batch shell (--signal=B:USR1, a preemption notice) while it
    still checks the config - a requeued job with little time left - killed it:
    the trap came after the check, and the job was not requeued. It is noted from
    the start now, and the step is then not started (there is nothing to save).
    With MAX_REQUEUES used up the job exited 0 (COMPLETED, so --dependency=afterok
    went on) though its training was unfinished: now it fails, in one line."""
    bin_dir, calls, run = tmp_path / "bin", tmp_path / "calls", tmp_path / "run"
    bin_dir.mkdir()
    _fake_tool(bin_dir, "scontrol", f'echo "scontrol $*" >> {calls}\n')
    # srun: the step, told to stop as it runs (as the trainer does, it exits 0)
    _fake_tool(bin_dir, "srun", f'echo srun >> {calls}\nkill -USR1 "$PPID"\n'
                                'while [ ! -e "$STOP_FILE" ]; do sleep 0.05; done\n')
    # the interpreter of the config check: says when it runs, waits for the signal
    wait = when == "config check"
    _fake_tool(bin_dir, "python", (f"touch {tmp_path}/checking\n"
                                   f"while [ ! -e {tmp_path}/signalled ]; do sleep 0.05; done\n"
                                   if wait else "") + f"echo {run}\necho {run}/checkpoints\n")
    proc = subprocess.Popen(
        ["bash", str(SBATCH), str(TINY)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        env=launch_env(SLURM_JOB_ID="8", SLURM_RESTART_COUNT=restart, MAX_REQUEUES="2",
                       PYTHON=str(bin_dir / "python"), PATH=f"{bin_dir}:{launch_env()['PATH']}"))
    try:
        if wait:
            deadline = time.monotonic() + 60
            while not (tmp_path / "checking").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            proc.send_signal(signal.SIGUSR1)
            (tmp_path / "signalled").touch()
        err = proc.communicate(timeout=60)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    step = [] if wait else ["srun"]
    if requeued:
        assert proc.returncode == 0, err
        assert calls.read_text().splitlines() == step + ["scontrol requeue 8"], err
    else:
        assert proc.returncode == 1, err
        assert (calls.read_text().splitlines() if calls.exists() else []) == step, err
        assert err.strip().splitlines()[-1] == (
            "slurm.sbatch: job 8 stopped before the end of its training and MAX_REQUEUES (2) "
            "is reached: not requeued (submit it again to continue from its last checkpoint)")


# the step's part in each case: the signal it sends the batch shell (the stop the
# shell relays through STOP_FILE, or scancel's SIGTERM), and the trainer's word
_STEPS = {
    "last step": ('kill -USR1 "$PPID"\nwhile [ ! -e "$STOP_FILE" ]; do sleep 0.05; done\n',
                  "finished 24/24"),
    "unrelayed stop": ("", "stopped 12/24"),
    "cancelled": ('kill -TERM "$PPID"\nsleep 0.3\n', "stopped 12/24"),
    # the stop relayed, then scancel's SIGTERM while the trainer saves
    "cancelled while stopping": ('kill -USR1 "$PPID"\n'
                                 'while [ ! -e "$STOP_FILE" ]; do sleep 0.05; done\n'
                                 'kill -TERM "$PPID"\nsleep 0.3\n', "stopped 12/24"),
}


def _sbatch_with_status(tmp_path, case: str, restart: str):
    """slurm.sbatch with a fake srun that plays ``_STEPS[case]``: it writes the
    status file named on its command line, as the trainer does, and exits 0."""
    bin_dir, calls, run = tmp_path / "bin", tmp_path / "calls", tmp_path / "run"
    bin_dir.mkdir()
    _fake_tool(bin_dir, "scontrol", f'echo "scontrol $*" >> {calls}\n')
    signals, status = _STEPS[case]
    _fake_tool(bin_dir, "srun", f"echo srun >> {calls}\n{signals}"
                                'while [ $# -gt 1 ] && [ "$1" != --status-file ]; do shift; done\n'
                                f'[ "$1" = --status-file ] && echo "{status}" > "$2"\n'
                                "exit 0\n")
    _fake_tool(bin_dir, "python", f"echo {run}\necho {run}/checkpoints\n")
    proc = subprocess.Popen(  # a session of its own: a hung fake srun dies with it
        ["bash", str(SBATCH), str(TINY)], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env=launch_env(SLURM_JOB_ID="8", SLURM_RESTART_COUNT=restart, MAX_REQUEUES="2",
                       PYTHON=str(bin_dir / "python"), PATH=f"{bin_dir}:{launch_env()['PATH']}"))
    try:
        err = proc.communicate(timeout=60)[1]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, calls.read_text().splitlines(), err.strip().splitlines()


@pytest.mark.parametrize("restart", ["0", "2"])
def test_a_stop_that_lands_on_the_last_step_ends_the_job(tmp_path, restart):
    """A stop (the time limit's --signal, a preemption notice) that arrives while
    the trainer takes the run's last step: the trainer finishes, saves and says so
    in the status file. The job requeued itself anyway, only for its next start
    to find nothing to do (a queue wait and a start-up of every node for nothing);
    with MAX_REQUEUES used up it failed the finished job (exit 1). It ends now."""
    code, calls, err = _sbatch_with_status(tmp_path, "last step", restart)
    assert code == 0, err
    assert calls == ["srun"], err  # no requeue
    assert err[-1] == ("slurm.sbatch: the training finished (iteration 24/24) as the stop "
                       "came: not requeued")


@pytest.mark.parametrize("restart,requeued", [("0", True), ("2", False)])
def test_a_stop_the_batch_script_did_not_relay_requeues_the_job(tmp_path, restart, requeued):
    """A stop that reaches the trainer but not the batch shell (`scancel
    --signal=USR1` without --batch, `sbatch --signal=USR1@T` without B:,
    train.exit_duration_minutes): the trainer saved and exited 0 unfinished, and
    the job ended COMPLETED with its training cut short. It requeues now, as for
    a stop the shell relays (failing once MAX_REQUEUES is used up)."""
    code, calls, err = _sbatch_with_status(tmp_path, "unrelayed stop", restart)
    assert err[-2].startswith(
        "slurm.sbatch: the trainer stopped at iteration 12/24 on a request this script did "
        "not relay"), err
    if requeued:
        assert code == 0 and calls == ["srun", "scontrol requeue 8"], err
    else:
        assert code == 1 and calls == ["srun"], err
        assert "MAX_REQUEUES (2) is reached: not requeued" in err[-1]


def test_a_cancelled_job_is_not_requeued(tmp_path):
    """scancel's SIGTERM reaches the batch shell and the trainer, which saves and
    exits 0 unfinished: the job must stay cancelled, not requeue itself."""
    code, calls, err = _sbatch_with_status(tmp_path, "cancelled", "0")
    assert code == 0 and calls == ["srun"], err
    assert "slurm.sbatch: SIGTERM" in err and not any("requeue" in line for line in err), err


def test_a_job_cancelled_while_it_stops_is_not_requeued(tmp_path):
    """A stop relayed to the trainer (--signal=B:USR1 before the time limit, a
    preemption notice), then scancel (or the time limit itself) while the trainer
    saves: the job requeued itself, and a cancelled job came back to the queue
    and trained on. A SIGTERM to the batch shell ends the job whatever came first."""
    code, calls, err = _sbatch_with_status(tmp_path, "cancelled while stopping", "0")
    assert calls == ["srun"], err
    assert code == 0 and "slurm.sbatch: SIGTERM" in err, err
    assert err[-1] == ("slurm.sbatch: job 8 got SIGTERM (scancel, or the time limit) while the "
                       "trainer stopped at iteration 12/24: not requeued (submit it again to "
                       "continue from its last checkpoint)"), err


@pytest.mark.parametrize("launcher", ["torchrun.sh", "slurm.sbatch"])
def test_a_launch_killed_by_a_signal_ends_with_its_status(tmp_path, launcher):
    """torchrun (or the SLURM step) killed by SIGKILL (the OOM killer, a node agent):
    the launcher script exits with 137. It spun at 100 % of a core instead, until
    the job's time limit: bash's `wait` answers a collected child's status again,
    and the loop that waits again after a trapped signal (> 128) took that for one."""
    bin_dir, run = tmp_path / "bin", tmp_path / "run"
    bin_dir.mkdir()
    # the config check prints the run folder; the launch itself dies by SIGKILL
    _fake_tool(bin_dir, "python", f'[ "$1" = -m ] && kill -9 $$\necho {run}\n'
                                  f'echo {run}/checkpoints\n')
    _fake_tool(bin_dir, "srun", "kill -9 $$\n")
    script = TORCHRUN_SH if launcher == "torchrun.sh" else SBATCH
    env = launch_env(SLURM_JOB_ID="8", PYTHON=str(bin_dir / "python"),
                     PATH=f"{bin_dir}:{launch_env()['PATH']}")
    proc = subprocess.Popen(["bash", str(script), str(TINY)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 137, out + err
