"""kvtrain's Triton kernels compiled for Hopper (sm_90: H100/H200/H800), Ampere
(sm_80: A100) and Blackwell (sm_100: B200) on the CPU, by Triton's own compiler down to NVIDIA's machine code
(``benchmarks/kernel_compile.py``): every kernel at the launches training makes,
with no register spills and 16-byte loads and stores where the rows allow them.

Triton's interpreter, which the other kernel tests run in, executes the kernels as
Python: what only a GPU compile rejects (a call it cannot lower, a block beyond the
registers) passes there. The harness itself is checked here too: a kernel the
interpreter runs and the compiler rejects fails, and a kernel made to spill is seen
spilling.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys

import pytest
import torch

from ..scripts import load_script
from .interpreter import REPO, run_interpreted

if sys.platform != "linux" or platform.machine() != "x86_64":
    pytest.skip("the dev extra installs Triton on Linux x86_64 only", allow_module_level=True)

import triton  # noqa: E402  (make test installs it: pyproject's dev extra)
import triton.language as tl  # noqa: E402

ARCHS = ("90", "80", "100")
SASS_ARCH = "90"  # disassembled (~1 s a kernel): the machine code the tests below read


def _harness():
    return load_script(REPO / "benchmarks" / "kernel_compile.py", "kernel_compile")


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    """``benchmarks/kernel_compile.py --arch 90 80 100 --sass-arch 90`` with a Triton
    cache of its own (every kernel really compiled), its JSON. The SASS is read at
    sm_90: barriers, instruction counts and load widths follow from the kernels' code,
    not the architecture; registers, spills and occupancy are read at every one."""
    out = tmp_path_factory.mktemp("compile")
    env = dict(os.environ, TRITON_CACHE_DIR=str(out / "cache"))
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "benchmarks/kernel_compile.py", "--arch", *ARCHS,
                           "--sass-arch", SASS_ARCH, "--json", str(out / "report.json")],
                          cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sm_90 (H100/H200/H800)" in done.stdout and "sm_80 (A100)" in done.stdout
    assert "sm_100 (B200)" in done.stdout
    return json.loads((out / "report.json").read_text())


def test_every_kernel_compiles_for_ampere_hopper_and_blackwell(report):
    kernels = {fn.__name__ for fn in _harness().launch_points().values()}
    # the launch points found by what calls what: the kernels the wrappers launch
    assert kernels == {"_shift_fwd_kernel", "_shift_bwd_kernel", "_qkv_shift_fwd_kernel",
                       "_qkv_shift_bwd_kernel", "_rope_kernel", "_fwd_kernel", "_bwd_kernel",
                       "_ce_fwd_kernel", "_ce_bwd_kernel", "_swiglu_fwd_kernel",
                       "_swiglu_bwd_kernel"}
    for arch in ARCHS:
        compiled = report["arch"][arch]
        assert {c["kernel"] for c in compiled} == kernels, arch
        # a kernel is recorded at its first launch only: every case compiles something
        # no earlier case did
        assert {c["case"] for c in compiled} == set(_harness().CASES), arch


def test_no_kernel_spills_registers(report):
    for arch in ARCHS:
        for c in report["arch"][arch]:
            where = (arch, c["case"], c["kernel"])
            assert c["stack_bytes"] == 0, where
            assert c["local_ops"] == (0 if arch == SASS_ARCH else None), where
            assert 0 < c["registers"] <= 255, where


def test_every_kernel_keeps_three_programs_per_sm_at_any_window(report):
    """The shift's backward kernels hold a tile per lag: their token blocks shrink as
    the window grows (``triton_shift._launch``, ``triton_qkv_rope.tokens_per_block``),
    so that every kernel, window 3 in fp32 included, leaves three programs of 4 warps
    per SM to hide memory latency (window 2 or 3 held two, at 183-252 registers, with
    one block size for every window)."""
    for arch in ARCHS:
        low = [(c["case"], c["kernel"], c["registers"], c["warps_per_sm"])
               for c in report["arch"][arch] if c["warps_per_sm"] < 12]
        assert not low, (arch, low)


def test_aligned_rows_move_16_bytes_a_thread(report):
    """At the paper's shapes (bf16, head dim 128, a padded vocabulary, f = 5504) every
    kernel loads its rows 16 bytes a thread (``LDG.E.128``), stores them so (``STG.E.128``;
    the loss's forward stores three fp32 per row, no rows) and stores nothing 1 or 2
    bytes at a time: what a memory-bound kernel needs to reach the bandwidth. The
    unaligned cases (head dim 80, an unpadded vocabulary) may not."""
    aligned = [c for c in report["arch"]["90"] if "d128" in c["case"]
               or c["case"].startswith("loss bf16") or c["case"].startswith("swiglu bf16")]
    assert len(aligned) == 23  # 12 cases; one forward is an earlier case's
    for c in aligned:
        ops = c["memory_ops"]
        assert ops.get("LDG.E.128", 0) > 0, (c["case"], c["kernel"], ops)
        if c["kernel"] != "_ce_fwd_kernel":
            assert ops.get("STG.E.128", 0) > 0, (c["case"], c["kernel"], ops)
        narrow = [op for op in ops if re.fullmatch(r"STG\.E\.[US]?(8|16)", op)]
        assert not narrow, (c["case"], c["kernel"], ops)


def test_the_shifted_v_waits_for_the_whole_block_before_overwriting_queries(report):
    """The QKV node's forward with the shift writes V̂ over the query columns its
    block loaded; the loads are spread over the block's threads, so every thread must
    have loaded before any stores (``tl.debug_barrier``: ``BAR.SYNC``). The interpreter
    runs a block as one thread and cannot see the race; the machine code can."""
    fwd = {c["case"]: c["barriers"] for c in report["arch"][SASS_ARCH]
           if c["kernel"] == "_fwd_kernel"}
    assert all(n >= 1 for case, n in fwd.items() if "kv_shift" in case), fwd
    assert all(n == 0 for case, n in fwd.items() if "vanilla" in case), fwd


# ----------------------------------------------------------------------------- the harness
def doubled(v):
    return v * 2


@triton.jit
def _calls_python(x_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(x_ptr + i, doubled(tl.load(x_ptr + i)))  # a plain Python function: not lowered


@triton.jit
def _tile(x_ptr, y_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    v = tl.load(x_ptr + i[:, None] * N + i[None, :])  # [N, N]: N * N / 128 values a thread
    tl.store(y_ptr + i[:, None] * N + i[None, :], tl.exp(v) * tl.sum(v, axis=1)[:, None])


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
    """Triton's cache in the test's folder: compiled here, not read from ~/.triton."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))


def test_a_kernel_recorded_once_however_often_it_is_launched(own_cache):
    x = torch.randn(128, 128)

    def twice():
        for _ in range(2):
            _tile[(1,)](x, torch.empty_like(x), N=128, num_warps=4)
    assert len(_harness().compile_all(80, {"twice": twice, "again": twice})) == 1


def test_a_kernel_the_interpreter_runs_fails_to_compile_here(own_cache):
    ran = run_interpreted(
        "import json, torch\n"
        "from tests.model.test_kernel_compile import _calls_python\n"
        "x = torch.arange(16.0)\n"
        "_calls_python[(1,)](x, N=16)\n"
        "print(json.dumps({'x': x.tolist()}))\n")
    assert ran["x"] == [2.0 * i for i in range(16)]
    with pytest.raises(Exception, match="doubled"):
        _harness().compile_all(90, {"python call": lambda: _calls_python[(1,)](
            torch.zeros(16), N=16)})


def test_spills_are_seen(own_cache):
    x = torch.randn(128, 128)
    harness = _harness()
    fits, spills = (harness.compile_all(90, {"tile": lambda: _tile[(1,)](
        x, torch.empty_like(x), N=128, num_warps=4, **limit)})[0] for limit in
        ({}, {"maxnreg": 32}))
    assert fits.stack_bytes == 0 and fits.local_ops == 0 and fits.registers > 32
    assert spills.registers <= 32 and spills.stack_bytes > 0 and spills.local_ops > 0
    assert spills.constexprs == {"N": 128} and spills.memory_ops["LDG.E.128"] > 0


def test_occupancy_follows_registers_and_shared_memory():
    h = _harness()
    assert h.warps_per_sm(90, 32, 4, 0) == 64  # the SM's warp limit
    assert h.warps_per_sm(90, 128, 4, 0) == 16  # 65536 registers / (128 x 32 threads)
    assert h.warps_per_sm(90, 255, 4, 0) == 8  # 255 rounds up to 256 a thread
    assert h.warps_per_sm(80, 32, 4, 100_000) == 4  # one block's shared memory per SM


def test_the_fused_node_is_no_larger_than_the_kernels_it_replaces(report):
    """The QKV node (split, K+V shift and RoPE of Q and K in one pass) against the shift
    node and two RoPE launches it replaces, in SASS instructions each way. Computing
    cos and sin in the kernels (libdevice's, with their range reduction, per value)
    made the node's backward 12.5k instructions against 9.5k for the three kernels;
    loading them from ``triton_rope.cos_sin``'s table, 0.9k."""
    size = {(c["case"], c["kernel"]): c["instructions"] for c in report["arch"][SASS_ARCH]}
    rope = size["rope bf16 d128", "_rope_kernel"]  # forward and inverse alike
    assert size["qkv+rope kv_shift bf16 d128", "_fwd_kernel"] <= (
        size["qkv shift bf16 d128", "_qkv_shift_fwd_kernel"] + 2 * rope)
    assert size["qkv+rope kv_shift bf16 d128", "_bwd_kernel"] <= (
        size["qkv shift bf16 d128", "_qkv_shift_bwd_kernel"] + 2 * rope)


def test_without_triton_the_script_says_so_in_one_line():
    blocked = ("import builtins, runpy, sys\n"
               "real = builtins.__import__\n"
               "def no_triton(name, *a, **k):\n"
               "    if name.split('.')[0] == 'triton':\n"
               "        raise ImportError(name)\n"
               "    return real(name, *a, **k)\n"
               "builtins.__import__ = no_triton\n"
               "sys.argv = ['kernel_compile.py']\n"
               "runpy.run_path('benchmarks/kernel_compile.py', run_name='__main__')\n")
    done = subprocess.run([sys.executable, "-c", blocked], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "needs the triton package" in done.stderr
