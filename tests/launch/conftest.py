"""Fixtures of the launcher tests: system packages, a short training config, the
single-node reference run, and a real one-node SLURM cluster (munge, slurmctld,
slurmd) started for the session and torn down after it."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_tools.fileio import atomic_write_text

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
TINY = Path(__file__).with_name("tiny.yaml")
VENV_BIN = Path(sys.executable).parent


def once_per_session(tmp_path_factory, worker_id: str, name: str, build):
    """``build(folder)``, JSON, once per test session: the first xdist worker to need
    it builds it (a session fixture runs once per worker), the others wait and read."""
    if worker_id == "master":  # no xdist
        return build(tmp_path_factory.mktemp(name))
    root = tmp_path_factory.getbasetemp().parent  # this session's, shared by its workers
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = root / f"{name}.json"
        if not done.exists():
            (root / name).mkdir(exist_ok=True)
            atomic_write_text(done, json.dumps(build(root / name)))
        return json.loads(done.read_text())


@pytest.fixture(scope="session")
def train_args(tmp_path_factory, worker_id) -> list[str]:
    """CONFIG and the data overrides of the launched jobs: configs/demo.yaml on the
    demo's corpus (built once per session, as ``kvtrain demo`` does), or the tiny
    mock-data config while configs/demo.yaml does not exist."""
    if not DEMO.is_file():
        return [str(TINY)]
    from kvtrain.commands.demo import prepare_data

    return [str(DEMO), *once_per_session(tmp_path_factory, worker_id, "demo-data", prepare_data)]


def short_overrides(steps: int, save_interval: int = 4) -> list[str]:
    """Overrides that make the demo a short, fully logged, offline job."""
    return [
        f"train.max_steps={steps}", "train.train_tokens=null", "train.log_interval=1",
        "train.eval_interval=null", "train.kv_shift_stats_interval=null",
        "train.exit_duration_minutes=null",
        f"checkpoint.save_interval={save_interval}", "checkpoint.keep_last=2",
        "checkpoint.resume=auto", "wandb.enabled=false",
    ]


def launch_env(**extra: str) -> dict[str, str]:
    """Environment of launched jobs: the repo's venv first on PATH, one thread per rank."""
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHON"] = sys.executable
    env["OMP_NUM_THREADS"] = "1"
    env["WANDB_MODE"] = "disabled"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NNODES",
                "NODE_RANK", "NPROC_PER_NODE", "RDZV_ENDPOINT", "RUN_DIR", "LOG_DIR",
                "STOP_FILE", "SLURM_JOB_ID", "SLURM_NODEID", "SLURM_NNODES",
                "SLURM_CPUS_ON_NODE", "SLURM_STEP_ID", "KVTRAIN_DRY_RUN", "CHECKPOINT_DIR",
                "KVTRAIN_CHECKPOINT_DIR"):
        env.pop(key, None)
    env.update(extra)
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_records(run_dir: Path) -> list[dict]:
    """The training records of metrics.jsonl (iteration, lm_loss, ...)."""
    path = Path(run_dir) / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("kind", "train") == "train" and "lm_loss" in rec:
            out.append(rec)
    return out


def losses(run_dir: Path) -> dict[int, float]:
    return {r["iteration"]: r["lm_loss"] for r in train_records(run_dir)}


# ----------------------------------------------------------------------------- packages
def ensure_tools(binaries: list[str], packages: list[str]) -> bool:
    """True when ``binaries`` are on PATH, after an apt-get install when they are not
    and this is a root Debian/Ubuntu machine (what .ci/run does for CI)."""
    def found() -> bool:
        return all(shutil.which(b) or Path("/usr/sbin", b).exists() for b in binaries)

    if found():
        return True
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
                   env=env, capture_output=True, timeout=900)
    if not found():  # the package lists may be missing: update once and retry
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=900)
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages],
                       env=env, capture_output=True, timeout=900)
    return found()


