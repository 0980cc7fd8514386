"""``benchmarks/step.py``: vanilla against KV shift through the trainer's step.

The numbers themselves are measured by hand (docs/performance.md); here the
benchmark runs for two steps per arm on a tiny config and its JSON is checked
for the fields and sane values, and the keys it owns are refused in one line.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from ..scripts import load_script, python_path, script_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "step.py"
TINY = REPO / "configs" / "tiny.yaml"


def _step_module():
    return load_script(SCRIPT, "kvtrain_bench_step")


def _env() -> dict:
    return script_env()


def _bench(tmp_path: Path, config: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """Runs the benchmark for 2 timed steps per arm; its output and JSON."""
    out = tmp_path / "step.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(config), "--steps", "2", "--warmup", "1", *args,
         "--json", str(out)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text())


def test_two_steps_each_give_the_fields_and_sane_values(tmp_path):
    from kvtrain.train.optimizer import adam_kernel, megatron_adam_class

    done, result = _bench(tmp_path, TINY, "--backend", "local",
                          "--set", "train.global_batch_size=4", "--profile")
    assert result["backend"]["name"] == "local"
    assert result["backend"]["shift_kernel"] == "native (auto: CPU)"  # what the shift ran on
    assert result["backend"]["optimizer"] == adam_kernel(megatron_adam_class())  # and the update
    assert result["device"] in ("cpu", "cuda")
    assert result["world_size"] == 1 and result["steps"] == 2 and result["warmup"] == 1
    assert result["tokens_per_step"] == 4 * 32  # global batch 4 x seq 32 (tiny.yaml)
    assert result["model"]["layers"] == 2 and result["model"]["seq"] == 32
    for name in ("vanilla", "kv_shift"):
        arm = result["arms"][name]
        assert len(arm["step_times_s"]) == 2 and all(t > 0 for t in arm["step_times_s"])
        assert arm["step_time_median_s"] > 0 and arm["step_time_mean_s"] > 0
        assert arm["tokens_per_s"] == pytest.approx(128 / arm["step_time_median_s"])
        assert arm["tflops_per_device"] > 0 and arm["flops_per_step"] > 0
        assert arm["peak_memory_bytes"] > 0  # a model, its optimizer and a step's activations
        # the peak of the bytes asked for: CUDA's allocator counts it, the CPU has no count
        on_gpu = result["device"] == "cuda"
        assert (0 < arm["peak_requested_bytes"] <= arm["peak_memory_bytes"] if on_gpu
                else arm["peak_requested_bytes"] is None)
    # the shift's FLOPs are counted (kvtrain/train/flops.py), so kv_shift's are larger
    flops = {name: arm["flops_per_step"] for name, arm in result["arms"].items()}
    assert flops["kv_shift"] > flops["vanilla"]
    if result["device"] == "cpu":
        assert result["arms"]["vanilla"]["mfu"] is None  # no CPU peak unless one is given
    ratio = result["ratio"]
    assert min(ratio["step_time_median"], ratio["step_time_mean"],
               ratio["step_time_paired_median"]) > 0
    assert 0.5 < ratio["peak_memory"] < 2.0  # same model but four scalars per KV head
    assert (ratio["peak_requested"] is None) == (result["device"] == "cpu")
    # each timed step's gradient norm, and whether it clipped (a pass over every gradient)
    clip = result["clip_grad"]
    for arm in result["arms"].values():
        assert len(arm["grad_norms"]) == 2 and all(n > 0 for n in arm["grad_norms"])
        assert arm["clipped"] == [n + 1e-6 > clip for n in arm["grad_norms"]], (clip, arm)
    # each step's forward-backward and the rest, which make up the step
    for arm in result["arms"].values():
        for fb, rest, whole in zip(arm["forward_backward_s"], arm["update_s"],
                                   arm["step_times_s"]):
            assert 0 < fb and 0 < rest and fb + rest <= whole, arm
        assert arm["forward_backward_median_s"] == statistics.median(arm["forward_backward_s"])
    assert ratio["forward_backward_median"] > 0 and ratio["update_median"] > 0
    assert "phases (median ms, vanilla / kv_shift;" in done.stdout
    clipped_any = any(any(a["clipped"]) for a in result["arms"].values())
    assert ("gradients clipped (optimizer.clip_grad" in done.stdout) == clipped_any
    assert "kv_shift / vanilla: step time" in done.stdout
    _check_profile(result["profile"], on_gpu=result["device"] == "cuda")
    assert "profile: what the KV shift changes: " in done.stdout
    _check_device_summary(tmp_path, result)


def test_steps_that_clip_are_counted_per_arm(tmp_path):
    """A bound every norm exceeds: every timed step of both arms clips, said in a line,
    and the paired median over the rounds clipped alike is over all of them."""
    done, result = _bench(tmp_path, TINY, "--backend", "local",
                          "--set", "optimizer.clip_grad=1e-9")
    assert all(a["clipped"] == [True, True] for a in result["arms"].values()), result["arms"]
    ratio = result["ratio"]
    assert ratio["step_time_paired_median_clipped_alike"] == ratio["step_time_paired_median"]
    assert ("gradients clipped (optimizer.clip_grad 1e-09) in vanilla 2/2, kv_shift 2/2 "
            "timed steps") in done.stdout, done.stdout


def _check_profile(profile: dict, on_gpu: bool) -> None:
    """``--profile``: one profiled step per arm; the shift's own operator (the native
    C++ one on the CPU, the Triton kernels on a GPU) is among what it changes."""
    for arm in profile["arms"].values():
        assert arm["wall_ms"] > 0 and arm["host_ops"] > 0 and len(arm["top"]) > 0
        assert all(ms >= 0 and calls > 0 for _, ms, calls in arm["top"])
        assert (arm["busy"] is not None) == on_gpu
    shift_ops = [row for row in profile["extra"] if "shift" in row[0].lower()]
    assert shift_ops and all(ms > 0 and calls > 0 for _, ms, calls in shift_ops), profile["extra"]
    if not on_gpu:  # what the node replaces: vanilla's split, whose backward concatenates
        assert any(name == "aten::cat" and calls < 0 for name, _, calls in profile["extra"])


def _check_device_summary(tmp_path: Path, result: dict) -> None:
    """benchmarks/device/summary.py (the GPU items' table) reads what step.py writes
    and Megatron-LM's log lines (the format of megatron/training/training.py at
    core_v0.16.1)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "step-h2048.json").write_text(json.dumps(result))
    # the paper shape as on the lent card: the plan's memory for it beside the peak
    (out / "step-paper.json").write_text(json.dumps({**result, "device_name": "NVIDIA H200"}))
    slower = json.loads(json.dumps(result))  # the variant (megatron's RoPE) at 4/5 the speed
    for arm in slower["arms"].values():
        arm["tokens_per_s"] *= 0.8
    slower["backend"]["rope"] = "torch (model.rope_kernel: torch)"
    (out / "step-h2048-ropetorch.json").write_text(json.dumps(slower))
    small = json.loads(json.dumps(result))  # as a GPU writes it: the requests' peak too
    small["ratio"].update(peak_memory=1.0081, peak_requested=1.0001)
    for arm, clips in zip(small["arms"].values(), ([False, True], [True, True])):
        arm["clipped"] = clips
    small["ratio"].update(step_time_paired_median_clipped_alike=1.012,
                          forward_backward_median=1.021, update_median=1.004)
    small["sets"] = ["model.rope_kernel=torch"]  # smoke.py turned the Triton RoPE off
    (out / "step-small.json").write_text(json.dumps(small))
    (out / "tests.xml").write_text(  # pytest's JUnit XML, as `pytest --junit-xml` writes it
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="0" '
        'failures="1" skipped="1" tests="4"><testcase classname="tests.a" name="test_x"/>'
        '<testcase classname="tests.a" name="test_y"><failure message="boom"/></testcase>'
        '<testcase classname="tests.b" name="test_z"><skipped/></testcase>'
        '<testcase classname="tests.b" name="test_w"/></testsuite></testsuites>')
    (out / "checks.log").write_text("".join(
        f" [2026-11-26] iteration {5 * i:>8d}/20 | elapsed time per iteration (ms): {ms:.1f} |"
        f" throughput per GPU (TFLOP/s/GPU): 1.0 |\n" for i, ms in enumerate((900, 500, 520, 510))))
    gib = 1 << 30  # benchmarks/cross_entropy.py's JSON (its keys, made-up values)
    (out / "cross-entropy.json").write_text(json.dumps({
        "tokens": 8192, "padded_vocab": 36096, "dtype": "bf16",
        "ms": {"megatron": 6.0, "fused": 1.5}, "time_ratio": 4.0,
        "peak_bytes_above_logits": {"megatron": int(2.2 * gib), "fused": int(0.01 * gib)}}))
    (out / "swiglu.json").write_text(json.dumps({  # benchmarks/swiglu.py's, made up
        "tokens": 8192, "ffn": 5504, "dtype": "bf16", "ms": {"torch": 1.2, "triton": 0.6},
        "time_ratio": 2.0, "triton_gb_per_s": 2400.0}))
    mib = 1 << 20  # benchmarks/peak_memory.py --snapshots' JSON (its keys, made-up values)
    (out / "peak-small.json").write_text(json.dumps({
        "arms": {"vanilla": {"peak_bytes": 215 * mib, "allocator_peak_bytes": 248 * mib},
                 "kv_shift": {"peak_bytes": 215 * mib, "allocator_peak_bytes": 250 * mib}},
        "ratio": 1.0001, "allocator_ratio": 250 / 248,
        "differences": [["gpu", "kvtrain/model/qkv_rope.py:150 backward", "alloc", "bytes",
                         2 * mib, "", "[2097152]"]],
        "requests_apart": [["vanilla only", "gpu", "kvtrain/model/triton_qkv_rope.py:164 "
                            "backward", "alloc", "bytes", 8 * mib, 4]]}))
    done = _summary(out)
    lines = done.stdout.splitlines()
    assert ("small  memory replayed from the trace: blocks 248.0 / 250.0 MiB (1.0081), alive "
            "1.0001; largest difference at the peaks: +2.00 MiB "
            "kvtrain/model/qkv_rope.py:150 backward; requests apart: 1 kinds, the largest "
            "vanilla only 4 x +2048.0 KiB kvtrain/model/triton_qkv_rope.py:164 backward") \
        in lines, lines
    assert lines[0] == "tests  gpu: 2 passed, 1 failed, 1 skipped: tests.a.test_y"
    small_row = next(line for line in lines if line.startswith("small "))
    assert "memory 1.0081 (NOT met <= 1.005) (asked for: 1.0001); " in small_row, small_row
    assert "; NOT the default path: model.rope_kernel=torch; phases" in small_row, small_row
    assert "default path" not in lines[next(i for i, x in enumerate(lines)
                                            if x.startswith("h2048 "))]
    assert small_row.endswith("; phases forward-backward 1.021, the rest 1.004; clipped 1/2 "
                              "of 2 steps (vanilla/KV shift), paired time clipped alike "
                              "1.012"), small_row
    assert "asked for" not in lines[next(i for i, x in enumerate(lines) if x.startswith("h2048 "))]
    ratio = result["ratio"]["step_time_median"]
    h2048 = next(i for i, line in enumerate(lines) if line.startswith("h2048 "))
    assert f"time {ratio:.3f}" in lines[h2048] and "(<= 1.01)" in lines[h2048]
    if "profile" in result:  # the profiled step's line follows
        assert "GPU busy vanilla/KV shift" in lines[h2048 + 1]
        assert "shift" in lines[h2048 + 1].split("the shift changes:")[1].lower()
    rope = result["backend"]["rope"].split(" (")[0]  # what the CPU run recorded: torch
    assert (f"h2048  rope {rope} over torch: tokens/s x 1.250/1.250 (vanilla/KV shift)"
            in lines), lines
    assert ("loss   8192 x 36096 bf16: megatron 6.00 ms / 2.20 GiB, fused 1.50 ms / 0.01 GiB "
            "(time x 4.00)") in lines, lines
    assert ("swiglu 8192 x 2 x 5504 bf16: torch 1.200 ms, triton 0.600 ms (time x 2.00; "
            "2400 GB/s)") in lines, lines
    megatron = 8 * 2048 / 0.510  # the median interval after the first
    vanilla = result["arms"]["vanilla"]["tokens_per_s"]
    assert f"Megatron-LM {megatron:.0f}: {vanilla / megatron:.3f}" in done.stdout
    _check_plan_row(result, lines)
    _check_packed_records(tmp_path, out, done.stdout)


