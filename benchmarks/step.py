"""Cost of KV shifting attention in the trainer's own step: KV shift against
vanilla attention on the same config.

    python benchmarks/step.py CONFIG [--backend B] [--set KEY=VALUE ...]
                              [--steps 20] [--warmup 3] [--json OUT]

The config is built twice in this process with the trainer's setup
(``kvtrain.train.setup.build_run``): once with ``model.attention: vanilla`` and
once with ``kv_shift``, nothing else different (the benchmark owns that key and
the step count). Each arm runs ``--warmup`` steps, then the two alternate for
``--steps`` timed steps each (vanilla-kv_shift, kv_shift-vanilla, ...), so that
drifts of the machine hit both. A step is ``kvtrain.train.step.train_step``:
forward and backward over every micro batch of a global batch (the data
loading included) and the optimizer update.

Printed and written to the JSON (``--json``, default
``runs/bench/step-<name>-<backend>.json``): the step time of each arm (median
and mean over the timed steps) and the ratios kv_shift / vanilla of both and
the median of the per-round ratios (a round's two steps are adjacent in time;
also over the rounds whose two steps clipped their gradients alike: clipping by
``optimizer.clip_grad`` is a pass over every gradient that each step's norm decides,
so with norms near the bound one arm may pay it where the other does not; each
step's norm and whether it clipped are in the JSON), each step split into its
forward-backward and the rest (the loss's reduction, the gradient norm, clipping,
the update; ``PhaseClock`` in ``step_arms.py``: CUDA events on a GPU, no
synchronization added),
tokens/s, TFLOP/s per device and MFU (the trainer's model-FLOP count,
``kvtrain/train/flops.py``; the peak from ``train.peak_tflops_per_device`` or
the device name, none on a CPU unless given), and each arm's peak memory and
their ratio.

Peak memory is what one arm adds to a process, from before its build to the
end of its warm-up (weights, gradients, optimizer state and the steps'
activations). Each arm is measured in a process of its own, started before
this one builds anything (on the CPU forked, both at once; on a GPU spawned, one
after the other), so that both
pay the same one-off costs - lazy imports, cuBLAS workspaces, megatron's
global buffer of the local spec's attention scores - whichever is built first:

* GPU: the growth of ``torch.cuda.max_memory_allocated`` over the arm (the
  caching allocator's blocks: a cached block handed out whole counts whole), and
  beside it the peak of the bytes asked for (``requested_bytes.all.peak``, the
  requests unrounded): where the two ratios part, the allocator's packing of the
  two arms' requests differs, not what they keep (``benchmarks/peak_memory.py``);
* CPU: torch keeps no allocator statistics there, so the growth of the
  process's resident-set high-water mark (Linux VmHWM, reset through
  ``/proc/self/clear_refs`` after freed heap is returned to the system).

Under ``torchrun`` (several ranks) memory is not measured.

``--memory-history DIR`` (a GPU, one process) has each memory probe record the caching
allocator's history from before its build and dump it to ``DIR/<arm>.pickle``
(``torch.cuda.memory._dump_snapshot``): ``benchmarks/peak_memory.py --snapshots``
says what is alive at each arm's peak and what differs. It slows the probes only.

``--profile`` runs one more step of each arm under ``torch.profiler`` and adds
where the time goes (kernels, host operators, what the shift adds) to the
output and the JSON (``benchmarks/step_profile.py``).

``--backend B`` is ``--set model.backend=B``; data is mock (``data.type: mock``)
unless ``--set data.type=...`` says otherwise. Under ``torchrun`` every rank runs
both arms in lockstep; a step's time is the maximum over ranks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from kvtrain.config import ConfigError, RunConfig, load_config  # noqa: E402
from kvtrain.config.backend import BackendChoice  # noqa: E402

from benchmarks.step_arms import Arm, build_arm, init_env, time_arms  # noqa: E402

ARMS = ("vanilla", "kv_shift")
OWNED = {  # keys the benchmark sets itself, and what to use instead
    "model.attention": "the benchmark runs both vanilla and kv_shift",
    "train.max_steps": "use --steps and --warmup",
    "train.train_tokens": "use --steps and --warmup",
}


# ----------------------------------------------------------------------------- configs
def arm_configs(config: str, backend: Optional[str], sets: list[str],
                steps: int) -> dict[str, RunConfig]:
    """The two configs: the file with ``sets`` applied, differing in ``model.attention``."""
    for assignment in sets:
        key = assignment.split("=", 1)[0].strip()
        if key in OWNED:
            raise ConfigError(f"--set {key}: the benchmark sets it ({OWNED[key]})")
    overrides = ["data.type=mock", *([f"model.backend={backend}"] if backend else []), *sets,
                 f"train.max_steps={steps}", "train.train_tokens=null",
                 "train.eval_interval=null"]  # no validation data: nothing is evaluated
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return {arm: load_config(config, [*overrides, f"model.attention={arm}"], world_size=world)
            for arm in ARMS}


# ----------------------------------------------------------------------------- memory
def memory_kind(world_size: int) -> str:
    if world_size > 1:
        return "not measured (under torchrun)"
    if torch.cuda.is_available():
        return "cuda_max_memory_allocated (one spawned process per arm)"
    return "cpu_rss_high_water_mark (one forked process per arm)"


HISTORY_ENTRIES = 2_000_000  # the allocator's trace is a ring: the build's must stay in it


def _probe_child(cfg: RunConfig, warmup: int, pipe, history: Optional[str] = None) -> None:
    """A probe process: builds and warms up ``cfg`` alone, sends its peak memory
    (``history``: the allocator's history dumped into that folder, module docstring)."""
    try:
        from kvtrain.commands.train import quiet_imports

        quiet_imports()
        if history:
            torch.cuda.init()  # the allocator whose history is recorded
            # every action traced, Python stacks for allocations only (a free's adds
            # nothing the reader uses, and would double the dump)
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc",
                                                     stacks="python",
                                                     max_entries=HISTORY_ENTRIES)
        with tempfile.TemporaryDirectory(prefix="kvtrain-step-probe-") as scratch:
            arm = build_arm(cfg.model.attention, cfg, Path(scratch), init_env(cfg), warmup,
                            measure=True)
        if history:
            torch.cuda.memory._dump_snapshot(str(Path(history) / f"{arm.name}.pickle"))
        pipe.send(("ok", (arm.peak_bytes, arm.requested_bytes)))
    except ConfigError:
        pipe.send(("refused", None))  # the parent's own build says it, in one line
    except BaseException:
        pipe.send(("failed", traceback.format_exc()))


