"""The GPU items of issue 12 from what benchmarks/device/checks.sh wrote: one table.

    python benchmarks/device/summary.py DIR [DIR ...]   (each: a call's $OUT, as it came back)
    python benchmarks/device/summary.py --pack DIR      (checks.sh, last: the table, then
                                                         the records into DIR/results.tgz)

A call brings back at most 8 files from $OUT, and checks.sh writes more, so ``--pack``
moves its JSON and XML records into one archive, ``results.tgz``, and leaves the
logs beside it. The table reads a DIR's archive as if unpacked; with several DIRs
(the calls of one lease, in order) a later call's record of a run wins and their
checks.log are read one after the other.

Reads DIR/step-*.json (benchmarks/step.py, with its ``--profile`` record),
DIR/peak-*.json (benchmarks/peak_memory.py over step.py's ``--memory-history``),
DIR/cross-entropy.json (benchmarks/cross_entropy.py), DIR/swiglu.json
(benchmarks/swiglu.py) and Megatron-LM's iteration times from
DIR/checks.log ("elapsed time per iteration (ms)", the first logged interval - warm-up
- left out) and prints each target against its goal.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
import sys
import tarfile
import tempfile
from pathlib import Path

ARCHIVE = "results.tgz"
RECORDS = ("*.json", "*.xml")  # what --pack moves into the archive
GOALS = {"small": ("time", 1.03), "small-torchops": ("time", 1.03), "h2048": ("time", 1.01)}
# the kernel a variant run turns off by design (checks.sh's kernels part)
VARIANT_OFF = {"small-torchops": "model.kv_shift.kernel=torch",
               "host-torchops": "model.kv_shift.kernel=torch",
               "h2048-ropetorch": "model.rope_kernel=torch"}


def kernels_off(name: str, d: dict) -> str:
    """'; NOT the default path: ...' where a run took a kernel's torch ops that its
    part does not ask for (smoke.py turned the kernel off): its figures are not the
    target's (session 44: the Triton RoPE off for every timed run of a lease)."""
    off = [s for s in d.get("sets") or [] if s.split("=", 1)[0].endswith("kernel")
           and s.endswith("=torch") and s != VARIANT_OFF.get(name)]
    return f"; NOT the default path: {' '.join(off)}" if off else ""


def step_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("step-*.json")):
        d = json.loads(path.read_text())
        name = path.stem.removeprefix("step-")
        r, arms = d["ratio"], d["arms"]
        mfu = arms["vanilla"].get("mfu"), arms["kv_shift"].get("mfu")
        goal = GOALS.get(name)
        verdict = ""
        if goal is not None:
            verdict = "met" if r["step_time_median"] <= goal[1] else "NOT met"
            verdict = f"time {verdict} (<= {goal[1]})"
        memory, asked = r.get("peak_memory"), r.get("peak_requested")
        rows.append(
            f"{name:6s} {d['device_name']}: time {r['step_time_median']:.3f} "
            f"(paired {r['step_time_paired_median']:.3f}), memory "
            f"{memory if memory is None else f'{memory:.4f}'}"
            f"{' ' + memory_verdict(memory) if goal else ''}"
            f"{'' if asked is None else f' (asked for: {asked:.4f})'}; "
            f"tokens/s {arms['vanilla']['tokens_per_s']:.0f} / "
            f"{arms['kv_shift']['tokens_per_s']:.0f}; "
            f"MFU {'/'.join('-' if m is None else f'{100 * m:.1f}%' for m in mfu)}; "
            f"backend {d['backend']['name']}, shift {d['backend'].get('shift_kernel')} {verdict}"
            f"{kernels_off(name, d)}{phases(r)}{clipping(d)}")
        if d.get("profile"):
            rows.append(f"{'':6s} {profile_row(d['profile'])}")
    return rows


def phases(ratio: dict) -> str:
    """KV shift / vanilla of each phase's median (step.py's PhaseClock; older JSONs: none)."""
    if ratio.get("forward_backward_median") is None:
        return ""
    return (f"; phases forward-backward {ratio['forward_backward_median']:.3f}, "
            f"the rest {ratio['update_median']:.3f}")


def clipping(d: dict) -> str:
    """The timed steps that clipped, per arm, and the time ratio over the rounds whose
    two steps clipped alike (older JSONs: nothing)."""
    arms = d["arms"]
    if "clipped" not in arms["vanilla"] or not any(any(a["clipped"]) for a in arms.values()):
        return ""
    alike = d["ratio"].get("step_time_paired_median_clipped_alike")
    counts = "/".join(f"{sum(a['clipped'])}" for a in arms.values())
    return (f"; clipped {counts} of {len(arms['vanilla']['clipped'])} steps "
            f"(vanilla/KV shift), paired time clipped alike "
            f"{'-' if alike is None else f'{alike:.3f}'}")


def memory_verdict(memory: float | None) -> str:
    """The peak-memory target (every shape with a time goal): KV shift <= 1.005 x."""
    return f"({'met' if memory is not None and memory <= 1.005 else 'NOT met'} <= 1.005)"