def _check_plan_row(result: dict, lines: list[str]) -> None:
    """The paper shape's row: what kvtrain plan promises for the config, the sets and
    the backend the benchmark ran, on the card it names, beside the measured peak."""
    from kvtrain.config import load_config
    from kvtrain.plan import make_plan

    cfg = load_config(result["config"], [*(result["sets"] or []),
                                         f"model.backend={result['backend']['name']}"])
    memory = make_plan(cfg, nodes=1, gpus_per_node=1, gpu="h200").memory
    planned = memory.total - memory.overhead
    peak = max(a["peak_memory_bytes"] for a in result["arms"].values())
    gib = float(1 << 30)
    assert (f"paper  plan (H200-141G): {planned / gib:.1f} GiB + {memory.overhead / gib:.1f} "
            f"overhead; measured peak {peak / gib:.1f} GiB allocated (the larger arm): "
            f"plan / measured {planned / peak:.3f}") in lines, lines


def _summary(*args) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "summary.py"),
                           *map(str, args)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done


def _check_packed_records(tmp_path: Path, out: Path, table: str) -> None:
    """A call brings back 8 files at most: ``--pack`` (checks.sh's last step) leaves
    the logs and one archive, which gives the same table; two calls' folders, each
    with part of the records and of Megatron-LM's log, give it too."""
    import shutil

    first, second = tmp_path / "call1", tmp_path / "call2"
    shutil.copytree(out, first)
    second.mkdir()
    for name in ("step-paper.json", "tests.xml", "swiglu.json"):  # the second call's parts
        shutil.move(first / name, second / name)
    log = (out / "checks.log").read_text().splitlines(keepends=True)
    (first / "checks.log").write_text("".join(log[:3]))
    (second / "checks.log").write_text("".join(log[3:]))
    assert _summary("--pack", out).stdout == table
    assert sorted(p.name for p in out.iterdir()) == ["checks.log", "results.tgz"]
    assert _summary(out).stdout == table
    for call in (first, second):
        _summary("--pack", call)
    assert _summary(first, second).stdout == table


