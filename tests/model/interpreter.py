"""Runs a check script in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``).

The interpreter is chosen when ``triton.jit`` decorates a kernel, at the import of
its module, so a check runs in a process of its own; it prints its results as one
JSON line last. Used by the tests of kvtrain's Triton kernels (the shift's, RoPE's).

Each check runs in a child forked from a server that has imported torch, megatron
and kvtrain's kernels with the interpreter on (one server per pytest process): the
checks of eight test files paid those imports (~8 s of CPU) eight times. The child
takes the environment and working directory of the call, like a fresh process.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 600  # seconds a check may take

# The server: reads one JSON request a line, forks a child that runs the check with
# the request's environment, working folder and output files, answers its exit code.
SERVER = r"""
import atexit, json, os, sys, traceback
import kvtrain  # first, as in every kvtrain process: megatron's torch.compile
import kvtrain.model.builder, triton  # decorations wait for a first call (no dynamo)
replies = os.fdopen(os.dup(1), "w")
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.environ.clear()
            os.environ.update(request["env"])
            os.chdir(request["cwd"])
            for fd, name in ((1, "stdout"), (2, "stderr")):
                os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            sys.stdin = open(os.devnull)
            try:
                exec(compile(request["check"], "<check>", "exec"), {"__name__": "__main__"})
                code = 0
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
            atexit._run_exitfuncs()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    replies.write(f"{os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}\n")
    replies.flush()
"""
_server: "subprocess.Popen | None" = None


def _environment() -> dict:
    # a one-process group of its own: not the address of the one pytest may hold
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def _started_server() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=REPO, env=_environment(),
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   start_new_session=True)  # its children: one group
    return _server


def run_interpreted(check: str) -> dict:
    """The JSON results of ``check`` run with ``TRITON_INTERPRET=1`` in a process of
    its own (forked from the interpreter server)."""
    global _server
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the dev extra installs Triton on Linux x86_64 only")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("triton is not installed: `make test` installs it (pyproject's dev extra) "
                    "so that kvtrain's Triton kernels are checked on the CPU")
    server = _started_server()
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        server.stdin.write(json.dumps({"check": check, "env": _environment(), "cwd": str(REPO),
                                       "stdout": str(out), "stderr": str(err)}) + "\n")
        server.stdin.flush()
        ready, _, _ = select.select([server.stdout], [], [], TIMEOUT)
        reply = server.stdout.readline() if ready else ""
        if not reply:  # a check past its time (or a server that died): a fresh one next
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.pid, signal.SIGKILL)  # the check's child too
            server.wait()
            _server = None
            why = err.read_text()[-3000:] if err.exists() else "the server died"
            pytest.fail(f"the interpreted check gave no result in {TIMEOUT} s: {why}")
        assert int(reply) == 0, err.read_text()[-3000:]
        return json.loads(out.read_text().strip().splitlines()[-1])


def autograd_nodes(out) -> list[str]:
    """The names of every node in ``out``'s backward graph (for a check script: which
    kernels a model's layers ran)."""
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names