def probe_memory(cfgs: dict[str, RunConfig], warmup: int,
                 history: Optional[str] = None) -> dict[str, tuple]:
    """Each arm's peak memory and peak of the bytes asked for (None where not counted),
    measured in a process of its own (module docstring),
    before this process builds or times anything. On the CPU both at once, forked
    (the children inherit the imports); on a GPU one after the other, spawned (CUDA
    does not survive a fork, and two arms of a model sized to fill the card would
    not fit on it together)."""
    gpu = torch.cuda.is_available()
    ctx = multiprocessing.get_context("spawn" if gpu else "fork")
    sys.stdout.flush()
    sys.stderr.flush()
    children: dict = {}
    peaks = {}

    def start(arm: str) -> None:
        receive, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_probe_child, args=(cfgs[arm], warmup, send, history))
        proc.start()
        send.close()  # the child's end: recv() sees EOF if the child dies
        children[arm] = (proc, receive)

    def collect(arm: str) -> None:
        proc, receive = children.pop(arm)
        try:
            status, value = receive.recv()
        except EOFError:
            status, value = "failed", "it died without an answer"
        proc.join()
        if status == "failed":
            raise RuntimeError(f"the memory probe of {arm} failed:\n{value}")
        peaks[arm] = value if status == "ok" else (None, None)

    for arm in ARMS:
        start(arm)
        if gpu:
            collect(arm)
    for arm in list(children):
        collect(arm)
    return peaks