@pytest.mark.parametrize("key", ["model.attention", "train.max_steps", "train.train_tokens"])
def test_the_keys_the_benchmark_owns_are_refused_in_one_line(key, capsys):
    step = _step_module()
    code = step.main([str(TINY), "--set", f"{key}=vanilla" if key == "model.attention"
                      else f"{key}=5"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and key in err and "Traceback" not in err, err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="te is refused on a CPU")
def test_a_config_refused_at_build_is_one_line_not_a_probe_traceback(tmp_path):
    """The arms' memory probes build the config first; their refusal must not
    turn into a traceback (the benchmark's own build says it in one line)."""
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(TINY), "--steps", "1", "--warmup", "1",
         "--backend", "te", "--json", str(tmp_path / "x.json")],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [lines[-1]] and "model.backend: te" in lines[-1], done.stderr[-3000:]
    assert not (tmp_path / "x.json").exists()


@pytest.mark.gpu
def test_on_a_gpu_memory_mfu_and_bf16_are_measured(tmp_path):
    _, result = _bench(tmp_path, REPO / "configs" / "bench" / "small.yaml")
    assert result["device"] == "cuda" and result["param_dtype"] == "bfloat16"
    assert result["memory_kind"].startswith("cuda_max_memory_allocated")
    for arm in result["arms"].values():
        assert 0 < arm["peak_requested_bytes"] <= arm["peak_memory_bytes"]
        if result["peak_tflops_per_device"]:  # a GPU the trainer knows the peak of
            assert 0 < arm["mfu"] < 1
    assert 0.5 < result["ratio"]["peak_memory"] < 2.0
    assert 0.5 < result["ratio"]["peak_requested"] < 2.0


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a GPU records it")
def test_memory_history_without_a_gpu_is_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(TINY), "--memory-history", str(tmp_path / "m")],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert "--memory-history records CUDA's caching allocator: no GPU here" in last, done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "m").exists()