def profile_row(profile: dict) -> str:
    """``step.py --profile`` in one line: how busy the GPU was (a launch-bound step
    is well below 100%), the kernels the shift adds or removes (their calls change)
    and the kernel whose time grew most besides."""
    busy = "/".join("-" if a["busy"] is None else f"{a['busy']:.0%}"
                    for a in profile["arms"].values())
    called = [row for row in profile["extra"] if row[2] != 0][:3]
    grown = [row for row in profile["extra"] if row[2] == 0][:1]
    return (f"GPU busy vanilla/KV shift {busy}; the shift changes: " + "; ".join(
        f"{name[:48]} {ms:+.3f} ms ({calls:+d})" for name, ms, calls in called + grown))


# (run, its variant, the backend field they differ in): checks.sh's kernels part
VARIANTS = (("h2048", "h2048-ropetorch", "rope"),
            ("small", "small-torchops", "shift_kernel"),
            ("host-triton", "host-torchops", "shift_kernel"))


def variant_rows(out: Path) -> list[str]:
    """Tokens/s of a run over its variant's, per arm (``> 1``: the run's kernel is
    faster), with the kernels each ran as their JSON records them (the smoke step
    may have turned a Triton kernel off)."""
    rows = []
    for run, other, field in VARIANTS:
        a, b = out / f"step-{run}.json", out / f"step-{other}.json"
        if not (a.exists() and b.exists()):
            continue
        ours, theirs = (json.loads(p.read_text()) for p in (a, b))
        gain = "/".join(f"{ours['arms'][arm]['tokens_per_s'] / theirs['arms'][arm]['tokens_per_s']:.3f}"
                        for arm in ("vanilla", "kv_shift"))
        kernels = [str(d["backend"].get(field)).split(" (")[0] for d in (ours, theirs)]
        rows.append(f"{run:6s} {field} {kernels[0]} over {kernels[1]}: tokens/s x {gain} "
                    f"(vanilla/KV shift)")
    return rows


def cross_entropy_row(path: Path) -> str | None:
    """benchmarks/cross_entropy.py's medians: megatron's loss over the fused one."""
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    gib = 1 << 30
    peak = d["peak_bytes_above_logits"]
    return (f"loss   {d['tokens']} x {d['padded_vocab']} {d['dtype']}: megatron "
            f"{d['ms']['megatron']:.2f} ms / {peak['megatron'] / gib:.2f} GiB, fused "
            f"{d['ms']['fused']:.2f} ms / {peak['fused'] / gib:.2f} GiB "
            f"(time x {d['time_ratio']:.2f})")


def swiglu_row(path: Path) -> str | None:
    """benchmarks/swiglu.py's medians: torch's ops over the Triton kernels."""
    if not path.exists():
        return None
    d = json.loads(path.read_text())
    return (f"swiglu {d['tokens']} x 2 x {d['ffn']} {d['dtype']}: torch {d['ms']['torch']:.3f} "
            f"ms, triton {d['ms']['triton']:.3f} ms (time x {d['time_ratio']:.2f}; "
            f"{d['triton_gb_per_s']:.0f} GB/s)")


def megatron_tokens_per_s(log: Path, tokens_per_iteration: int) -> float | None:
    """Megatron-LM's steady tokens/s: the median of its logged intervals but the first."""
    if not log.exists():
        return None
    times = [float(m) for m in re.findall(r"elapsed time per iteration \(ms\): ([0-9.]+)",
                                          log.read_text(errors="replace"))]
    if len(times) < 2:
        return None
    return tokens_per_iteration / (statistics.median(times[1:]) / 1000)


