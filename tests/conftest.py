"""Shared fixtures: a one-rank megatron environment on the CPU backend."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import tempfile

# One thread per test process (before torch is imported): make test runs two
# workers on two cores, and the ranks they start take one thread each. A second
# OpenMP thread per worker spins between ops: ~9 % more CPU for the same tests.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

# Ctrl-C as in a terminal: `make test &` or `nohup make test > log &` starts the
# suite with SIGINT ignored (POSIX, for a non-interactive shell's background jobs),
# and every process it starts inherits that; kvtrain's runners keep an inherited
# ignore (a background job's Ctrl-C is not theirs), so the tests of their Ctrl-C
# would have tested an ignored one, and failed.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    """Under xdist (make test), the controller sends the files to the workers in the
    order collected (``LONGEST_FIRST``), not by their number of tests
    (``--no-loadscope-reorder``), and builds the native KV-shift operators in the
    background while the workers start: the first test that needs them would build
    them (~35 s of one core, once per venv) while the other worker's test that needs
    them waits on the build lock, its core idle."""
    if hasattr(config, "workerinput") or not config.getoption("numprocesses", None):
        return
    config.option.loadscopereorder = False
    config._kvtrain_native_build = subprocess.Popen(
        [sys.executable, "-c", "from kvtrain.model.native_shift import build; build()"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


def pytest_unconfigure(config):
    build = getattr(config, "_kvtrain_native_build", None)
    if build is not None and build.poll() is None:  # a run cut short: the compiler too
        os.killpg(build.pid, signal.SIGKILL)  # (its temporary file is named .kv_shift-*)
        build.wait()


# The files of half a minute or more under `make test` (longest first): they start first, so
# that the two workers end together. xdist would order the files by their number of
# tests, and these have few: the last of them started near the end, and one worker
# ran it alone for a minute. A name missing here only costs that time.
LONGEST_FIRST = (
    "tests/model/test_kernel_compile.py",
    "tests/train/test_runs.py",
    "tests/train/test_exact_resume.py",
    "tests/launch/test_launchers.py",
    "tests/launch/test_slurm.py",
    "tests/faults/test_checkpoint_faults.py",
    "tests/benchmarks/test_step_benchmark.py",
    "tests/train/test_context_parallel_runs.py",
    "tests/faults/test_process_faults.py",
    "tests/faults/test_param_gather.py",
    "tests/faults/test_writer_faults.py",
)


def _longest_first(items: list) -> None:
    """``items`` in place: the files of LONGEST_FIRST first, each file's tests together
    and in their order, the other files after them in theirs."""
    def file(item) -> str:
        return item.nodeid.split("::")[0]

    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    files = dict.fromkeys(file(item) for item in items)  # in the order collected
    order = {f: (rank.get(f, len(rank)), n) for n, f in enumerate(files)}
    items.sort(key=lambda item: order[file(item)])


def pytest_collection_modifyitems(config, items):
    """The longest files first (xdist sends the files in this order: see
    ``pytest_configure``); `gpu` tests are skipped without a CUDA device (and
    only then)."""
    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed (1 rank, gloo on CPU) + megatron parallel state TP=PP=1."""
    from kvtrain.backend import init_distributed

    env = init_distributed(seed=1234)
    yield env


@pytest.fixture(scope="session", autouse=True)
def temporary_folder(tmp_path_factory):
    """The temporary files of the processes the tests start go under this session's
    pytest folder, which pytest rotates (it keeps three sessions'): the torchrun
    agents that tests kill left their /tmp/torchelastic_* behind, ~20 a run."""
    os.environ["TMPDIR"] = str(tmp_path_factory.mktemp("tmp"))
    tempfile.tempdir = None  # this process's too: recomputed from TMPDIR


@pytest.fixture(scope="session", autouse=True)
def frozen_imports():
    """The trainer's imports, frozen as a rank freezes them (``freeze_imports``): the
    collector's passes in this worker walk the tests' objects, not torch's."""
    import kvtrain.train.loop  # noqa: F401
    from kvtrain.train.processes import freeze_imports

    freeze_imports()


@pytest.fixture(scope="module", autouse=True)
def free_models():
    """After each test file: the runs its tests built (models, optimizers, gloo groups
    of three threads each that wake up to poll) are freed, not kept by megatron's DDP
    hooks for the rest of the worker's life."""
    yield
    if "kvtrain.backend.distributed" in sys.modules:
        from kvtrain.backend import release_models

        release_models()
        gc.collect()


@pytest.fixture
def mp1(single_rank):
    """Resets megatron's model-parallel state to TP=PP=1 and reseeds, per test."""
    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(1, 1)
    set_seed(1234)
    return single_rank


# The two arms of the research loop, trained once per session for the tests of
# generation (tests/inference) and of the comparison (tests/analysis).
ARM_STEPS = 8


@pytest.fixture(scope="session")
def arm_runs(tmp_path_factory) -> dict:
    """Tiny vanilla and KV-shift runs (mock data, same seed) trained by the real
    trainer in one driver launch: ``{"vanilla": run_dir, "kv_shift": run_dir}``,
    each with train, valid and kv_shift records and a checkpoint at ARM_STEPS."""
    from tests.train.conftest import run_driver, tiny_config, write_config

    root = tmp_path_factory.mktemp("arms")
    jobs, runs = [], {}
    for arm in ("vanilla", "kv_shift"):
        cfg = tiny_config(None, root / "cache", model={"attention": arm},
                          train={"max_steps": ARM_STEPS, "log_interval": 2, "eval_interval": 4,
                                 "eval_iters": 1, "kv_shift_stats_interval": 4},
                          checkpoint={"save_interval": ARM_STEPS})
        runs[arm] = root / arm
        jobs.append({"config": str(write_config(root / f"{arm}.yaml", cfg)),
                     "run_dir": str(runs[arm])})
    result = run_driver(jobs, root / "plan.json")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return runs