@pytest.mark.gpu
def test_on_a_gpu_the_allocators_history_is_recorded_and_replayed(tmp_path):
    """``--memory-history``: each probe's snapshot, read by ``peak_memory.py
    --snapshots``; the allocator replayed over the GPU's own requests comes to the
    measured ``max_memory_allocated`` growth within 5 % (what the probe's process had
    cached before its build is not in the trace), and the trace's requests alive at
    their peak lie between the peak of the bytes asked for and the blocks."""
    history = tmp_path / "memory"
    _, result = _bench(tmp_path, REPO / "configs" / "bench" / "host.yaml",
                       "--memory-history", str(history))
    assert sorted(p.name for p in history.iterdir()) == ["kv_shift.pickle", "vanilla.pickle"]
    out_json = tmp_path / "peak.json"
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "peak_memory.py"), "--snapshots",
         str(history / "vanilla.pickle"), str(history / "kv_shift.pickle"),
         "--json", str(out_json)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    peaks = json.loads(out_json.read_text())["arms"]
    for arm, measured in result["arms"].items():
        replayed = peaks[arm]["allocator_peak_bytes"]
        assert abs(replayed - measured["peak_memory_bytes"]) <= 0.05 * replayed, (arm, peaks)
        assert peaks[arm]["peak_bytes"] <= replayed
        # the trace's requests rounded to 512 bytes, alive at their peak: at least the
        # peak of the requests the GPU counted unrounded, at most its blocks
        asked = measured["peak_requested_bytes"]
        assert asked <= peaks[arm]["peak_bytes"] <= measured["peak_memory_bytes"], (
            arm, peaks, measured)


