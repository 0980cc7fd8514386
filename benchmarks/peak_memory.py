"""Each arm's peak of allocated memory on the GPU's kernels, as CUDA's caching
allocator counts it, replayed on the CPU, and what is alive at the peak.

    python benchmarks/peak_memory.py [CONFIG] [--set KEY=VALUE ...] [--steps 2]
                                     [--top 15] [--json OUT]
    python benchmarks/peak_memory.py --snapshots VANILLA.pickle KV_SHIFT.pickle

On a GPU ``benchmarks/step.py`` measures each arm's peak as the growth of
``torch.cuda.max_memory_allocated`` over its build and warm-up; that says how much,
not what. This replays the same build and steps on the CPU, on the kernels a GPU
run resolves (the torch backend's Triton QKV node, fused loss and SwiGLU, run in
Triton's interpreter: ``host_work.py``'s setup), and keeps two counts:

* alive: every storage an operator creates (not one of its inputs': views and
  in-place results are not allocations), rounded up as the allocator rounds a
  request (512 bytes), until freed (a weak reference's callback); a storage's
  ``resize_`` changes it. The maximum is the arm's peak; the storages alive then
  are listed by where they were made (the innermost kvtrain or megatron frame, the
  operator, the phase: ``build``, ``forward``, ``backward``, ``finalize``,
  ``update``) with their shapes;
* the allocator's blocks: the same requests and frees replayed through CUDA's
  caching allocator's rules (``allocator_replay.py``), which hands a cached block
  out whole when no more than 1 MiB of it would be left: what
  ``max_memory_allocated`` counts, and at its peak the blocks held against what was
  asked for them.

The two arms' lists are compared, largest difference first; and their requests in
order (``allocator_replay.requests_apart``): those one arm makes and the other does
not, and those both make at other sizes. Where none but the coefficients' own are
listed, the allocator is handed the same requests in the same order and packs both
arms alike. Neither count sees a
kernel's own buffers (cuBLAS's workspace, 32 MiB on Hopper; attention's), which a
GPU's peak includes in both arms, nor tensors made from numpy without an operator.
``--snapshots`` reads a GPU run's own trace instead (``step.py --memory-history``),
where those are included. bf16 unless ``--set train.precision=...``; ``--steps``
steps after the build (the first allocates the optimizer's state); JSON default
``runs/bench/peak-<name>.json``. The replay runs where no GPU is visible.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"  # read when triton.jit decorates, at import

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import pickle  # noqa: E402
import sys  # noqa: E402
import weakref  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.allocator_replay import (Block, Log, allocator_peak,  # noqa: E402
                                         block_bytes, read_snapshot, requests_apart, site)
from benchmarks.host_work import Phases, hook_launches, on_gpu_kernels  # noqa: E402
from kvtrain.config import ConfigError  # noqa: E402

def _site() -> str:
    """Where the operator being dispatched was called from (:func:`allocator_replay.site`)."""
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        named = site(code.co_filename, frame.f_lineno, code.co_name)
        if named:
            return named
        frame = frame.f_back
    return "?"


class Allocations(Phases, TorchDispatchMode):
    """The caching allocator's count of the storages operators make, while entered."""

    def __init__(self) -> None:
        Phases.__init__(self, phase="build")
        TorchDispatchMode.__init__(self)
        self.live: dict[int, tuple[Block, weakref.ref]] = {}  # data_ptr -> block
        self.log = Log()

    def _add(self, storage, op: str, shape, dtype) -> None:
        ptr = storage.data_ptr()
        size = block_bytes(storage.nbytes())
        if size == 0 or ptr in self.live:
            return
        block = Block(size, _site(), op, self.where(), tuple(shape), str(dtype))
        self.live[ptr] = (block, weakref.ref(storage, lambda _, p=ptr: self._free(p)))
        self.log.count(+1, block, f"{op} in the {block.phase}")

    def _free(self, ptr: int) -> None:
        self.log.count(-1, self.live.pop(ptr)[0])

    def resized(self, storage, ptr: int) -> None:
        """``storage``, at ``ptr`` before, changed size (a ``resize_``: new memory,
        unless the same size)."""
        entry = self.live.get(ptr)
        if entry is not None and (ptr, entry[0].size) == (storage.data_ptr(),
                                                          block_bytes(storage.nbytes())):
            return
        if entry is not None:
            self._free(ptr)
        self._add(storage, "resize_", (storage.nbytes(),), "bytes")

    def __enter__(self):
        """Also ``UntypedStorage.resize_`` (megatron frees gathered parameters by it),
        which is not an operator the dispatch mode sees."""
        resize = self._resize = torch.UntypedStorage.resize_

        def counted(storage, size):
            ptr = storage.data_ptr()
            out = resize(storage, size)
            self.resized(storage, ptr)
            return out

        torch.UntypedStorage.resize_ = counted
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.resize_:  # new memory (set_ takes another's)
            ptr = args[0].untyped_storage().data_ptr()
            out = func(*args, **(kwargs or {}))
            if not self.launching:
                self.resized(args[0].untyped_storage(), ptr)
            return out
        out = func(*args, **(kwargs or {}))
        if self.launching:
            return out  # the interpreter's copies inside a launch: not the GPU's
        inputs = {t.untyped_storage().data_ptr() for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs:
                self._add(storage, str(func.overloadpacket), t.shape, t.dtype)
        return out


def _tensors(tree):
    if isinstance(tree, torch.Tensor):
        yield tree
    elif isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _tensors(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _tensors(x)


def measure_arm(name: str, cfg, run_dir: Path, env, steps: int) -> tuple[Allocations, str]:
    """The arm built and stepped ``steps`` times under one :class:`Allocations`; the
    backend it ran on."""
    from benchmarks.step_arms import build_arm

    tracker = Allocations()
    hook_launches(tracker)
    with tracker:
        arm = build_arm(name, cfg, run_dir, env, 0, measure=False)
        tracker.install(arm.run)
        tracker.phase = "update"
        for _ in range(steps):
            arm.step()
        backend = arm.run.backend.describe()
        del arm
    return tracker, backend


def _shapes(blocks: list[Block]) -> str:
    shapes = collections.Counter(b.shape for b in blocks)
    return ", ".join(f"{n} x {list(shape)}" if n > 1 else str(list(shape))
                     for shape, n in shapes.most_common(3)) + (" ..." if len(shapes) > 3 else "")


def differences(a: dict, b: dict, top: int, shapes: Optional[tuple] = None) -> list[list]:
    """The kinds whose counts differ between vanilla's ``a`` and the shift's ``b``
    (kind -> (bytes, ...)): [[*kind, *(kv_shift - vanilla of each count), and with
    ``shapes`` (each arm's kind -> blocks) vanilla's shapes, kv_shift's]], largest
    first."""
    rows = []
    for key in set(a) | set(b):
        va, vb = a.get(key), b.get(key)
        zero = (0,) * len(va or vb)
        d = [y - x for x, y in zip(va or zero, vb or zero)]
        if any(d):
            listed = [_shapes(side.get(key, [])) for side in shapes] if shapes else []
            rows.append([*key, *d, *listed])
    rows.sort(key=lambda e: (-abs(e[4]), e[:4]))
    return rows[:top]


def compare(logs: dict[str, Log], top: int) -> list[list]:
    """What is alive at the arms' peaks, compared: [[phase, site, op, dtype,
    kv_shift bytes - vanilla bytes, vanilla's shapes, kv_shift's]], largest first."""
    alive = [logs[arm].at_peak() for arm in ("vanilla", "kv_shift")]
    a, b = ({key: (sum(x.size for x in blocks),) for key, blocks in side.items()}
            for side in alive)
    return differences(a, b, top, shapes=alive)


def summary(log: Log, blocks: dict) -> dict:
    """An arm's peaks: ``log``'s and the allocator's (``blocks``: :func:`allocator_peak`)."""
    by_phase: collections.Counter = collections.Counter()
    for (phase, *_), alive in log.at_peak().items():
        by_phase[phase] += sum(b.size for b in alive)
    return {"peak_bytes": log.peak, "peak_at": log.peak_op,
            "allocator_peak_bytes": blocks["bytes"],
            "allocator_peak_asked_bytes": blocks["asked"],
            "alive_at_peak_by_phase": dict(by_phase)}


def report(logs: dict[str, Log], top: int, **about) -> dict:
    """The JSON's content: ``about`` (config, backend, ...), each arm's summary, the
    ratios, the differences."""
    blocks = {name: allocator_peak(log) for name, log in logs.items()}
    arms = {name: summary(log, blocks[name]) for name, log in logs.items()}
    k, v = arms["kv_shift"], arms["vanilla"]
    held = differences(*({key: tuple(v) for key, v in blocks[arm]["kinds"].items()}
                         for arm in ("vanilla", "kv_shift")), top)
    apart = requests_apart(logs["vanilla"], logs["kv_shift"], ("vanilla", "kv_shift"))
    return {**about, "arms": arms, "ratio": k["peak_bytes"] / v["peak_bytes"],
            "allocator_ratio": k["allocator_peak_bytes"] / v["allocator_peak_bytes"],
            "differences": compare(logs, top), "allocator_differences": held,
            "requests_apart": apart}


def table(result: dict, top: int = 15) -> str:
    mib = 2 ** 20
    lines = [f"{result['config']}: {result['backend']}; after {result['steps']} steps"]
    for arm, s in result["arms"].items():
        phases = ", ".join(f"{p} {v / mib:.2f}" for p, v in s["alive_at_peak_by_phase"].items())
        lines.append(f"{arm:9s} peak {s['peak_bytes'] / mib:9.3f} MiB (at {s['peak_at']}; "
                     f"alive, by where made, MiB: {phases})")
    for arm, s in result["arms"].items():
        lines.append(f"{arm:9s} the caching allocator's blocks at their peak: "
                     f"{s['allocator_peak_bytes'] / mib:9.3f} MiB, asked for "
                     f"{s['allocator_peak_asked_bytes'] / mib:.3f} MiB")
    lines.append(f"ratio kv_shift / vanilla: {result['ratio']:.4f} alive, "
                 f"{result['allocator_ratio']:.4f} in the allocator's blocks")
    lines.append("alive at the peaks, kv_shift - vanilla (made in, where, operator, dtype: "
                 "shapes vanilla | kv_shift):")
    lines += [f"  {d / mib:+9.3f} MiB  {phase:8s} {site}  {op} {dtype}: {sa or '-'} | {sb or '-'}"
              for phase, site, op, dtype, d, sa, sb in result["differences"]]
    lines.append("the allocator's blocks at its peaks, kv_shift - vanilla (held, asked for):")
    lines += [f"  {d / mib:+9.3f} MiB ({asked / mib:+.3f})  {phase:8s} {site}  {op} {dtype}"
              for phase, site, op, dtype, d, asked in result["allocator_differences"]]
    apart = result["requests_apart"]
    lines.append(f"requests one arm makes and the other does not, or at another size "
                 f"({len(apart)} kinds; all of them in the JSON):")
    lines += [f"  {side:13s} {n:5d} x, {size / 2**10:+10.1f} KiB  {phase:8s} {site}  {op} {dtype}"
              for side, phase, site, op, dtype, size, n in apart[:top]]
    return "\n".join(lines)


def replay_arms(args) -> dict:
    """Both arms built and stepped on the CPU (module docstring): :func:`report`'s result."""
    from benchmarks import step as bench
    from kvtrain.backend import destroy_distributed

    try:
        with on_gpu_kernels(args.config, args.set, args.steps, "kvtrain-peak-") as (
                cfgs, env, scratch, sets):
            logs = {}
            for name in bench.ARMS:
                tracker, backend = measure_arm(name, cfgs[name], scratch / name, env,
                                               args.steps)
                logs[name] = tracker.log
    finally:
        destroy_distributed()
    return report(logs, args.top, config=args.config, sets=sets, steps=args.steps,
                  backend=backend, name=cfgs["vanilla"].name)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="configs/bench/host.yaml")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--steps", type=int, default=2, help="steps per arm after its build")
    parser.add_argument("--snapshots", nargs=2, metavar=("VANILLA", "KV_SHIFT"), type=Path,
                        help="read a GPU run's two snapshots (benchmarks/step.py "
                             "--memory-history) instead of replaying the arms here")
    parser.add_argument("--top", type=int, default=15, help="differences listed")
    parser.add_argument("--json", help="where the result goes")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    if args.snapshots:
        logs = {}
        for arm, path in zip(("vanilla", "kv_shift"), args.snapshots):
            try:
                logs[arm] = read_snapshot(path)
            except (OSError, ValueError, pickle.UnpicklingError, KeyError, TypeError,
                    EOFError) as e:
                print(f"peak_memory.py: {path}: not a memory snapshot ({e})", file=sys.stderr)
                return 2
        result = report(logs, args.top, config=" | ".join(map(str, args.snapshots)),
                        steps="as recorded", backend="a GPU run's trace", name="snapshots")
    elif torch.cuda.is_available():
        print("peak_memory.py: replays the arms on the CPU; on a GPU benchmarks/step.py "
              "--memory-history records them for --snapshots (or hide the GPU: "
              "CUDA_VISIBLE_DEVICES=)", file=sys.stderr)
        return 2
    else:
        try:
            result = replay_arms(args)
        except ConfigError as e:
            print(f"peak_memory.py: config error: {e}", file=sys.stderr)
            return 2
    print(table(result, args.top))
    out = Path(args.json or Path("runs") / "bench" / f"peak-{result['name']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"peak_memory.py: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
