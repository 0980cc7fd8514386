"""The benchmarks that time or count one part (``shift_kernel.py``,
``shift_saved_bytes.py``, ``preprocess.py``, ``host_work.py``, ``peak_memory.py``) run on tiny shapes and print what
docs/performance.md quotes from them: a benchmark that no longer runs would
otherwise be found only on the GPU machine, where ``checks.sh`` calls
``shift_kernel.py``, or by the next person to measure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvtrain.model import native_shift

from ..scripts import load_script, script_env

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
ROW = re.compile(r"^  (.+?)\s+median\s+([0-9.]+) ms \(\s*([0-9.]+) x (\w+)\), min")


def _rows(out: str) -> dict[str, float]:
    """shift_kernel.py's rows: implementation -> its median over the reference's."""
    return {m[1]: float(m[3]) for m in map(ROW.match, out.splitlines()) if m}


@pytest.mark.parametrize("args, expected", [
    ([], ["shift_tokens", "fused (torch)", "fused (native)"]),
    (["--qkv", "--heads-per-group", "2", "--window", "2", "--docs", "3"],
     ["split (vanilla)", "shift_tokens", "fused (torch)", "fused (native)"]),
    (["--qkv", "--rope"], ["split+RoPE (vanilla)", "shift+RoPE"]),
])
def test_shift_kernel_times_each_path_of_the_cpu(args, expected, capsys):
    if native_shift.unavailable_reason() is not None:  # the native operators: a compiler
        expected = [name for name in expected if name != "fused (native)"]
    bench = load_script(BENCH / "shift_kernel.py", "kvtrain_bench_shift_kernel")
    bench.main(["--seq", "48", "--batch", "2", "--heads", "2", "--dim", "8", "--repeat", "2",
                "--device", "cpu", *args])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert list(rows) == expected, out
    assert rows[expected[0]] == 1.0 and all(r > 0 for r in rows.values()), out


def _run(script: str, *args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=cwd,
                          env=script_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_shift_saved_bytes_counts_no_extra_activation_with_mha(tmp_path):
    """What performance.md quotes: with MHA the fused shift keeps vanilla's bytes to
    the byte under a causal mask (the reference ``shift_tokens`` keeps more)."""
    out = _run("shift_saved_bytes.py", "--seq", "32", "--hidden", "64", "--heads", "4",
               "--groups", "4", cwd=tmp_path)
    ratio = {m.group(1, 2, 3): float(m[4]) for m in re.finditer(
        r"^  (\w+)\s+(\S+)\s+(causal|3 docs)\s+\d+ B in\s+\d+ tensors \(([0-9.]+) x vanilla\)",
        out, re.M)}
    assert len(ratio) == 8, out
    kernels = ["torch"] + (["native"] if native_shift.unavailable_reason() is None else [])
    for kernel in kernels:
        assert ratio[("kv_shift", kernel, "causal")] == 1.0, out
        assert ratio[("kv_shift", kernel, "3 docs")] < 1.01, out  # the document ids
    assert ratio[("kv_shift", "shift_tokens", "causal")] > 1.05, out


def test_preprocess_benchmark_prints_its_ratio(tmp_path):
    out = _run("preprocess.py", "--mb", "1", "--repeat", "1", "--vocab-size", "500",
               "--workers", "1", "--workdir", str(tmp_path / "work"), cwd=tmp_path)
    ours, ceiling = (int(re.search(rf"^{side}\s+([0-9,]+) tokens/s", out, re.M)[1]
                         .replace(",", "")) for side in ("ours", "ceiling"))
    ratio = float(re.search(r"^ratio\s+([0-9.]+)", out, re.M)[1])
    assert ours > 0 and ceiling > 0 and ratio == pytest.approx(ours / ceiling, abs=2e-3), out
    assert (tmp_path / "work").is_dir()  # --workdir keeps the files


def test_host_work_counts_what_the_shift_adds_on_the_gpus_kernels(tmp_path):
    """``host_work.py`` (the host's work of a step on the GPU's kernels, in Triton's
    interpreter): the KV shift launches no kernel more than vanilla (the QKV node
    shifts inside RoPE's) and dispatches at most 3 operators more per layer in the
    backward (the coefficients' reduction, its split, the add into main_grad, less the
    buffer the in-place backward does not allocate, plus the in-place gradient's
    detach), nothing more in the forward, nor in the update (megatron's clipping
    detached each gradient, the coefficients' 2 a layer among them: ``main_grads``)."""
    out_json = tmp_path / "host.json"
    out = _run("host_work.py", str(REPO / "configs" / "bench" / "host.yaml"),
               "--set", "model.num_layers=2", "--json", str(out_json), cwd=tmp_path)
    import json

    result = json.loads(out_json.read_text())
    totals = result["totals"]
    assert totals["kv_shift"]["launches"] == totals["vanilla"]["launches"], out
    assert sum(totals["vanilla"]["launches"].values()) > 0, out  # the Triton kernels ran
    extra = {phase: totals["kv_shift"]["ops"][phase] - totals["vanilla"]["ops"][phase]
             for phase in totals["vanilla"]["ops"]}
    assert extra["forward"] == 0 and 0 < extra["backward"] <= 3 * 2, out
    assert extra["update"] == 0, out
    assert "kv_shift - vanilla, ops, backward:" in out and "aten._foreach_add_" in out, out


def test_host_work_counts_the_shift_beside_megatrons_rope(tmp_path):
    """With megatron's RoPE (``model.rope_kernel: torch``, what session 44's H200 runs
    took) vanilla's QKV split is views and no kernel, so the shift's own split-and-shift
    node is one kernel more a layer each way (``_qkv_shift_fwd_kernel``,
    ``_qkv_shift_bwd_kernel``) and its new Q, K and V: what the default path, whose
    Triton node does the split for both arms, does not pay (the test above)."""
    out_json = tmp_path / "host.json"
    out = _run("host_work.py", str(REPO / "configs" / "bench" / "host.yaml"),
               "--set", "model.num_layers=2", "--set", "model.rope_kernel=torch",
               "--json", str(out_json), cwd=tmp_path)
    import json

    assert "RoPE: torch (model.rope_kernel: torch)" in out, out
    launches = json.loads(out_json.read_text())["differences"]["launches"]  # [name, +n, total]
    assert launches["forward"] == [["_qkv_shift_fwd_kernel", 2, 2]], out
    assert launches["backward"] == [["_qkv_shift_bwd_kernel", 2, 2]], out
    assert launches["update"] == launches["finalize"] == [], out


def test_peak_memory_finds_no_activation_more_alive_at_the_shifts_peak(tmp_path):
    """``peak_memory.py`` (each arm's build and steps on the GPU's kernels, the caching
    allocator's count replayed): at each arm's peak the same blocks are alive, less the
    coefficients' own state (their weights, gradients, main weights and Adam's moments,
    made at the build and the first update): nothing the forward, backward or gradient
    reduction made. The peak is the backward's, the allocator's blocks at least what is
    alive; the two arms' requests part only at the coefficients' own."""
    out_json = tmp_path / "peak.json"
    out = _run("peak_memory.py", str(REPO / "configs" / "bench" / "host.yaml"),
               "--set", "model.num_layers=2", "--set", "train.micro_batch_size=2",
               "--set", "train.global_batch_size=2", "--json", str(out_json), cwd=tmp_path)
    import json

    result = json.loads(out_json.read_text())
    arms = result["arms"]
    for arm in arms.values():
        assert arm["peak_at"].endswith("in the backward"), out
        assert arm["alive_at_peak_by_phase"]["forward"] > 0, out  # activations counted
        assert arm["allocator_peak_bytes"] >= arm["peak_bytes"] > 0, out
    assert {d[0] for d in result["differences"]} <= {"build", "update"}, out
    extra = arms["kv_shift"]["peak_bytes"] - arms["vanilla"]["peak_bytes"]
    assert 0 < extra <= 32 * 1024, out  # 2 layers x 2 tensors of [2 groups, 2], 512 B blocks
    # the arms hand the allocator the same requests in the same order but the
    # coefficients' own (a few 512 B blocks each) and the buffers they grow: no QKV-sized
    # request of one arm's (vanilla's backward allocated the QKV output's gradient, 16 KiB
    # here, where the shift's wrote over the QKV output: the small shape's packing moved)
    apart = result["requests_apart"]
    assert apart and all(abs(size) <= 4096 * n for *_, size, n in apart), apart


def test_peak_memory_refuses_what_it_does_not_replay_in_one_line(tmp_path):
    """An explicit kernel choice is not the GPU path it replays: one line, no JSON."""
    done = subprocess.run(
        [sys.executable, str(BENCH / "peak_memory.py"), str(REPO / "configs" / "bench" /
                                                           "host.yaml"),
         "--set", "model.kv_shift.kernel=torch", "--json", str(tmp_path / "x.json")],
        cwd=tmp_path, env=script_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "model.kv_shift.kernel" in lines[0], done.stderr[-3000:]
    assert not (tmp_path / "x.json").exists()