def sbin(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


# ----------------------------------------------------------------------------- reference run
REFERENCE_STEPS = 6


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory, worker_id, train_args):
    """A single-node, 2-process run of the short config through launch/torchrun.sh:
    the losses the other launch paths must reproduce (once per session)."""
    def build(folder: Path) -> list:
        run_dir = folder / "run"
        cmd = ["bash", str(REPO / "launch" / "torchrun.sh"), *train_args,
               *short_overrides(REFERENCE_STEPS), "--run-dir", str(run_dir)]
        out = subprocess.run(cmd, cwd=REPO, env=launch_env(NPROC_PER_NODE="2"),
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
        return [str(run_dir), sorted(losses(run_dir).items())]

    run_dir, got = once_per_session(tmp_path_factory, worker_id, "reference", build)
    got = {iteration: loss for iteration, loss in got}
    assert sorted(got) == list(range(1, REFERENCE_STEPS + 1)), got
    return {"run_dir": Path(run_dir), "steps": REFERENCE_STEPS, "losses": got}


# ----------------------------------------------------------------------------- SLURM
def _signal(pid: int, sig: int) -> bool:
    """Sends ``sig`` (0: none); whether the process was still there."""
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


class SlurmCluster:
    """A one-node SLURM cluster of this host, private to the test session."""

    def __init__(self, root: Path):
        self.root = root
        self.name = f"kvt{os.getpid()}"
        self.node = f"{self.name}n0"
        self.conf = root / "slurm.conf"
        self.env = launch_env(SLURM_CONF=str(self.conf))
        self.pids: dict[str, Path] = {}

    # -- setup
    def write_config(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 2
        mem_mb = max(1024, int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
                               / 2**20 * 0.8))
        self.conf.write_text(f"""\
ClusterName={self.name}
SlurmctldHost={host}
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={r}/munge/munge.sock
CredType=cred/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# the main scheduling loop every second, not every 60: a requeued job the test
# releases starts at once (no event schedules it; it waited ~45 s)
SchedulerParameters=sched_interval=1
SwitchType=switch/none
MpiDefault=none
JobRequeue=1
ReturnToService=2
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
MinJobAge=3600
KillWait=30
SlurmctldTimeout=30
SlurmdTimeout=60
SlurmctldDebug=info
SlurmdDebug=info
NodeName={self.node} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem_mb} State=UNKNOWN
PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
""")

    def start(self) -> None:
        r = self.root
        subprocess.run([sbin("munged"), "--force", f"--socket={r}/munge/munge.sock",
                        f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                        f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed"],
                       check=True, capture_output=True, timeout=60)
        self.pids["munged"] = r / "munge" / "munged.pid"
        subprocess.run([sbin("slurmctld"), "-c"], env=self.env, check=True,
                       capture_output=True, timeout=60)
        self.pids["slurmctld"] = r / "slurmctld.pid"
        subprocess.run([sbin("slurmd"), "-N", self.node], env=self.env, check=True,
                       capture_output=True, timeout=60)
        self.pids["slurmd"] = r / "slurmd.pid"
        deadline = time.monotonic() + 120
        state = ""
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-n", self.node, "-o", "%t"], check=False)
            state = out.stdout.strip()
            if state == "idle":
                return
            time.sleep(1)
        raise RuntimeError(f"SLURM node never became idle (state {state!r}); "
                           f"see {r}/log/slurmctld.log and slurmd.log")

    def stop(self) -> None:
        """The jobs killed, then the three daemons stopped together (each takes ~2 s
        to end on SIGTERM: one after another, they held the session's end 6 s)."""
        self.run(["scancel", "--full", "--signal=KILL", "-p", "test"], check=False)
        time.sleep(1)
        pids = []
        for name in ("slurmd", "slurmctld", "munged"):
            pidfile = self.pids.get(name)
            try:
                pids.append(int(pidfile.read_text().split()[0]))
            except (AttributeError, OSError, ValueError, IndexError):
                continue
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = [pid for pid in pids if _signal(pid, sig)]
            for _ in range(50):
                pids = [pid for pid in pids if _signal(pid, 0)]
                if not pids:
                    return
                time.sleep(0.1)

    # -- use
    def run(self, cmd: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", self.env), capture_output=True, text=True,
                              check=check, timeout=kw.pop("timeout", 60), **kw)

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False).stdout
        fields = {}
        for item in out.split():
            if "=" in item:
                k, v = item.split("=", 1)
                fields[k] = v
        return fields

    def wait(self, job_id: str, until, timeout: float = 600, poll: float = 1.0) -> dict[str, str]:
        """Polls the job until ``until(fields)``; fails on timeout with the job's state."""
        deadline = time.monotonic() + timeout
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if until(fields):
                return fields
            time.sleep(poll)
        raise AssertionError(f"job {job_id} timed out in state {fields.get('JobState')}: "
                             f"{fields}")

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            p = self.root / "log" / name
            if p.exists():
                parts.append(f"--- {name}\n" + "\n".join(p.read_text().splitlines()[-30:]))
        return "\n".join(parts)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    if not ensure_tools(["slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "scancel",
                         "munged"], ["slurm-wlm", "munge"]):
        pytest.skip("SLURM (slurm-wlm, munge) is not installed and cannot be installed here")
    if os.geteuid() != 0:
        pytest.skip("the test cluster runs munged/slurmctld/slurmd as root")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    cluster.write_config()
    try:
        cluster.start()
    except Exception:
        cluster.stop()
        raise
    yield cluster
    cluster.stop()