def test_device_checks_without_prepared_wheels_say_so_in_one_line(tmp_path):
    """checks.sh, run where benchmarks/device/prepare.sh's .gpu/ was not carried, or
    where an older prepare.sh left out pydantic (Megatron-LM's pretrain_gpt.py needs it)."""
    (tmp_path / "out").mkdir()

    def checks() -> list[str]:
        done = subprocess.run(["bash", str(REPO / "benchmarks" / "device" / "checks.sh")],
                              cwd=tmp_path, env={**os.environ, "OUT": str(tmp_path / "out")},
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        return done.stdout.strip().splitlines()

    hint = "wheel: run benchmarks/device/prepare.sh here and carry .gpu"
    assert checks() == [f"checks.sh: .gpu/whl has no megatron_core {hint}"]
    (tmp_path / ".gpu" / "whl").mkdir(parents=True)
    (tmp_path / ".gpu" / "whl" / "megatron_core-0.16.1-cp312-cp312-any.whl").touch()
    assert checks() == [f"checks.sh: .gpu/whl has no pydantic {hint}"]


def test_device_smoke_turns_off_a_kernel_that_fails(tmp_path):
    """benchmarks/device/smoke.py (checks.sh's first step on a lent GPU): each Triton
    kernel that cannot run gives the --set that turns it off, and the script itself
    does not fail. Without a GPU both fail here; with one both run."""
    import torch

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "smoke.py")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    if torch.cuda.is_available():
        assert lines[-1] == "smoke-off:", lines
    else:
        assert lines[-1] == ("smoke-off: --set model.kv_shift.kernel=torch "
                             "--set model.rope_kernel=torch "
                             "--set model.cross_entropy_kernel=torch "
                             "--set model.swiglu_kernel=torch"), lines
        assert sum("triton FAILED" in line for line in lines) == 4, lines
    smoke = load_script(REPO / "benchmarks" / "device" / "smoke.py", "kvtrain_smoke")
    assert smoke.verdict(done.stdout) == lines[-1].split()[1:]


