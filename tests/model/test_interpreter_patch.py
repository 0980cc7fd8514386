"""The interpreter server's ``patch_language_once`` (tests/model/interpreter.py): a
``@triton.jit`` helper called inside a launch no longer patches ``triton.language``
again, and kernels compute what they computed."""

from __future__ import annotations

import platform
import sys

import pytest

from .interpreter import run_interpreted

if sys.platform != "linux" or platform.machine() != "x86_64":
    pytest.skip("the dev extra installs Triton on Linux x86_64 only", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _twice(v):
    return v * 2


@triton.jit
def _helpers(x_ptr, y_ptr, CALLS: tl.constexpr, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i)
    total = tl.zeros([N], dtype=tl.float32)
    for _ in tl.static_range(CALLS):  # a local helper and triton.language.standard's
        total += _twice(v) + tl.sum(v, axis=0)
    tl.store(y_ptr + i, total)


CHECK = r'''
import inspect, json, torch
from triton.runtime import interpreter
from tests.model.test_interpreter_patch import _helpers

calls, getmembers = [], inspect.getmembers
inspect.getmembers = lambda *a, **k: calls.append(1) or getmembers(*a, **k)
out = {"installed": getattr(interpreter.GridExecutor.__call__, "patches_once", False),
       "scans": {}, "values": {}}
x = torch.arange(8.0)
_helpers[(1,)](x, torch.empty_like(x), CALLS=2, N=8)  # the interpreter's first-call work
for n in (1, 4):
    y = torch.empty_like(x)
    calls.clear()
    _helpers[(1,)](x, y, CALLS=n, N=8)
    out["scans"][n] = len(calls)
    out["values"][n] = y.tolist()
print(json.dumps(out))
'''


def test_helpers_inside_a_launch_do_not_patch_the_language_again():
    ran = run_interpreted(CHECK)
    assert ran["installed"]
    # the launch's own scans, and those of the first helper to see another module
    # (triton.language.standard's tl.zeros); none per later helper call (unpatched:
    # 3-4 scans per call)
    assert ran["scans"]["1"] == ran["scans"]["4"] > 0
    for n in (1, 4):
        assert ran["values"][str(n)] == [n * (2 * i + 28.0) for i in range(8)]