# ----------------------------------------------------------------------------- report
def _max_over_ranks(values: list[float]) -> list[float]:
    """Elementwise max over ranks (a step takes as long as its slowest rank)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if torch.cuda.is_available():
        tensor = tensor.cuda()
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.cpu().tolist()


# ----------------------------------------------------------------------------- report
def arm_record(arm: Arm) -> dict:
    run, t = arm.run, arm.run.cfg.train
    times = _max_over_ranks(arm.times)
    median = statistics.median(times)
    fb, rest = (_max_over_ranks([p[i] for p in arm.phases]) for i in (0, 1))
    tflops = run.flops_per_step / median / run.world_size / 1e12
    return {
        "step_time_median_s": median,
        "step_time_mean_s": statistics.fmean(times),
        "step_times_s": times,
        "tokens_per_s": t.global_batch_size * t.seq_length / median,
        "flops_per_step": run.flops_per_step,
        "tflops_per_device": tflops,
        "mfu": tflops / run.peak_tflops if run.peak_tflops else None,
        "peak_memory_bytes": arm.peak_bytes,  # measured with one rank only
        "peak_requested_bytes": arm.requested_bytes,  # a GPU only
        # each timed step's forward-backward and the rest (PhaseClock: a GPU's own time)
        "forward_backward_s": fb, "forward_backward_median_s": statistics.median(fb),
        "update_s": rest, "update_median_s": statistics.median(rest),
        "grad_norms": arm.grad_norms,  # of the timed steps (None: a step skipped)
        "clipped": clipped(arm),
    }


def clipped(arm: Arm) -> list[bool]:
    """Which timed steps scaled their gradients (``optimizer.clip_grad``): a pass over
    every gradient that the step's norm decides, so one arm may pay it where the other
    does not (mock data's norms near the bound)."""
    from kvtrain.train.main_grads import clips

    bound = arm.run.cfg.optimizer.clip_grad
    return [norm is not None and clips(bound, norm) for norm in arm.grad_norms]


def shifted_arm(arms: list[Arm]) -> Arm:
    return next(arm for arm in arms if arm.name == "kv_shift")


def _median_or_none(values: list[float]) -> Optional[float]:
    return statistics.median(values) if values else None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def report(args: argparse.Namespace, arms: list[Arm], load_before: tuple) -> dict:
    """The result (collective: reduces over ranks)."""
    records = {arm.name: arm_record(arm) for arm in arms}
    v, k = records["vanilla"], records["kv_shift"]
    run = shifted_arm(arms).run  # its backend names the shift's kernel too
    cfg, p = run.cfg, run.cfg.parallel
    param = next(run.model[0].parameters())
    return {
        "config": args.config, "sets": args.set, "backend": run.backend.as_dict(),
        "device": run.device,
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "load_average": {"before": load_before, "after": os.getloadavg()},
        "world_size": run.world_size,
        "layout": {"tensor": p.tensor, "pipeline": p.pipeline, "data": run.dp_size,
                   "micro_batches": run.num_microbatches},
        "precision": cfg.train.precision, "param_dtype": str(param.dtype).removeprefix("torch."),
        "tokens_per_step": cfg.train.global_batch_size * cfg.train.seq_length,
        "steps": args.steps, "warmup": args.warmup,
        "peak_tflops_per_device": run.peak_tflops,
        "clip_grad": cfg.optimizer.clip_grad,
        "memory_kind": memory_kind(run.world_size),
        "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                  "heads": cfg.model.num_attention_heads, "kv_heads": cfg.model.kv_heads,
                  "ffn": cfg.model.ffn_size, "seq": cfg.train.seq_length,
                  "micro_batch": cfg.train.micro_batch_size,
                  "global_batch": cfg.train.global_batch_size},
        "arms": records,
        "ratio": {  # kv_shift / vanilla
            "step_time_median": k["step_time_median_s"] / v["step_time_median_s"],
            "step_time_mean": k["step_time_mean_s"] / v["step_time_mean_s"],
            # the median over rounds of the ratio of each round's two adjacent
            # steps: what machine drift (other users' load) disturbs least
            "step_time_paired_median": statistics.median(
                a / b for a, b in zip(k["step_times_s"], v["step_times_s"])),
            # the same over the rounds whose two steps clipped alike (None: no round did)
            "step_time_paired_median_clipped_alike": _median_or_none([
                a / b for a, b, ca, cb in zip(k["step_times_s"], v["step_times_s"],
                                              k["clipped"], v["clipped"]) if ca == cb]),
            "forward_backward_median": _ratio(k["forward_backward_median_s"],
                                              v["forward_backward_median_s"]),
            "update_median": _ratio(k["update_median_s"], v["update_median_s"]),
            "peak_memory": _ratio(k["peak_memory_bytes"], v["peak_memory_bytes"]),
            "peak_requested": _ratio(k["peak_requested_bytes"], v["peak_requested_bytes"]),
        },
    }


