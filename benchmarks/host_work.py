"""What the KV shift adds to the host's work in one trainer step, on the GPU's
kernels, counted on the CPU.

    python benchmarks/host_work.py [CONFIG] [--set KEY=VALUE ...] [--steps 1]
                                   [--top 25] [--json OUT]

At the small shape (``configs/bench/small.yaml``) an H200 is busy 3 % of the step:
the step is the host's, and its time follows the host's work, operators
dispatched, Python called, kernels launched. That work does not need the GPU to be
counted, nor the GPU's shape (CONFIG: ``configs/bench/host.yaml`` unless given,
~20 s; the small shape counts the same and takes ~15 minutes interpreted): this builds both arms with the trainer's setup (``benchmarks/step.py``'s
``build_arm``) on the kernels a GPU run resolves (the torch backend's Triton QKV
split + shift + RoPE node, the fused loss and SwiGLU; with ``--set
model.rope_kernel=torch`` megatron's RoPE in both arms and the shift's own split-and-shift
node), runs them through Triton's
interpreter (``TRITON_INTERPRET=1``), and after ``--steps`` steps (the first warms
caches and allocates the optimizer's state) counts one step's:

* ``ops``: aten operators dispatched on the host (a ``TorchDispatchMode``), the
  interpreter's own inside a kernel launch left out;
* ``launches``: Triton kernel launches, by kernel;
* ``calls``: Python function calls (``sys.setprofile``), the interpreter's inside
  a launch left out, by ``module:function`` (a generator counts at every element it
  yields: Python per element, which a list comprehension does not pay);

each by phase: ``forward`` and ``backward`` (megatron's schedule over the micro
batches; backward is what autograd's engine runs), ``finalize`` (megatron's
``finalize_model_grads``: the gradients' reduction) and ``update`` (the rest of
the step: the gradient norm, megatron's copies, the optimizer, the zeroing of the
gradient buffers). It prints each arm's totals and the entries
whose counts differ (kv_shift minus vanilla), largest first, and writes a JSON
(default ``runs/bench/host-<name>.json``).

The precision is bf16 unless ``--set train.precision=...`` (the GPU's: megatron's
``Float16Module`` and fp32 main parameters). Counts, not times: an interpreted
kernel takes the CPU seconds, a launch on a GPU a few microseconds. It runs where no
GPU is visible (``CUDA_VISIBLE_DEVICES=`` hides one); on a GPU, ``benchmarks/step.py
--profile`` counts the real thing.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates, at import

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from kvtrain.config import ConfigError  # noqa: E402

PHASES = ("forward", "backward", "finalize", "update")


class Phases:
    """Which part of megatron's step the host is in (:meth:`install` wraps the run's
    schedule and gradient reduction), and whether inside a Triton launch (the
    interpreter's own work, which a GPU does not do on the host)."""

    def __init__(self, phase: str = "update") -> None:
        self.phase = phase  # outside megatron's schedule: the update (or the build)
        self.launching = 0

    def where(self) -> str:
        if self.phase == "forward" and torch._C._current_autograd_node() is not None:
            return "backward"
        return self.phase

    def wrap(self, fn, phase: str):
        """``fn`` run in ``phase`` (the phase before it restored after)."""
        def in_phase(*args, **kwargs):
            before, self.phase = self.phase, phase
            try:
                return fn(*args, **kwargs)
            finally:
                self.phase = before
        return in_phase

    def install(self, run) -> None:
        """Phases for ``run`` (a ``kvtrain.train.setup.Run``): megatron's schedule runs
        forward and backward, ``finalize_model_grads`` the reduction."""
        run.forward_backward = self.wrap(run.forward_backward, "forward")
        config = run.model[0].config  # the TransformerConfig megatron's schedule reads
        config.finalize_model_grads_func = self.wrap(config.finalize_model_grads_func,
                                                     "finalize")

    def launched(self, name: str) -> None:
        """Called at each Triton launch, before its inside runs."""


class Counter(Phases):
    """The host's work while :meth:`counting`: by phase, operators, launches, calls."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = {kind: {p: collections.Counter() for p in PHASES}
                       for kind in ("ops", "launches", "calls")}
        self.on = False

    def launched(self, name: str) -> None:
        if self.on and not self.launching:
            self.counts["launches"][self.where()][name] += 1

    def profile(self, frame, event, arg) -> None:
        if event == "call" and self.on and not self.launching:
            code = frame.f_code
            if code.co_filename == __file__:
                return  # the counting's own wrappers
            module = frame.f_globals.get("__name__", "?")
            self.counts["calls"][self.where()][f"{module}:{code.co_qualname}"] += 1

    @contextlib.contextmanager
    def counting(self, calls: bool):
        """Python calls (``calls``) or operators: in separate steps, since the dispatch
        mode's Python would be counted among the calls."""
        self.on = True
        try:
            if calls:
                sys.setprofile(self.profile)
                yield
            else:
                with _Ops(self):
                    yield
        finally:
            sys.setprofile(None)
            self.on = False

    def totals(self) -> dict:
        return {kind: {p: sum(c.values()) for p, c in by.items()}
                for kind, by in self.counts.items()}


class _Ops(TorchDispatchMode):
    def __init__(self, counter: Counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counter
        if c.on and not c.launching:
            c.counts["ops"][c.where()][str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


_LAUNCHES: list = []  # [the Phases told of launches] once hooked


def hook_launches(phases: Phases) -> None:
    """Every interpreted launch told to ``phases`` once (its kernel's name), its inside
    marked (``phases.launching``) to be left out. Hooked once a process: a second
    call hands the launches to its ``phases`` instead."""
    from triton.runtime import interpreter

    if _LAUNCHES:
        _LAUNCHES[0] = phases
        return
    _LAUNCHES.append(phases)
    launch = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        told = _LAUNCHES[0]
        told.launched(getattr(self.fn, "__name__", "?"))
        told.launching += 1
        try:
            return launch(self, *args, **kwargs)
        finally:
            told.launching -= 1

    interpreter.GridExecutor.__call__ = counted


def gpu_kernels() -> None:
    """The run's kernels as a GPU run resolves them (the torch backend's Triton node,
    loss and SwiGLU), where the CPU would take torch's ops; the backend's record says
    so."""
    from kvtrain.train import setup

    resolve = setup._resolve_backend

    def as_on_a_gpu(cfg, numerics):
        backend, kernels = resolve(cfg, numerics)
        m = cfg.model
        rope = m.rope_kernel != "torch"  # torch: megatron's RoPE ops (both arms)
        chosen = [key for key, value in (("model.rope_kernel", "auto" if not rope
                                          else m.rope_kernel),
                                         ("model.kv_shift.kernel", m.kv_shift.kernel),
                                         ("model.cross_entropy_kernel", m.cross_entropy_kernel),
                                         ("model.swiglu_kernel", m.swiglu_kernel))
                  if value != "auto"]
        if m.backend not in ("auto", "torch") or cfg.parallel.context > 1 or m.mla or chosen:
            raise ConfigError("host_work.py counts the torch backend's GPU path with its "
                              "auto kernels (model.backend auto or torch, parallel.context "
                              f"1, no MLA; set to something else: {', '.join(chosen) or '-'})")
        shift = "triton" if kernels.shift else None
        in_split = shift is None or sorted(cfg.model.kv_shift.shift) == ["k", "v"]
        why = "(the GPU's, in Triton's interpreter)"
        backend = dataclasses.replace(
            backend, rope=(f"triton{' in the QKV split' if in_split else ''} {why}" if rope
                           else "torch (model.rope_kernel: torch)"),
            cross_entropy=f"triton {why}", swiglu=f"triton {why}",
            shift_kernel=f"{shift} {why}" if shift else None)
        return backend, setup.Kernels(shift, rope, "triton", "triton")

    setup._resolve_backend = as_on_a_gpu


@contextlib.contextmanager
def on_gpu_kernels(config: str, sets: list[str], steps: int, prefix: str):
    """Both arms' configs (bf16 unless ``sets`` say otherwise), this process set up to
    build them on the GPU's kernels (:func:`gpu_kernels`), and a scratch folder,
    removed after: ``(cfgs, env, scratch, sets)``."""
    from benchmarks import step as bench
    from benchmarks.step_arms import init_env
    from kvtrain.commands.train import quiet_imports

    sets = ["train.precision=bf16", *sets]
    cfgs = bench.arm_configs(config, None, sets, steps)
    quiet_imports()
    gpu_kernels()
    env = init_env(cfgs["vanilla"])
    scratch = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield cfgs, env, scratch, sets
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def count_arm(arm, steps: int) -> Counter:
    """``steps`` steps of ``arm`` (benchmarks/step.py's ``Arm``), then two more counted:
    one its Python calls, one its operators (launches in both: counted in the second)."""
    counter = Counter()
    hook_launches(counter)
    counter.install(arm.run)
    for _ in range(steps):
        arm.step()
    with counter.counting(calls=True):
        arm.step()
    counter.counts["launches"] = {p: collections.Counter() for p in PHASES}
    with counter.counting(calls=False):
        arm.step()
    return counter


def differences(vanilla: Counter, shifted: Counter, top: int) -> dict:
    """kind -> phase -> [[name, kv_shift - vanilla, kv_shift's count]], largest first."""
    out: dict = {}
    for kind in vanilla.counts:
        out[kind] = {}
        for phase in PHASES:
            a, b = vanilla.counts[kind][phase], shifted.counts[kind][phase]
            diff = [[name, b[name] - a[name], b[name]] for name in set(a) | set(b)
                    if a[name] != b[name]]
            diff.sort(key=lambda e: (-abs(e[1]), e[0]))
            out[kind][phase] = diff[:top]
    return out


def table(result: dict) -> str:
    lines = [f"{result['config']}: {result['backend']}; {result['layers']} layers, "
             f"{result['micro_batches']} micro batches; counted after {result['steps']} steps",
             f"{'':10s}" + "".join(f"{f'{k} {p}':>22s}" for k in ("ops", "calls")
                                   for p in PHASES)]
    for arm, totals in result["totals"].items():
        lines.append(f"{arm:10s}" + "".join(f"{totals[k][p]:22d}" for k in ("ops", "calls")
                                            for p in PHASES))
    for arm, totals in result["totals"].items():
        lines.append(f"{arm} launches: " + ", ".join(
            f"{p} {totals['launches'][p]}" for p in PHASES))
    for kind, by in result["differences"].items():
        for phase, entries in by.items():
            if entries:
                lines.append(f"kv_shift - vanilla, {kind}, {phase}:")
                lines += [f"  {d:+6d} {n:6d}  {name}" for name, d, n in entries]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    from benchmarks import step as bench
    from benchmarks.step_arms import build_arm

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/bench/host.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=1,
                        help="steps per arm before the two counted ones")
    parser.add_argument("--top", type=int, default=25, help="entries listed per kind and phase")
    parser.add_argument("--json", help="where the result goes")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if torch.cuda.is_available():
        print("host_work.py: counts on the CPU, in Triton's interpreter; on a GPU use "
              "benchmarks/step.py --profile (or hide it: CUDA_VISIBLE_DEVICES=)",
              file=sys.stderr)
        return 2
    try:
        with on_gpu_kernels(args.config, args.set, args.steps, "kvtrain-host-") as (
                cfgs, env, scratch, sets):
            counters = {}
            for name in bench.ARMS:
                arm = build_arm(name, cfgs[name], scratch / name, env, 0, measure=False)
                counters[name] = count_arm(arm, args.steps)
                backend = arm.run.backend.describe()
                micro = arm.run.num_microbatches
    except ConfigError as e:
        print(f"host_work.py: config error: {e}", file=sys.stderr)
        return 2
    cfg = cfgs["vanilla"]
    result = {"config": args.config, "sets": sets, "backend": backend, "steps": args.steps,
              "layers": cfg.model.num_layers, "micro_batches": micro,
              "totals": {name: c.totals() for name, c in counters.items()},
              "differences": differences(counters["vanilla"], counters["kv_shift"], args.top)}
    print(table(result))
    out = Path(args.json or Path("runs") / "bench" / f"host-{cfg.name}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"host_work.py: wrote {out}")
    from kvtrain.backend import destroy_distributed

    destroy_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
