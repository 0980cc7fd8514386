"""Helpers of the trainer tests: a small tokenized corpus, tiny configs, and
launching ``kvtrain train`` (one process or torchrun) as a subprocess. A
one-process launch (``run``, ``run_driver``) is a child forked from the test
server of this pytest process (``tests/forkserver.py``), which has imported torch
and megatron once; torchrun's ranks and ``start``'s launches are fresh processes.
Where CUDA is visible every launch is a fresh process: there the server's imports
initialise CUDA, and a child forked after that cannot use it (the lent H200).

Every launch runs in its own session (process group), which is killed once the
launch is over, so a test that SIGKILLs a trainer leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

from ..forkserver import ForkServer, NoExitCode
from ..scripts import without_rendezvous

REPO = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("driver.py")
PY = sys.executable
VOCAB = 384


@dataclass
class Corpus:
    prefix: str
    tokenizer: Optional[str]
    eod_id: Optional[int]
    kind: str  # "text" (data_tools: docs -> BPE -> shards) or "synthetic"

    def data_section(self, cache_dir: Path) -> dict:
        return {"type": "gpt", "paths": [self.prefix], "split": "90,10,0",
                "tokenizer": self.tokenizer, "eod_id": self.eod_id, "num_workers": 0,
                "cache_dir": str(cache_dir)}


def _data_tools_ready() -> bool:
    try:
        from data_tools import cli
    except Exception:
        return False
    return all(c in cli.COMMANDS for c in ("demo-corpus", "train-tokenizer", "preprocess"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Corpus:
    """Tokenized text: the data tools' corpus -> BPE tokenizer -> shards when they
    are there; otherwise a structured synthetic token corpus (megatron's
    IndexedDatasetBuilder). Vocabulary: 384."""
    root = tmp_path_factory.mktemp("corpus")
    if _data_tools_ready():
        def tool(*argv):
            subprocess.run([PY, "-m", "data_tools", *argv], check=True, capture_output=True,
                           cwd=root)
        tool("demo-corpus", "--output", "corpus.jsonl", "--max-mb", "0.6")
        tool("train-tokenizer", "--input", "corpus.jsonl", "--vocab-size", str(VOCAB),
             "--output", "tok")
        tool("preprocess", "--input", "corpus.jsonl", "--tokenizer", "tok.model",
             "--output-prefix", "shards/text", "--quiet")
        (idx,) = (root / "shards").glob("*.idx")
        return Corpus(str(idx.with_suffix("")), str(root / "tok.model"), None, "text")
    from kvtrain.data.synthetic import write_synthetic_corpus

    prefix = write_synthetic_corpus(root / "synthetic", num_docs=800, vocab_size=VOCAB, seed=0)
    return Corpus(prefix, None, VOCAB - 1, "synthetic")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One megatron index cache for all runs of the session."""
    return tmp_path_factory.mktemp("index_cache")


def tiny_config(corpus: Optional[Corpus], cache_dir: Path, **sections) -> dict:
    """A 2-layer, width-32 model on the test corpus (or mock data): seconds a run."""
    cfg = {
        "name": "t",
        "model": {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                  "num_query_groups": 2, "ffn_hidden_size": 64, "vocab_size": VOCAB,
                  "make_vocab_size_divisible_by": 64, "max_position_embeddings": 64,
                  "attention": "kv_shift"},
        "train": {"micro_batch_size": 2, "global_batch_size": 8, "seq_length": 32,
                  "max_steps": 6, "log_interval": 1, "eval_interval": None,
                  "kv_shift_stats_interval": None, "seed": 1234},
        "optimizer": {"lr": 3.0e-3, "lr_warmup_steps": 2},
        "data": (corpus.data_section(cache_dir) if corpus is not None else
                 {"type": "mock", "num_workers": 0, "cache_dir": str(cache_dir)}),
        "checkpoint": {"save_interval": 3, "keep_last": None},
        "wandb": {"enabled": False},
    }
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg.setdefault(section, {}).update(values)
        else:
            cfg[section] = values
    return cfg


def write_config(path: Path, cfg: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(args: list[str], nproc: int = 1, script: Optional[Path] = None) -> list[str]:
    """``kvtrain <args>`` (or ``script <args>``), under torchrun when nproc > 1."""
    target = [str(script)] if script else ["-m", "kvtrain.cli"]
    if nproc == 1:
        return [PY, *target, *args]
    return [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
            f"--master-port={free_port()}", *target, *args]


def launch_env(extra: Optional[dict] = None) -> dict:
    env = without_rendezvous()  # the one-rank group pytest may hold is not the launch's
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="offline", WANDB_SILENT="true")
    env.pop("PYTHONWARNINGS", None)
    env.update(extra or {})
    return env


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the launch's own session: its leftovers only
    except (ProcessLookupError, PermissionError):
        pass


def _kill_launch(proc: subprocess.Popen) -> None:
    """A launch past its time: its session and every process under it. torchrun starts
    each rank in a session of its own, and a rank that outlived it (hung: the driver's
    ranks are not bound to their launcher) held the output pipes open, so the test
    waited for their end forever instead of failing."""
    import psutil

    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    _kill_session(proc)
    for child in below:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@functools.lru_cache(maxsize=None)
