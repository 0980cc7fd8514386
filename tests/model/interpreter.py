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

import json
import os
import platform
import sys

import pytest

from ..forkserver import REPO, ForkServer, NoExitCode

TIMEOUT = 600  # seconds a check may take

_SERVER = ForkServer(  # the server's imports: the kernels' modules, interpreted
    "import kvtrain\n"  # first, as in every kvtrain process: megatron's torch.compile
    "import kvtrain.model.builder, triton\n")  # decorations wait for a first call


def _environment() -> dict:
    # a one-process group of its own: not the address of the one pytest may hold
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def run_interpreted(check: str) -> dict:
    """The JSON results of ``check`` run with ``TRITON_INTERPRET=1`` in a process of
    its own (forked from the interpreter server)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the dev extra installs Triton on Linux x86_64 only")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("triton is not installed: `make test` installs it (pyproject's dev extra) "
                    "so that kvtrain's Triton kernels are checked on the CPU")
    try:
        done = _SERVER.run(check, _environment(), timeout=TIMEOUT)
    except NoExitCode as e:
        pytest.fail(f"the interpreted check gave no result: {e}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


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
