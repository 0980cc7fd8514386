"""Test driver: runs many trainings in one launch, each in a forked child.

``python tests/train/driver.py PLAN.json`` (or under torchrun, once per rank).
PLAN is a list of jobs ``{"config", "run_dir", "overrides", "env", "faults", "cwd"}``.

The driver imports torch, megatron and kvtrain once and forks a child per job:
the child builds its own process group (on its own port), model and data,
trains, and exits; a crash hook in ``env`` (e.g. SIGKILL right after a
checkpoint) kills only that child, like a real pre-empted job, and the next
job (e.g. the resume) runs in a fresh child. Forking after the imports saves
the seconds of importing torch and megatron per run. No process group exists
in the parent, so the fork copies no communication state. A one-process plan
runs in a child of the tests' driver server (``tests/forkserver.py``), which has
done the imports (``prepare``) once for every plan of a pytest process.
Where CUDA is visible the driver forks before those imports (each child makes
its own): after them a forked child cannot use CUDA.

``faults`` are the arguments of ``tests.faults.injector.Faults``, the hooks
object handed to ``train`` (``{"stop_after": N}``: step N carries a stop
request, as if a signal had arrived during it). ``env`` is set in the child
only, and so is ``cwd`` (the child's working directory). Exit status: 0 when
every job's child exited as expected (its ``expect`` code, 0 by default; -9
for a SIGKILLed one), 1 otherwise; each job's code is printed as ``driver: job
<run_dir> exit <code>``. A job with ``"log": PATH`` writes its stdout and stderr
to PATH only, and a config or checkpoint error ends it as ``kvtrain train``
does: one line, exit code 2 (a KeyboardInterrupt: exit code 130).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: tests.faults

from kvtrain.cli import report  # noqa: E402 (light: no torch)
from kvtrain.config import ConfigError  # noqa: E402


def _child(job: dict, port: int) -> int:
    from kvtrain.config import load_config
    from kvtrain.train import train

    os.environ.update(job.get("env", {}))
    os.chdir(job.get("cwd", "."))
    if port:  # a fresh rendezvous of this job's children on their own port
        os.environ["MASTER_PORT"] = str(port)
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(job["config"], job.get("overrides", []), world_size=world)
    from tests.faults.injector import Faults

    return train(cfg, Path(job["run_dir"]), hooks=Faults(**job.get("faults", {})))


def _launcher_store():
    """A client of torchrun's own key-value store (None without torchrun)."""
    if "WORLD_SIZE" not in os.environ:
        return None
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         is_master=False, timeout=timedelta(minutes=5))


def _job_port(store, index: int) -> int:
    """A free port for the children of job ``index``: rank 0 picks, the others read."""
    if store is None:
        return 0
    key = f"kvtrain_test_driver/port/{index}"
    if os.environ.get("RANK") == "0":
        from kvtrain.backend import free_port

        store.set(key, str(free_port()))
    return int(store.get(key))


def _redirect(log) -> None:
    """The job's own output file (its stdout and stderr), when it names one."""
    if log:
        sink = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(sink, 1)
        os.dup2(sink, 2)
        os.close(sink)


def prepare() -> None:
    """The imports every job shares, done once before the first fork."""
    from kvtrain.commands.train import quiet_imports

    quiet_imports()
    import kvtrain.train.loop  # noqa: F401
    from kvtrain.train.processes import freeze_imports

    freeze_imports()  # as `kvtrain train` does (and torch._dynamo imported once for all)


def run_plan(plan_path: str) -> int:
    """Runs the plan's jobs one after the other, each in a forked child."""
    store = _launcher_store()
    ok = True
    for i, job in enumerate(json.loads(Path(plan_path).read_text())):
        port = _job_port(store, i)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _redirect(job.get("log"))
                code = _child(job, port)
            except ConfigError as e:  # as the CLI reports it (every rank's job ends)
                report(e, others_wait=None)
                code = 2
            except KeyboardInterrupt:  # as the CLI exits on it
                code = 130
            except BaseException:  # noqa: BLE001 - report and exit the child
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        sys.stdout.flush()
        # one write() of one line: atomic on a pipe, so the ranks' lines never interleave
        os.write(sys.stdout.fileno(), f"driver: job {job['run_dir']} exit {code}\n".encode())
        ok &= code == job.get("expect", 0)
    return 0 if ok else 1


def main(plan_path: str) -> int:
    """``python tests/train/driver.py PLAN``: the imports once, then the plan; where
    CUDA is visible no imports first (they initialise it: no child could use it)."""
    from kvtrain import testing

    if not testing.cuda_visible():
        prepare()
    return run_plan(plan_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