def table(result: dict) -> str:
    def num(x: Optional[float], fmt: str) -> str:
        return format(x, fmt) if x is not None else "n/a"

    m, backend = result["model"], BackendChoice(**result["backend"])
    lines = [
        f"{result['config']}: {backend.name} backend ({backend.details()}), "
        f"{result['device_name']}, {result['param_dtype']}, world {result['world_size']}; "
        f"{m['layers']} layers, hidden {m['hidden']}, seq {m['seq']}, "
        f"{result['tokens_per_step']} tokens/step; {result['steps']} timed steps per arm "
        f"after {result['warmup']}",
        f"{'arm':9s} {'median ms':>10s} {'mean ms':>10s} {'tokens/s':>10s} "
        f"{'TFLOP/s/dev':>11s} {'MFU':>6s} {'peak MiB':>9s}",
    ]
    for name, r in result["arms"].items():
        peak = r["peak_memory_bytes"] / 2**20 if r["peak_memory_bytes"] is not None else None
        lines.append(f"{name:9s} {r['step_time_median_s'] * 1e3:10.1f} "
                     f"{r['step_time_mean_s'] * 1e3:10.1f} {r['tokens_per_s']:10.0f} "
                     f"{r['tflops_per_device']:11.4f} {num(r['mfu'], '6.1%'):>6s} "
                     f"{num(peak, '9.1f'):>9s}")
    q = result["ratio"]
    lines.append(f"kv_shift / vanilla: step time {q['step_time_median']:.3f} (median), "
                 f"{q['step_time_mean']:.3f} (mean), {q['step_time_paired_median']:.3f} "
                 f"(median of paired steps); peak memory "
                 f"{num(q['peak_memory'], '.4f')} ({result['memory_kind']})")
    v, k = result["arms"]["vanilla"], result["arms"]["kv_shift"]
    clock = "the GPU" if "cuda" in str(result["device"]) else "the host"
    lines.append(
        f"phases (median ms, vanilla / kv_shift; {clock}'s time): forward-backward {v['forward_backward_median_s'] * 1e3:.2f} / "
        f"{k['forward_backward_median_s'] * 1e3:.2f} ({q['forward_backward_median']:.3f}), "
        f"the rest (loss, norm, clipping, update) {v['update_median_s'] * 1e3:.2f} / "
        f"{k['update_median_s'] * 1e3:.2f} ({q['update_median']:.3f})")
    clip = {name: r["clipped"] for name, r in result["arms"].items()}
    if any(any(c) for c in clip.values()):
        alike = q["step_time_paired_median_clipped_alike"]
        lines.append(
            f"gradients clipped (optimizer.clip_grad {result['clip_grad']}) in "
            + ", ".join(f"{name} {sum(c)}/{len(c)}" for name, c in clip.items())
            + " timed steps (each a pass over every gradient); step time "
            f"{num(alike, '.3f')} (median of the paired steps clipped alike)")
    if q.get("peak_requested") is not None:  # a GPU: the requests beside the blocks
        asked = "/".join(f"{r['peak_requested_bytes'] / 2**20:.1f}"
                         for r in result["arms"].values())
        lines.append(f"peak of the bytes asked for: {asked} MiB, kv_shift / vanilla "
                     f"{q['peak_requested']:.4f} (the blocks above round and pack them)")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- main