def test_device_smoke_passes_in_tritons_interpreter(tmp_path):
    """smoke.py's checks themselves hold: in Triton's interpreter on the CPU every
    kernel agrees with its torch ops, so a kernel turned off on a GPU is that GPU's
    failure. (Its check of the QKV node read the outputs after the backward, which
    writes its gradient over them: on the H200 the Triton RoPE was turned off for
    every timed run of a call.)"""
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "smoke.py"),
                           "--device", "cpu"], cwd=REPO, capture_output=True, text=True,
                          env=script_env(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES=""), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert lines[-1] == "smoke-off:", done.stdout + done.stderr[-2000:]
    assert sum(line.endswith(": triton ok") for line in lines) == 4, lines


def _smoke_verdict(tmp_path: Path, printed: str) -> list[str]:
    (tmp_path / "smoke.txt").write_text(printed)
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device" / "smoke.py"),
                           "--verdict", str(tmp_path / "smoke.txt")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()


def test_device_smoke_that_hung_turns_off_what_it_did_not_see_run(tmp_path):
    """checks.sh stops smoke.py after a while: a kernel that hung (or a crash) leaves
    no last line, and every kernel without its "ok" line is off for the timed runs."""
    verdict = load_script(REPO / "benchmarks" / "device" / "smoke.py", "kvtrain_smoke").verdict
    printed = ("smoke: model.kv_shift.kernel: triton ok\n"
               "smoke: model.rope_kernel: triton FAILED: RuntimeError: boom\n"
               "Traceback (most recent call last):\n")
    assert _smoke_verdict(tmp_path, printed) == [  # as checks.sh asks: the command line
        "--set", "model.rope_kernel=torch", "--set", "model.cross_entropy_kernel=torch",
        "--set", "model.swiglu_kernel=torch"]
    everything_ran = "".join(f"smoke: {k}: triton ok\n" for k in (
        "model.kv_shift.kernel", "model.rope_kernel", "model.cross_entropy_kernel",
        "model.swiglu_kernel"))
    assert verdict(everything_ran) == []
    assert verdict(everything_ran + "smoke-off:\n") == []


def test_gpu_micro_benchmarks_alternate_their_variants():
    """benchmarks/gpu_rounds.alternate (cross_entropy.py's and swiglu.py's rounds): one
    warm-up call each, then rounds whose order flips, medians of the times and the
    largest peak of each variant."""
    from benchmarks.gpu_rounds import alternate

    calls = []

    def one_round(name):
        calls.append(name)
        n = len(calls)
        return (float(n), 10 * n) if name == "a" else (100.0 + n, n)

    ms, peak = alternate(("a", "b"), one_round, rounds=3)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert ms == {"a": 6.0, "b": 105.0} and peak == {"a": 70, "b": 8}  # warm-ups left out