def _cuda_visible() -> bool:
    """Whether CUDA is visible here (then no launch forks from the server)."""
    from kvtrain.testing import cuda_visible

    return cuda_visible()


def run(args: list[str], nproc: int = 1, env: Optional[dict] = None, timeout: float = 300,
        script: Optional[Path] = None, cwd: Optional[Path] = None) -> subprocess.CompletedProcess:
    """Runs a launch to completion; returns its exit code and output. ``kvtrain``
    in one process runs in a child of the test server (as ``python -m kvtrain.cli``),
    unless its environment sets a variable read at import differently."""
    full_env = launch_env(env)
    if nproc == 1 and script is None and not _cuda_visible() \
            and _SERVER.serves(full_env):
        source = ("import runpy, sys\n"
                  "sys.modules.pop('kvtrain.cli', None)\n"  # the driver's import: as if never
                  f"sys.argv = ['-m', *{list(args)!r}]\n"
                  "runpy.run_module('kvtrain.cli', run_name='__main__', alter_sys=True)\n")
        return _served(command(args), source, full_env, cwd or REPO, timeout)
    for _ in range(3):
        done = _launch(command(args, nproc, script), full_env, cwd or REPO, timeout)
        if not _port_taken(done):
            break
    return done


def _port_taken(done: subprocess.CompletedProcess) -> bool:
    """torchrun's own store could not listen on the port ``free_port`` had found free:
    another process took it in between (the tests' race, not kvtrain's; no rank ran)."""
    return done.returncode != 0 and "EADDRINUSE" in done.stderr and \
        "static_tcp_rendezvous" in done.stderr


def _launch(cmd: list[str], full_env: dict, cwd: Path, timeout: float
            ) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, env=full_env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_launch(proc)
        out, err = proc.communicate(timeout=60)
        raise AssertionError(f"launch timed out after {timeout}s:\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        _kill_session(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(args: list[str], nproc: int = 1, env: Optional[dict] = None,
          log: Optional[Path] = None) -> subprocess.Popen:
    """Starts a launch in the background (stdout+stderr to ``log``)."""
    sink = open(log, "w") if log else subprocess.DEVNULL
    return subprocess.Popen(command(args, nproc), env=launch_env(env), cwd=REPO, stdout=sink,
                            stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout=timeout)
    finally:
        _kill_session(proc)


# One-process launches (``kvtrain ...``, driver plans) run in children of this
# server: it has imported what they import, once per pytest process (~8 s of CPU
# each launch paid).
_SERVER = ForkServer(f"import sys\nsys.path[:0] = [{str(REPO)!r}, {str(DRIVER.parent)!r}]\n"
                     "from tests.train.driver import prepare\nprepare()\n")


def _served(args: list[str], source: str, env: dict, cwd: Path,
            timeout: float) -> subprocess.CompletedProcess:
    """``source`` as a child of the server, in a session of its own (killed once it is
    over, as ``run`` kills a launch's); ``args``: the command it stands for."""
    try:
        done = _SERVER.run(source, env, cwd=cwd, timeout=timeout, session=True)
    except NoExitCode as e:
        raise AssertionError(f"launch gave {e.why}:\n{e.done.stdout[-3000:]}\n"
                             f"{e.done.stderr[-3000:]}") from None
    return subprocess.CompletedProcess(args, done.returncode, done.stdout, done.stderr)


def run_driver(jobs: list[dict], plan: Path, nproc: int = 1, timeout: float = 400,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """Runs several trainings one after the other in one launch, each in a child
    forked from one process (tests/train/driver.py); one process: a child of the
    driver server. ``.job_codes`` maps each job's run_dir to its child's exit code
    (-9: SIGKILL)."""
    plan.write_text(json.dumps(jobs, indent=1))
    if nproc == 1 and not _cuda_visible():
        source = ("import sys\nfrom tests.train.driver import run_plan\n"
                  f"sys.exit(run_plan({str(plan)!r}))\n")
        result = _served([PY, str(DRIVER), str(plan)], source, launch_env(env), REPO, timeout)
    else:
        result = run([str(plan)], nproc=nproc, env=env, timeout=timeout, script=DRIVER)
    plan.with_suffix(".log").write_text(result.stdout + "\n--- stderr ---\n" + result.stderr)
    result.job_codes = {}
    for line in result.stdout.splitlines():
        if line.startswith("driver: job ") and " exit " in line:
            run_dir, code = line[len("driver: job "):].rsplit(" exit ", 1)
            result.job_codes.setdefault(run_dir, []).append(int(code))
    return result


def wait_for(predicate: Callable[[], bool], timeout: float = 120, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def metrics(run_dir: Path, kind: Optional[str] = "train") -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if kind is None or record.get("kind") == kind:
            out.append(record)
    return out


def by_iteration(records: list[dict]) -> dict[int, dict]:
    return {r["iteration"]: r for r in records}


def latest(run_dir: Path) -> Optional[str]:
    tracker = Path(run_dir) / "checkpoints" / "latest"
    return tracker.read_text().strip() if tracker.exists() else None
