"""Runs a check script in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``).

The interpreter is chosen when ``triton.jit`` decorates a kernel, at the import of
its module, so a check runs in a fresh process; it prints its results as one JSON
line last. Used by the tests of kvtrain's Triton kernels (the shift's, RoPE's).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_interpreted(check: str) -> dict:
    """The JSON results of ``check`` run by ``python -c`` with ``TRITON_INTERPRET=1``."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the dev extra installs Triton on Linux x86_64 only")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("triton is not installed: `make test` installs it (pyproject's dev extra) "
                    "so that kvtrain's Triton kernels are checked on the CPU")
    # a one-process group of its own: not the address of the one pytest may hold
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    # kvtrain first, as in every kvtrain process: megatron's torch.compile decorations
    # wait for a first call (kvtrain._megatron_jit), not the ~5 s of importing dynamo
    done = subprocess.run([sys.executable, "-c", "import kvtrain\n" + check], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
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