# What the lent GPU machine's image lacks of what make test's venv holds (KINDS.md's
# package list, by module): checks.sh there collects the `gpu` tests and runs the
# benchmarks. (setuptools' own vendored copies, e.g. more_itertools, stay.)
NOT_ON_THE_GPU_MACHINE = (
    "wandb", "zstandard", "lm_eval", "pydantic", "pydantic_core", "annotated_types",
    "typing_inspection", "nltk", "datasets", "evaluate", "dill", "multiprocess", "sqlitedict",
    "sniffio", "distro", "chardet", "defusedxml", "pyflakes", "pytz", "tzdata", "opentelemetry",
    "truststore", "rouge_score", "word2number", "pytablewriter", "pathvalidate")


def test_the_gpu_checks_need_nothing_the_gpu_machine_lacks(tmp_path):
    """Collecting the `gpu` tests and importing every benchmark checks.sh runs work
    without wandb, zstandard, lm-eval, pydantic...: a module-level import of one of
    them would stop the whole `tests` part there at collection, in device time."""
    (tmp_path / "sitecustomize.py").write_text(  # None in sys.modules: "not installed"
        "import sys\n" + "".join(f"sys.modules[{name!r}] = None\n"
                                 for name in NOT_ON_THE_GPU_MACHINE))
    env = {**_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{python_path()}"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests", "--collect-only",
         "-p", "no:cacheprovider", "-p", "no:timeout", "-o", "addopts="],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert re.search(r"^\d+/\d+ tests collected", done.stdout, re.M), done.stdout[-3000:]
    scripts = ["step", "step_profile", "shift_kernel", "cross_entropy", "swiglu", "gpu_rounds",
               "peak_memory"]
    done = subprocess.run(
        [sys.executable, "-c", "".join(f"import benchmarks.{s}\n" for s in scripts)
         + "import benchmarks.device.smoke\nimport kvtrain.cli\nimport kvtrain.train.loop\n"
         + "import benchmarks.device.summary\nimport kvtrain.plan\n"  # summary.plan_row
         + "try:\n    import wandb\nexcept ImportError as e:\n    print(e)"],  # the stand-in
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "import of wandb halted" in done.stdout


def test_the_shifts_own_kernels_lead_what_it_changes():
    """An entry only one arm has (the shift's own kernel, or one it replaces) leads
    ``extra`` whatever its time: the summary's line shows the first few, and a busy
    op both arms call (a noisy CPU ``aten::mm``) must not push the shift out."""
    from benchmarks.step_profile import added_by_the_shift

    vanilla = {"entries": {"aten::mm": (10.0, 8), "aten::mul": (1.0, 4), "aten::cat": (0.2, 2)}}
    shifted = {"entries": {"aten::mm": (10.9, 8), "aten::mul": (1.5, 8),
                           "kvtrain::kv_shift": (0.05, 4)}}
    extra = added_by_the_shift(vanilla, shifted)
    assert [row[0] for row in extra] == ["kvtrain::kv_shift", "aten::cat", "aten::mm", "aten::mul"]
    assert extra[1] == ["aten::cat", -0.2, -2]


def test_the_benchmarks_subprocesses_keep_the_callers_python_path(monkeypatch):
    """On the lent GPU machine megatron-core is installed on PYTHONPATH: a benchmark
    run with the repository alone there failed with "No module named 'megatron'"."""
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    assert _env()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/opt/site"]


def test_a_profiles_kernel_names_keep_what_tells_them_apart():
    """The H200's profile named every multi-tensor kernel "void at::native::(anonymous
    namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace):" (cut at
    100 characters), so which optimizer op the shift made launch 11 more was lost."""
    from benchmarks.step_profile import short_name

    key = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::"
           "(anonymous namespace)::FusedOptimizerTensorListMetadata<4>, at::native::"
           "(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, "
           "false>, float*, double, double, double, double, double, double, bool>(...)")
    assert "FusedAdamMathFunctor" in short_name(key)
    assert short_name("aten::mm") == "aten::mm"
