"""The Triton shift kernels, run by Triton's interpreter on the CPU.

The kernels (``kvtrain.model.shift_kernels``) are what a GPU run computes the
shift with; on the CPU ``TRITON_INTERPRET=1`` executes the same kernel source
(every program of the grid, with numpy), so their indexing, masks, document
resets and coefficient sums are checked here against ``shift_tokens`` on every
``make test``. What the interpreter cannot check - compilation for a GPU and
speed - is left to the ``gpu`` tests (tests/model/test_fused_shift.py).

The interpreter is chosen when Triton's ``jit`` decorates the kernels, at the
import of ``shift_kernels``, so the check runs in a fresh interpreter process.
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

CHECK = r"""
import json, sys
import torch
from kvtrain.model import shift_kernels
from kvtrain.model.kv_shift import shift_tokens

assert shift_kernels.triton_available(), "triton did not import"
torch.manual_seed(0)
results = []
for window in (1, 2, 3):
    for docs in ("none", "starts"):
        # several token blocks per program grid, d not a power of two, strided x
        s, b, h, d = 70, 2, 3, 40
        mixed = torch.randn(s, b, h, 3 * d)
        x = mixed[..., d:2 * d]
        coef = torch.randn(h, window + 1)
        ids = None
        if docs == "starts":
            ids = torch.zeros(s, b, dtype=torch.int64)
            for row, starts in enumerate(([1, 2, 17, 40], [5, 6, s - 1])):
                for t in starts:
                    ids[t:, row] += 1
        dy = torch.randn(s, b, h, d)
        out = {}
        for name, fn in (("triton", lambda a, c: shift_kernels.fused_shift(a, c, ids, "triton")),
                         ("ref", lambda a, c: shift_tokens(a.double(), c.double(), ids))):
            a, c = x.detach().clone().requires_grad_(), coef.detach().clone().requires_grad_()
            y = fn(a, c)
            da, dc = torch.autograd.grad(y, (a, c), dy.to(y.dtype))
            out[name] = (y.double(), da.double(), dc.double())
        err = [(t - r).abs().max().item() for t, r in zip(out["triton"], out["ref"])]
        results.append({"window": window, "docs": docs, "y": err[0], "dx": err[1],
                        "dcoef": err[2]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the dev extra installs Triton on Linux x86_64 only")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("triton is not installed: `make test` installs it (pyproject's dev extra) "
                    "so that the Triton shift kernels are checked on the CPU")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", CHECK], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_triton_kernels_match_shift_tokens(interpreted):
    """Values, input and coefficient gradients, windows 1-3, with and without
    document resets: fp32 kernels against the fp64 reference."""
    assert len(interpreted) == 6
    for r in interpreted:
        assert r["y"] < 1e-5 and r["dx"] < 1e-5, r
        assert r["dcoef"] < 1e-3, r  # sums of s*b*d = 5600 fp32 products per lag
