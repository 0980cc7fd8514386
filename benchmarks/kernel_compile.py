"""Every Triton kernel of kvtrain compiled for a GPU, on a machine without one, and what
each compiled kernel uses: registers, spills, shared memory, the warps an SM can hold,
and the widths of its global loads and stores.

    .venv/bin/python benchmarks/kernel_compile.py [--arch 90 80] [--sass-arch 90] [--json PATH]

Triton's own compiler (its passes, LLVM, NVIDIA's ``ptxas``, all in the ``triton``
package) builds each kernel for the architecture named (90: H100/H200/H800, 80:
A100) from the launches kvtrain's wrappers make, through :class:`CompileOnlyDriver`:
a driver that stands in for CUDA's, says which GPU it is, and loads and launches
nothing. So what a GPU compile rejects and Triton's interpreter lets pass (a
loop-carried value that changes type, a block too large for the registers, shared
memory over the SM's) fails here, on the CPU, in ``make test``
(tests/model/test_kernel_compile.py). The kernels' results are not computed: their
arithmetic is checked in the interpreter (tests/model/test_triton_interpreter.py and
the tests of each node), their speed only on a GPU.

The launches (:data:`CASES`) are the wrappers' calls at the paper's shapes (head dim
128, 16 heads, GQA with 4 query heads per group, a 36k vocabulary) and at shapes
that change Triton's specialisation (head dim 64 and 80, an unpadded vocabulary,
strided gradients), every constexpr flag a training run can set; each case compiles
at least one kernel no earlier case did (TP's half of the vocabulary, or Llama 3's
128k, compile to the paper's loss kernel: same specialisation).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # run as a script: kvtrain from this checkout
    sys.path.insert(0, str(REPO))

try:  # the dev extra installs it on Linux x86_64; main() says so where it is missing
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver as triton_driver
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# What the occupancy estimate needs per architecture: shared memory a block may take,
# per SM, 32-bit registers per SM, warps and blocks an SM holds (CUDA's tables).
GPUS = {
    80: dict(name="A100", smem_block=166912, smem_sm=167936, regs=65536, warps=64, blocks=32),
    90: dict(name="H100/H200/H800", smem_block=232448, smem_sm=233472, regs=65536, warps=64,
             blocks=32),
    100: dict(name="B200", smem_block=232448, smem_sm=233472, regs=65536, warps=64,
              blocks=32),
}
# every kernel module of kvtrain's (kvtrain/model/triton_*.py): a new one cannot be missed
KERNEL_MODULES = tuple(sorted(
    f"kvtrain.model.{p.stem}"
    for p in (Path(__file__).resolve().parents[1] / "kvtrain" / "model").glob("triton_*.py")))
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" if triton else None
_TRITON = tuple(int(v) for v in re.findall(r"\d+", triton.__version__)[:2]) if triton else ()


@dataclass
class Compiled:
    """One compiled kernel: the case that launched it first and what it uses."""
    case: str
    kernel: str
    constexprs: dict
    num_warps: int
    shared: int
    registers: int = 0
    stack_bytes: int = 0  # a thread's stack frame, in local (global) memory: spills
    warps_per_sm: int = 0
    # From the SASS (None where it was not disassembled: --sass-arch)
    local_ops: Optional[int] = None  # loads and stores of local memory (STL/LDL)
    instructions: Optional[int] = None  # each once (loops not unrolled count once)
    barriers: Optional[int] = None  # BAR.SYNC: the block's threads wait for each other
    memory_ops: Optional[dict] = None  # {"LDG.E.128": n, ...}


class CompileOnlyDriver:
    """Triton's driver interface for a GPU of compute capability ``arch`` that is not
    there: compiles with Triton's CUDA backend, reads each binary's resources with
    ``cuobjdump``, and launches nothing. The device index is ``arch``, so kernels
    compiled for one architecture are never reused for another in one process.
    ``sass``: disassemble each binary too (~1 s each, most of a compile's time)."""

    def __init__(self, arch: int, sass: bool = True):
        self.arch = arch
        self.sass = sass
        self.case = "?"
        self.compiled: list[Compiled] = []
        self.utils = self  # Triton calls driver.utils.load_binary / get_device_properties

    @staticmethod
    def is_active() -> bool:
        return False

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", self.arch, 32)

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")

    def get_device_properties(self, device: int) -> dict:
        gpu = GPUS[self.arch]
        return {"max_shared_mem": gpu["smem_block"], "max_num_regs": gpu["regs"],
                "multiprocessor_count": 132, "warpSize": 32}

    def load_binary(self, name: str, cubin: bytes, shared: int, device: int):
        """(module, function, registers, spills, max threads) as CUDA's loader gives them."""
        usage = resources(cubin)
        c = self.compiled[-1]
        c.registers, c.stack_bytes = usage["REG"], usage["STACK"]
        if self.sass:
            c.instructions, c.local_ops, c.barriers, c.memory_ops = sass_counts(cubin)
        c.warps_per_sm = warps_per_sm(self.arch, usage["REG"], c.num_warps, shared)
        # a module that is not None: Triton then takes the kernel as loaded and does not
        # come back here (or to launcher_cls) on its next launch
        loaded = (name, None, usage["REG"], usage["STACK"], 1024)
        return loaded if _TRITON >= (3, 4) else loaded[:4]  # max threads: since 3.4

    def launcher_cls(self, src, metadata) -> Callable:
        """Called once per compiled kernel (at its first launch), before
        :meth:`load_binary`."""
        self.compiled.append(Compiled(
            case=self.case, kernel=src.fn.__name__,
            constexprs={_name(src.fn.arg_names, k): v for k, v in src.constants.items()},
            num_warps=metadata.num_warps, shared=metadata.shared))
        return lambda *args: None


def _name(params: list, key) -> str:
    """A constexpr's parameter name (Triton keys them by their index path)."""
    if isinstance(key, tuple) and len(key) == 1 and isinstance(key[0], int):
        return params[key[0]]
    return str(key)


def _cuobjdump(cubin: bytes, what: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        done = subprocess.run([str(BIN / "cuobjdump"), what, f.name], capture_output=True,
                              text=True, check=True)
    return done.stdout


def resources(cubin: bytes) -> dict:
    """{"REG": registers per thread, "STACK": stack frame bytes (spills), ...}."""
    line = re.search(r"REG:\d+.*", _cuobjdump(cubin, "--dump-resource-usage")).group(0)
    return {k: int(v) for k, v in re.findall(r"(\w+):(\d+)", line)}


def sass_counts(cubin: bytes) -> tuple[int, int, int, dict]:
    """(instructions, local-memory loads and stores, block barriers, {global load or
    store: how many}) in the SASS: ``LDG.E.128`` loads 16 bytes a thread,
    ``LDG.E.U16`` 2, ``LDG.E`` 4."""
    sass = _cuobjdump(cubin, "--dump-sass")
    ops: dict = {}
    for op in re.findall(r"\b((?:LDG|STG)\.[A-Z0-9_.]+)", sass):
        ops[op] = ops.get(op, 0) + 1
    return (len(re.findall(r"/\*[0-9a-f]{4,}\*/ ", sass)),
            len(re.findall(r"\b(?:LDL|STL)\b", sass)), len(re.findall(r"\bBAR\.SYNC", sass)),
            dict(sorted(ops.items())))


def warps_per_sm(arch: int, registers: int, num_warps: int, shared: int) -> int:
    """Resident warps per SM that registers, shared memory and the block limit allow
    (registers allocated per warp in units of 256)."""
    gpu = GPUS[arch]
    per_warp = -(-registers * 32 // 256) * 256
    blocks = min(gpu["blocks"], gpu["warps"] // num_warps,
                 gpu["regs"] // (per_warp * num_warps),
                 gpu["smem_sm"] // shared if shared else gpu["blocks"])
    return blocks * num_warps


@contextlib.contextmanager
def compiling_for(arch: int, sass: bool = True) -> Iterator[CompileOnlyDriver]:
    """Triton launches in this block compile for ``arch`` and run nothing."""
    fake = CompileOnlyDriver(arch, sass)
    # Triton's driver config as it was (its attributes differ across 3.2-3.9; reading
    # ``active`` would look for a CUDA driver where there is none)
    before = dict(vars(triton_driver))
    triton_driver.set_active(fake)
    try:
        yield fake
    finally:
        vars(triton_driver).clear()
        vars(triton_driver).update(before)


def launch_points() -> dict:
    """Every Triton kernel kvtrain launches: the ``@triton.jit`` functions of its kernel
    modules that no other one calls (the rest are helpers inlined into them)."""
    jitted = {}
    for name in KERNEL_MODULES:
        module = importlib.import_module(name)
        jitted.update({f"{name}.{k}": v for k, v in vars(module).items()
                       if isinstance(v, triton.runtime.JITFunction) and v.__module__ == name})
    sources = [fn.src for fn in jitted.values()]
    return {key: fn for key, fn in jitted.items()
            if sum(re.search(rf"\b{fn.__name__}\(", s) is not None for s in sources) == 1}


# ----------------------------------------------------------------------------- the launches
# Sizes: Triton specialises an integer argument on its divisibility by 16 (and on being
# 1), a pointer on its alignment, and compiles once per constexpr set: the launches
# below take the paper's head dims and widths with few tokens (what a compile sees of
# 2048 tokens, 256 show), plus the shapes that change a specialisation.
S, B = 256, 2
BF16, FP32 = torch.bfloat16, torch.float32


def _docs(s: int = S, b: int = B) -> torch.Tensor:
    """``[s, b]`` int32 document ids as the layers get them: a transposed ``[b, s]``."""
    ids = torch.zeros(b, s, dtype=torch.int32)
    ids[:, s // 3:] = 1
    return ids.t()


def _sdpa_grad(s: int, b: int, h: int, d: int, dtype) -> torch.Tensor:
    """``[s, b, h, d]`` with the strides of a gradient out of attention on ``[b, h, s, d]``."""
    return torch.randn(b, h, s, d, dtype=dtype).permute(2, 0, 1, 3)


def _shift(dtype, d: int, window: int, docs: bool, learn: bool, heads: int = 16) -> None:
    """The one-tensor shift (the variants that shift one of Q, K, V; the ``te`` backend's
    selected heads), forward and backward."""
    from kvtrain.model import triton_shift

    x = torch.randn(S, B, heads, d, dtype=dtype)
    coef, ids = torch.rand(heads, window + 1), _docs() if docs else None
    triton_shift.shift_forward(x, coef, ids)
    triton_shift.shift_backward(x if learn else None, coef, ids, _sdpa_grad(S, B, heads, d, dtype))


def _qkv_shift(dtype, d: int, groups: int, per_group: int, window: int, docs: bool,
               learn: bool, dq: bool) -> None:
    """The K+V shift in megatron's QKV output (``te`` and every backend off the fused
    RoPE split), forward and backward."""
    from kvtrain.model import triton_shift

    q = per_group * d
    mixed = torch.randn(S, B, groups, q + 2 * d, dtype=dtype)
    ck, cv = torch.rand(groups, window + 1), torch.rand(groups, window + 1)
    ids = _docs() if docs else None
    _, _, raw = triton_shift.qkv_forward(mixed, ck, cv, ids, q, keep_raw=learn)
    triton_shift.qkv_backward(raw, (S, B, groups, 2, d), ck, cv, ids, q,
                              _sdpa_grad(S, B, groups * per_group, d, dtype) if dq else None,
                              _sdpa_grad(S, B, groups, d, dtype), _sdpa_grad(S, B, groups, d, dtype))


def _rope(dtype, d: int, rotary: int, heads: int = 16) -> None:
    """kvtrain's RoPE in megatron's fused slot: Q or K forward, the inverse backward."""
    from kvtrain.model import triton_rope

    freqs = torch.randn(S, 1, 1, rotary)
    triton_rope.rotate(torch.randn(S, B, heads, d, dtype=dtype), freqs)
    triton_rope.rotate(_sdpa_grad(S, B, heads, d, dtype), freqs, inverse=True)


def _qkv_rope(dtype, d: int, groups: int, per_group: int, shift: bool, window: int = 1,
              docs: bool = False, learn: bool = True, grads: str = "qkv") -> None:
    """The QKV split, the K+V shift and RoPE in one node (the ``torch`` backend on a GPU):
    forward, and backward with the gradients ``grads`` names (the others absent)."""
    from kvtrain.model import triton_qkv_rope

    q = per_group * d
    mixed = torch.randn(S, B, groups, q + 2 * d, dtype=dtype)
    freqs = torch.randn(S, 1, 1, d)
    ck = torch.rand(groups, window + 1) if shift else None
    cv = torch.rand(groups, window + 1) if shift else None
    ids = _docs() if docs else None
    triton_qkv_rope.forward(mixed, freqs, q, ck, cv, ids)
    heads = {"q": groups * per_group, "k": groups, "v": groups}
    dq, dk, dv = (_sdpa_grad(S, B, heads[n], d, dtype) if n in grads else None for n in "qkv")
    triton_qkv_rope.backward(mixed, freqs, q, ck, cv, ids, dq, dk, dv, need_coef=learn)


def _loss(dtype, vocab: int, vocab_start: int = 0, tokens: int = S * B) -> None:
    """The fused cross-entropy on one TP rank's ``vocab`` columns: both passes."""
    from kvtrain.model import triton_cross_entropy

    logits = torch.randn(tokens, vocab, dtype=dtype)
    labels = torch.randint(0, 2 * vocab, (tokens,))
    top, sums, _ = triton_cross_entropy.shard_statistics(logits, labels, vocab_start)
    triton_cross_entropy.gradient_in_place(logits, labels, top, 1 / sums,
                                           torch.rand(tokens), vocab_start)


def _swiglu(dtype, f: int) -> None:
    """The MLP's activation on fc1's output ``[s, b, 2f]`` (this rank's ``f``): both passes."""
    from kvtrain.model import triton_swiglu

    x = torch.randn(S, B, 2 * f, dtype=dtype)
    triton_swiglu.backward(x, triton_swiglu.forward(x))


CASES: dict = {
    # the paper's 1.5B: 16 heads of 128, MHA; GQA with 4 query heads per group
    "qkv+rope vanilla bf16 d128": lambda: _qkv_rope(BF16, 128, 16, 1, shift=False),
    "qkv+rope vanilla gqa bf16 d128": lambda: _qkv_rope(BF16, 128, 4, 4, shift=False),
    "qkv+rope kv_shift bf16 d128": lambda: _qkv_rope(BF16, 128, 16, 1, shift=True),
    "qkv+rope kv_shift gqa d128 docs w2": lambda: _qkv_rope(BF16, 128, 4, 4, shift=True, window=2,
                                                       docs=True),
    "qkv+rope kv_shift fixed d128 no dq": lambda: _qkv_rope(BF16, 128, 16, 1, shift=True,
                                                         learn=False, grads="kv"),
    "qkv+rope kv_shift fp32 d64 w3": lambda: _qkv_rope(FP32, 64, 8, 1, shift=True, window=3),
    "qkv+rope vanilla fp32 d80 k only": lambda: _qkv_rope(FP32, 80, 4, 2, shift=False,
                                                           grads="k"),
    "qkv shift bf16 d128": lambda: _qkv_shift(BF16, 128, 16, 1, 1, False, True, True),
    "qkv shift gqa d128 docs w2": lambda: _qkv_shift(BF16, 128, 4, 4, 2, True, True, True),
    "qkv shift fixed, no dq fp32 d64": lambda: _qkv_shift(FP32, 64, 8, 1, 1, False, False, False),
    "shift bf16 d128": lambda: _shift(BF16, 128, 1, False, True),
    "shift docs fixed bf16 d128": lambda: _shift(BF16, 128, 1, True, False),
    "shift fp32 d64 w3 docs": lambda: _shift(FP32, 64, 3, True, True, heads=8),
    "rope bf16 d128": lambda: _rope(BF16, 128, 128),
    "rope fp32 d64 half rotary": lambda: _rope(FP32, 64, 32, heads=8),
    "rope bf16 d80": lambda: _rope(BF16, 80, 80, heads=4),
    "loss bf16 36096 (paper)": lambda: _loss(BF16, 36096),
    "loss fp32 50257 unpadded": lambda: _loss(FP32, 50257, tokens=64),
    "swiglu bf16 f5504 (paper)": lambda: _swiglu(BF16, 5504),
    "swiglu fp32 f1001 unaligned": lambda: _swiglu(FP32, 1001),
}


def compile_all(arch: int, cases: Optional[dict] = None, sass: bool = True) -> list[Compiled]:
    """Runs every case's launches compiling for ``arch``: each kernel specialisation
    once, in order."""
    with compiling_for(arch, sass) as fake:
        for name, case in (cases or CASES).items():
            fake.case = name
            torch.manual_seed(0)
            case()
    return fake.compiled


def _table(arch: int, compiled: list[Compiled]) -> str:
    lines = [f"sm_{arch} ({GPUS[arch]['name']}), Triton {triton.__version__}: "
             f"{len(compiled)} kernels compiled",
             f"  {'case':34s} {'kernel':22s} {'regs':>4s} {'stack':>5s} {'smem':>6s} "
             f"{'warps':>5s} {'warps/SM':>8s} {'instr':>6s}  global loads / stores"]
    for c in compiled:
        ops = ", ".join(f"{op} x{n}" for op, n in (c.memory_ops or {}).items())
        instructions = "-" if c.instructions is None else c.instructions
        lines.append(f"  {c.case[:34]:34s} {c.kernel[:22]:22s} {c.registers:4d} "
                     f"{c.stack_bytes:5d} {c.shared:6d} {c.num_warps:5d} "
                     f"{c.warps_per_sm:8d} {instructions:>6}  {ops}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(GPUS),
                        help="compute capabilities: 90 (H100/H200/H800), 80 (A100), "
                             "100 (B200)")
    parser.add_argument("--sass-arch", type=int, nargs="*", choices=sorted(GPUS),
                        help="disassemble the kernels of these only (default: every --arch); "
                             "the others report registers, spills and occupancy, in half "
                             "the time")
    parser.add_argument("--json", metavar="PATH", help="write every compiled kernel here")
    args = parser.parse_args(argv)
    if triton is None:
        print("benchmarks/kernel_compile.py needs the triton package (`make test` installs it "
              "on Linux x86_64: pyproject's dev extra)", file=sys.stderr)
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, quietly
    report = {"triton": triton.__version__, "arch": {}}
    sass = args.arch if args.sass_arch is None else args.sass_arch
    for arch in args.arch:
        compiled = compile_all(arch, sass=arch in sass)
        print(_table(arch, compiled))
        report["arch"][str(arch)] = [asdict(c) for c in compiled]
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