def tests_row(xml: Path) -> str | None:
    """The `gpu` tests' counts from pytest's JUnit XML, and the failed ones by name."""
    if not xml.exists():
        return None
    import xml.etree.ElementTree as ET

    try:
        root = ET.parse(xml).getroot()
    except ET.ParseError as e:
        return f"tests  {xml.name} unreadable: {e}"
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    count = {k: sum(int(s.get(k, 0)) for s in suites)
             for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname', '')}.{case.get('name', '')}"
              for case in root.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    row = (f"tests  gpu: {passed} passed, {count['failures'] + count['errors']} failed, "
           f"{count['skipped']} skipped")
    return row + (f": {', '.join(failed)}" if failed else "")


def gather(dirs: list[Path], into: Path) -> None:
    """The calls' records in one folder: each DIR's files and its archive's
    members, a later DIR's winning; their checks.log one after the other."""
    logs = []
    for d in dirs:
        if (d / ARCHIVE).exists():
            with tarfile.open(d / ARCHIVE) as tar:
                tar.extractall(into, filter="data")
        for path in d.iterdir():
            if path.name == "checks.log":
                logs.append(path.read_text(errors="replace"))
            elif path.is_file() and path.name != ARCHIVE:
                shutil.copyfile(path, into / path.name)
    if logs:
        (into / "checks.log").write_text("".join(logs))


def pack(out: Path) -> list[str]:
    """Move ``out``'s records into ``out/results.tgz`` (the names moved)."""
    records = sorted({p for pattern in RECORDS for p in out.glob(pattern)})
    if records:
        with tarfile.open(out / ARCHIVE, "w:gz") as tar:
            for path in records:
                tar.add(path, arcname=path.name)
        for path in records:
            path.unlink()
    return [p.name for p in records]


def plan_row(d: dict) -> str:
    """The paper shape's peak memory against what ``kvtrain plan`` promises for it on
    this card: the plan's states and activations (its overhead, the CUDA context, NCCL
    and fragmentation, is not in ``max_memory_allocated``) over the larger arm's peak."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # kvtrain of this checkout
    from kvtrain.config import ConfigError, load_config
    from kvtrain.plan import GPUS, PlanError, make_plan
    from kvtrain.plan.memory import GiB

    gpu = next((k for k in sorted(GPUS) if k.upper() in d["device_name"].upper()), None)
    peak = max((a.get("peak_memory_bytes") or 0) for a in d["arms"].values())
    if gpu is None or not peak:
        return f"paper  plan: no GPU kvtrain plan knows, or no peak ({d['device_name']})"
    try:
        cfg = load_config(d["config"], [*(d.get("sets") or []),
                                        f"model.backend={d['backend']['name']}"])
        memory = make_plan(cfg, nodes=1, gpus_per_node=d["world_size"], gpu=gpu).memory
    except (ConfigError, PlanError, OSError) as e:
        return f"paper  plan: {e}"
    planned = memory.total - memory.overhead
    return (f"paper  plan ({GPUS[gpu].name}): {planned / GiB:.1f} GiB + "
            f"{memory.overhead / GiB:.1f} overhead; measured peak {peak / GiB:.1f} GiB "
            f"allocated (the larger arm): plan / measured {planned / peak:.3f}")


def requests_apart(rows: list | None) -> str:
    """The largest request one arm makes alone, or at another size (older JSONs: none)."""
    if rows is None:
        return ""
    if not rows:
        return "; the arms' requests part nowhere"
    side, _, site, _, _, size, n = rows[0]
    return (f"; requests apart: {len(rows)} kinds, the largest {side} {n} x "
            f"{size / n / 2**10:+.1f} KiB {site}")


def peak_rows(out: Path) -> list[str]:
    """What is alive at each arm's peak, from the GPU's own allocator trace."""
    rows = []
    for path in sorted(out.glob("peak-*.json")):
        d = json.loads(path.read_text())
        name, arms, mib = path.stem.removeprefix("peak-"), d["arms"], 2 ** 20
        top = d["differences"][0] if d["differences"] else None
        rows.append(
            f"{name:6s} memory replayed from the trace: blocks {arms['vanilla']['allocator_peak_bytes'] / mib:.1f}"
            f" / {arms['kv_shift']['allocator_peak_bytes'] / mib:.1f} MiB "
            f"({d['allocator_ratio']:.4f}), alive {d['ratio']:.4f}; largest difference at the "
            f"peaks: {'none' if top is None else f'{top[4] / mib:+.2f} MiB {top[1]}'}"
            f"{requests_apart(d.get('requests_apart'))}")
    return rows


def table(out: Path) -> None:
    tests = tests_row(out / "tests.xml")
    if tests:
        print(tests)
    for row in step_rows(out) + variant_rows(out) + peak_rows(out):
        print(row)
    for row in (cross_entropy_row(out / "cross-entropy.json"), swiglu_row(out / "swiglu.json")):
        if row:
            print(row)
    paper = out / "step-paper.json"
    mlm = megatron_tokens_per_s(out / "checks.log", 8 * 2048)
    if paper.exists():
        d = json.loads(paper.read_text())
        ours = d["arms"]["vanilla"]["tokens_per_s"], d["arms"]["kv_shift"]["tokens_per_s"]
        mfu = d["arms"]["kv_shift"].get("mfu")
        print(f"paper  MFU (KV shift) {'-' if mfu is None else f'{100 * mfu:.1f}%'} "
              f"({'met' if mfu is not None and mfu >= 0.45 else 'NOT met'} >= 45%)")
        print(plan_row(d))
        if mlm is None:
            print("paper  Megatron-LM: no iteration times in checks.log")
        else:
            print(f"paper  tokens/s vanilla {ours[0]:.0f}, KV shift {ours[1]:.0f}, "
                  f"Megatron-LM {mlm:.0f}: {ours[0] / mlm:.3f} / {ours[1] / mlm:.3f} x "
                  f"({'met' if min(ours) >= mlm else 'NOT met'} >= 1.0)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("dirs", nargs="*", type=Path, default=[Path(".")])
    parser.add_argument("--pack", action="store_true",
                        help=f"then move DIR's records into DIR/{ARCHIVE} (one DIR)")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.dirs if not d.is_dir()]
    if missing or (args.pack and len(args.dirs) != 1):
        parser.error(f"not a folder: {', '.join(missing)}" if missing
                     else "--pack takes one DIR")
    with tempfile.TemporaryDirectory() as tmp:
        gather(args.dirs, Path(tmp))
        table(Path(tmp))
    if args.pack:
        moved = pack(args.dirs[0])
        print(f"packed into {ARCHIVE}: {' '.join(moved) or 'nothing'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
