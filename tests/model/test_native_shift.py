"""The native KV-shift operators (kvtrain.model.native_shift): how they are built,
cached and chosen, and that their results do not depend on the thread count.
Their values and gradients are checked against shift_tokens, next to the torch
path's, in test_fused_shift.py."""

from __future__ import annotations

import multiprocessing
import stat
from pathlib import Path

import pytest
import torch

from kvtrain.config import ConfigError
from kvtrain.model import native_shift
from kvtrain.model.shift_kernels import choose_kernel, fused_shift, fused_shift_qkv

TINY = "int kvtrain_tiny(void) { return 1; }\n"  # builds in a blink; the mechanism is the same


def fake_compiler(tmp_path: Path, body: str) -> str:
    """An executable standing for the compiler: ``--version`` answers, else ``body``
    runs with the compiler's arguments in "$@" (``-o OUT`` among them)."""
    path = tmp_path / "fake-cxx"
    path.write_text("#!/bin/sh\nif [ \"$1\" = --version ]; then echo fake 1.0; exit 0; fi\n"
                    + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def output_of(args_var: str = "$@") -> str:
    """Shell that finds the argument after -o and writes a file there."""
    return ('out=""; prev=""; for a in ' + args_var + '; do [ "$prev" = -o ] && out="$a"; '
            'prev="$a"; done; echo lib > "$out"')


def test_build_compiles_once_into_the_cache(tmp_path):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    cache = tmp_path / "cache"
    first = native_shift.build(source, cache)
    mtime = first.stat().st_mtime_ns
    assert first.parent == cache and first.name.startswith("kv_shift-") and first.exists()
    assert native_shift.build(source, cache) == first and first.stat().st_mtime_ns == mtime
    source.write_text(TINY + "// changed\n")  # a new source is a new library
    assert native_shift.build(source, cache) != first
    assert not [p for p in cache.iterdir() if p.name.startswith(".kv_shift-")]  # no temp files


def test_missing_or_failing_compiler_gives_one_line_and_leaves_nothing(tmp_path):
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    with pytest.raises(native_shift.NativeUnavailable, match="no C\\+\\+ compiler: 'nope-cxx'"):
        native_shift.build(source, tmp_path / "a", compiler="nope-cxx")
    failing = fake_compiler(tmp_path, 'echo "tiny.cpp:1: error: boom" >&2; exit 1')
    with pytest.raises(native_shift.NativeUnavailable) as e:
        native_shift.build(source, tmp_path / "b", compiler=failing)
    assert "error: boom" in str(e.value) and "\n" not in str(e.value)
    assert [p.name for p in (tmp_path / "b").iterdir()] == [".build.lock"]


def test_a_ctrl_c_does_not_kill_the_compiler(tmp_path):
    """Ctrl-C reaches the terminal's whole process group; the trainer takes it as a
    stop after the step (train.signals), so the compile it waits on must live on:
    it was killed ("failed on kv_shift.cpp: no output") and the run went on with
    the torch ops. A compiler killed all the same is named as such."""
    import os
    import signal
    import subprocess
    import sys
    import time

    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    log = tmp_path / "calls"
    slow = fake_compiler(tmp_path, f"echo call >> {log}; sleep 2; " + output_of())
    script = ("import signal, sys\n"
              "signal.signal(signal.SIGINT, lambda *a: None)  # the trainer's: a flag\n"
              "from pathlib import Path\nfrom kvtrain.model import native_shift\n"
              f"print(native_shift.build(Path({str(source)!r}), Path({str(tmp_path / 'c')!r}), "
              f"compiler={slow!r}))\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not log.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGINT)  # what the terminal does
        out = child.communicate(timeout=60)[0]
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, out
    assert Path(out.strip().splitlines()[-1]).read_text() == "lib\n"

    killed = fake_compiler(tmp_path, "kill -TERM $$")
    with pytest.raises(native_shift.NativeUnavailable,
                       match="fake-cxx was killed by SIGTERM on tiny.cpp$"):
        native_shift.build(source, tmp_path / "d", compiler=killed)


def test_unwritable_cache_is_named(tmp_path):
    """A cache folder that cannot be made (here a file stands in its way) is named."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    (tmp_path / "file").write_text("")
    with pytest.raises(native_shift.NativeUnavailable, match="cannot write the kernel cache"):
        native_shift.build(source, tmp_path / "file" / "kernels")


def _build_in(source: str, cache: str, compiler: str, queue) -> None:
    queue.put(str(native_shift.build(Path(source), Path(cache), compiler=compiler)))


def test_ranks_starting_together_build_once(tmp_path):
    """Two processes (two ranks of one launch) ask at once: one compiles, both load it."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    log = tmp_path / "calls"
    slow = fake_compiler(tmp_path, f'echo call >> {log}; sleep 1; ' + output_of())
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_in, args=(str(source), str(tmp_path / "c"), slow, queue))
             for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    paths = {queue.get(timeout=5) for _ in procs}
    assert len(paths) == 1 and Path(paths.pop()).read_text() == "lib\n"
    assert log.read_text().count("call") == 1


def test_cache_folder_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTRAIN_KERNEL_CACHE", str(tmp_path / "k"))
    assert native_shift.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KVTRAIN_KERNEL_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native_shift.cache_dir() == tmp_path / "xdg" / "kvtrain" / "kernels"


def test_the_operators_build_here():
    """This machine has a C++ compiler: ``auto`` must get the native kernel (a silent
    fall back to torch ops would leave it unmeasured)."""
    assert native_shift.unavailable_reason() is None
    assert hasattr(torch.ops.kvtrain, "shift_qkv")


def test_results_do_not_depend_on_the_thread_count():
    """Above the grain size the operators run on torch's threads; the coefficient
    sums are added per block, in order: bit-identical with 1 and 2 threads."""
    s, b, g, q, d = 256, 4, 4, 32, 32  # 131k K/V values: threaded
    mixed = torch.randn(s, b, g, q + 2 * d, requires_grad=True)
    coefs = [torch.randn(g, 3, requires_grad=True) for _ in range(2)]
    doc_ids = torch.cumsum((torch.rand(s, b) < 0.02).long(), 0)
    grads = [torch.randn(s, b, g, q), torch.randn(s, b, g, d), torch.randn(s, b, g, d)]
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = fused_shift_qkv(mixed, *coefs, doc_ids, q, impl="native")
            results.append([*out, *torch.autograd.grad(out, (mixed, *coefs), grads)])
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


def test_bad_inputs_are_refused_in_one_line():
    with pytest.raises(RuntimeError, match="float32 or float64 only"):
        torch.ops.kvtrain.shift(torch.zeros(2, 1, 1, 4, dtype=torch.float16), torch.ones(1, 2),
                                None)
    with pytest.raises(RuntimeError, match="doc_ids must be int64"):
        torch.ops.kvtrain.shift(torch.zeros(2, 1, 1, 4), torch.ones(1, 2),
                                torch.zeros(3, 1, dtype=torch.int64))
    # bf16 asked of the native kernel through fused_shift: torch ops take it
    x = torch.randn(4, 1, 1, 4).bfloat16()
    assert fused_shift(x, torch.ones(1, 2), impl="native").dtype == torch.bfloat16


# ----------------------------------------------------------------------------- the choice
def test_choose_kernel_on_this_machine():
    assert choose_kernel("auto", False, torch.float32) == ("native", "auto: CPU")
    assert choose_kernel("native", False, torch.float64) == ("native",
                                                             "model.kv_shift.kernel: native")
    assert choose_kernel("torch", False, torch.float32)[0] == "torch"
    name, why = choose_kernel("auto", False, torch.bfloat16)
    assert name == "torch" and "fp32/fp64" in why
    with pytest.raises(ConfigError, match="native takes fp32/fp64"):
        choose_kernel("native", False, torch.bfloat16)
    with pytest.raises(ConfigError, match="triton needs a GPU"):
        choose_kernel("triton", False, torch.float32)
    with pytest.raises(ConfigError, match="native is the CPU kernel"):
        choose_kernel("native", True, torch.bfloat16)
    with pytest.raises(ConfigError, match="must be auto, native, torch or triton"):
        choose_kernel("cuda", False, torch.float32)


def test_choose_kernel_without_a_compiler(monkeypatch):
    """Where the operators cannot be built, ``auto`` says why and takes torch ops;
    ``native`` stops with the reason."""
    monkeypatch.setattr(native_shift, "unavailable_reason",
                        lambda: "no C++ compiler: 'c++' not found (set CXX)")
    name, why = choose_kernel("auto", False, torch.float32)
    assert name == "torch" and why == ("auto: native kernel unavailable: no C++ compiler: "
                                       "'c++' not found (set CXX)")
    with pytest.raises(ConfigError, match="native kernel is unavailable: no C\\+\\+ compiler"):
        choose_kernel("native", False, torch.float32)


def test_gpu_choice_follows_triton(monkeypatch):
    import kvtrain.model.shift_kernels as kernels

    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    assert choose_kernel("auto", True, torch.bfloat16) == ("triton", "auto: GPU")
    # fp64 keeps fp64 accumulation: torch ops
    assert choose_kernel("auto", True, torch.float64) == (
        "torch", "auto: the Triton kernels accumulate in fp32, not fp64")
    monkeypatch.setattr(kernels, "triton_available", lambda: False)
    assert choose_kernel("auto", True, torch.bfloat16) == ("torch",
                                                           "auto: Triton is not installed")
    with pytest.raises(ConfigError, match="Triton is not installed"):
        choose_kernel("triton", True, torch.bfloat16)


def test_config_key_is_strict(tmp_path):
    from kvtrain.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text("model:\n  attention: kv_shift\n  kv_shift:\n    kernel: cuda\n")
    with pytest.raises(ConfigError, match="kv_shift.kernel"):
        load_config(str(path))
    path.write_text("model:\n  attention: kv_shift\n  kv_shift:\n    kernel: native\n")
    assert load_config(str(path)).model.kv_shift.kernel == "native"