def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a run config (YAML)")
    parser.add_argument("--backend", help="model.backend (e.g. auto, te, local)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override, as for `kvtrain train` (repeatable)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per arm")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per arm (>= 1)")
    parser.add_argument("--json", help="where the result goes")
    parser.add_argument("--profile", action="store_true",
                        help="one more step per arm under torch.profiler (step_profile.py)")
    parser.add_argument("--memory-history", metavar="DIR",
                        help="a GPU: each arm's allocator history into DIR/<arm>.pickle "
                             "(for benchmarks/peak_memory.py --snapshots)")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 1:
        parser.error("--steps and --warmup must be >= 1")
    if args.memory_history:
        if not torch.cuda.is_available():
            parser.error("--memory-history records CUDA's caching allocator: no GPU here "
                         "(benchmarks/peak_memory.py replays it on the CPU)")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            parser.error("--memory-history: memory is measured with one process only")
        Path(args.memory_history).mkdir(parents=True, exist_ok=True)
    return args


def _shared_tempdir() -> Path:
    """One scratch folder for every rank (the data's index caches)."""
    name = [tempfile.mkdtemp(prefix="kvtrain-step-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(name[0])


def _import_builders() -> None:
    """What building a run imports lazily, imported once before the probes fork
    (the children inherit it instead of each importing megatron again)."""
    for module in ("megatron.core.distributed", "megatron.core.models.gpt",
                   "megatron.core.optimizer", "megatron.core.pipeline_parallel",
                   "kvtrain.data", "kvtrain.model.builder", "kvtrain.train.setup",
                   "kvtrain.train.step"):
        importlib.import_module(module)


def benchmark(args: argparse.Namespace, cfgs: dict[str, RunConfig]) -> dict:
    """Both arms: memory, warm-up, the timed steps; the result (on every rank)."""
    _import_builders()
    load_before = os.getloadavg()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    # both probes at once (each measures its own process), done before anything is timed
    probed = probe_memory(cfgs, args.warmup, args.memory_history) if world == 1 else {}
    env = init_env(cfgs["vanilla"])
    scratch = _shared_tempdir()
    try:
        arms = [build_arm(name, cfgs[name], scratch / name, env, args.warmup, measure=False)
                for name in ARMS]
        for arm in arms:
            arm.peak_bytes, arm.requested_bytes = probed.get(arm.name, (None, None))
        if env.rank == 0:  # the KV-shift arm's line: the backend, and the shift's kernel
            run = shifted_arm(arms).run
            print(f"step.py: {run.backend.describe()}, device {run.device}", flush=True)
        time_arms(arms, args.steps)
        result = report(args, arms, load_before)
        if args.profile:
            from benchmarks.step_profile import profiles

            result["profile"] = profiles({arm.name: arm.step for arm in arms})
        return result
    finally:
        dist.barrier()
        if env.rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)


def write_result(args: argparse.Namespace, cfg: RunConfig, result: dict) -> None:
    from benchmarks.step_profile import profile_table

    print("\n".join(filter(None, [table(result), profile_table(result.get("profile"))])))
    name = f"step-{cfg.name}-{result['backend']['name']}.json"
    out = Path(args.json or Path("runs") / "bench" / name)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"step.py: wrote {out}")


def main(argv: Optional[list[str]] = None) -> int:
    from kvtrain.commands.train import quiet_imports

    args = parse_args(argv)
    try:
        cfgs = arm_configs(args.config, args.backend, args.set, args.warmup + args.steps)
        quiet_imports()  # megatron's warnings about missing GPU libraries
        result = benchmark(args, cfgs)
        if dist.get_rank() == 0:
            write_result(args, cfgs["vanilla"], result)
    except ConfigError as e:
        print(f"step.py: config error: {e}", file=sys.stderr)
        return 2
    from kvtrain.backend import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
