"""The KV shift's native CPU operators: ``csrc/kv_shift.cpp``, compiled on first use.

On the CPU the shift is memory-bound elementwise work on K and V. Written as
torch ops (``shift_kernels``' torch path) it takes ~10 passes over the
``[s, b, g, 2, d]`` block per layer, each paying torch's per-op cost and a trip
through memory (the block is rarely in cache inside a training step), plus a
Python ``autograd.Function``; at the demo's width that was ~6 % of a training
step. The C++ operators do the forward in one pass and the backward in one pass
(``dx``, the coefficient gradient and, for ``shift_qkv``, the query's part of the
QKV gradient), with their autograd node in C++ and torch's own thread pool
(``at::parallel_for``; the blocks' coefficient sums are added in a fixed order,
so results do not depend on the thread count):

* ``torch.ops.kvtrain.shift(x, coef, doc_ids)`` - one tensor ``[s, b, h, d]``;
* ``torch.ops.kvtrain.shift_qkv(mixed, coef_k, coef_v, doc_ids, query_width)`` -
  the query, key and value of megatron's QKV output, K and V shifted.

They are compiled against the installed torch with the system C++ compiler
(``$CXX``, else ``c++``; ~10 s, once) into a per-user cache
(``$KVTRAIN_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/kvtrain/kernels``, else
``~/.cache/kvtrain/kernels``), named by a hash of the source, torch version,
compiler and flags, under a file lock (ranks that start together build once)
and renamed into place atomically. When they cannot be built, the reason is
kept (:func:`unavailable_reason`) and the shift runs on torch ops:
``model.kv_shift.kernel: auto`` says so in the run's backend line, ``native``
stops with the reason. They take float32 and float64 CPU tensors.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

SOURCE = Path(__file__).with_name("csrc") / "kv_shift.cpp"
DTYPES = (torch.float32, torch.float64)


class NativeUnavailable(RuntimeError):
    """The operators could not be built or loaded (the message says why, in one line)."""


def cache_dir() -> Path:
    """Where compiled operators are kept (see the module docstring)."""
    if os.environ.get("KVTRAIN_KERNEL_CACHE"):
        return Path(os.environ["KVTRAIN_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvtrain" / "kernels"


def compile_command(compiler: str, source: Path, output: str) -> list[str]:
    """The compiler call: C++20, OpenMP (torch's thread pool is OpenMP in its CPU
    builds), torch's headers, libraries and C++ ABI."""
    root = Path(torch.__file__).parent
    include, lib = root / "include", root / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [compiler, "-O3", "-std=c++20", "-fPIC", "-shared", "-fopenmp",
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}",
            f"-I{include / 'torch' / 'csrc' / 'api' / 'include'}", str(source), "-o", output,
            f"-L{lib}", "-lc10", "-ltorch_cpu", "-ltorch", f"-Wl,-rpath,{lib}"]


def _compiler_id(compiler: str) -> str:
    """The compiler's path and first line of ``--version`` (part of the cache key)."""
    path = shutil.which(compiler)
    if path is None:
        raise NativeUnavailable(f"no C++ compiler: {compiler!r} not found (set CXX)")
    try:
        version = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"C++ compiler {path} does not run: {e}") from None
    return f"{path} {version[0] if version else ''}"


def build(source: Path = SOURCE, directory: Optional[Path] = None,
          compiler: Optional[str] = None) -> Path:
    """Compiles ``source`` into ``directory`` once (the file is named by a hash of the
    source, torch, compiler and flags) and returns the shared library's path."""
    compiler = compiler or os.environ.get("CXX") or "c++"
    directory = Path(directory) if directory is not None else cache_dir()
    key_parts = [source.read_bytes(), torch.__version__.encode(),
                 _compiler_id(compiler).encode(),
                 " ".join(compile_command(compiler, source, "OUT")).encode()]
    digest = hashlib.sha256(b"\0".join(key_parts)).hexdigest()[:16]
    target = directory / f"kv_shift-{digest}.so"
    if target.exists():
        return target
    try:
        directory.mkdir(parents=True, exist_ok=True)
        lock = open(directory / ".build.lock", "w")
    except OSError as e:
        raise NativeUnavailable(f"cannot write the kernel cache {directory}: "
                                f"{e.strerror or e}") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another rank may be building it: wait
        if not target.exists():
            _compile(compiler, source, target)
    return target


def _compile(compiler: str, source: Path, target: Path) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".kv_shift-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        # its own session: a terminal's Ctrl-C asks the trainer to stop after a step
        # (train.signals), it must not kill the compiler and leave the run on torch ops
        # (an exception here, Ctrl-C's KeyboardInterrupt included, kills it)
        done = subprocess.run(compile_command(compiler, source, tmp), capture_output=True,
                              text=True, timeout=900, start_new_session=True)
        if done.returncode < 0:
            try:
                name = signal.Signals(-done.returncode).name
            except ValueError:  # a signal without a name (a real-time one)
                name = f"signal {-done.returncode}"
            raise NativeUnavailable(f"{compiler} was killed by {name} on {source.name}")
        if done.returncode != 0:
            errors = [line for line in (done.stderr or done.stdout).splitlines()
                      if "error" in line] or (done.stderr or done.stdout).splitlines()
            raise NativeUnavailable(f"{compiler} failed on {source.name}: "
                                    f"{errors[0].strip() if errors else 'no output'}")
        os.replace(tmp, target)  # atomic: a reader sees the whole library or none
    except subprocess.TimeoutExpired:
        raise NativeUnavailable(f"{compiler} took over 900 s on {source.name}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def _load() -> Optional[str]:
    """Builds and loads the operators once per process; None, or why not."""
    if hasattr(torch.ops.kvtrain, "shift_qkv"):  # loaded already (another import path)
        return None
    try:
        torch.ops.load_library(str(build()))
    except NativeUnavailable as e:
        return str(e)
    except OSError as e:
        return f"cannot load the compiled KV-shift operators: {e}"
    return None


def unavailable_reason() -> Optional[str]:
    """None when the operators are usable here (building them on the first call),
    else why not, in one line."""
    return _load()


def ensure() -> None:
    """Loads the operators, or raises NativeUnavailable with the reason."""
    reason = unavailable_reason()
    if reason is not None:
        raise NativeUnavailable(reason)


def supports(x: Tensor) -> bool:
    """Whether the operators take ``x``: a CPU float32/float64 tensor, unit stride in d."""
    return x.device.type == "cpu" and x.dtype in DTYPES and x.stride(-1) == 1


def shift(x: Tensor, coef: Tensor, doc_ids: Optional[Tensor]) -> Tensor:
    """``x [s, b, h, d]`` shifted with ``coef [h, w+1]`` (``shift_tokens``' contract)."""
    ensure()
    return torch.ops.kvtrain.shift(x, coef, _int64(doc_ids))


def shift_qkv(mixed: Tensor, coef_k: Tensor, coef_v: Tensor, doc_ids: Optional[Tensor],
              query_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """(query, shifted key, shifted value) of megatron's QKV output ``mixed``
    (``shift_kernels.fused_shift_qkv``' contract)."""
    ensure()
    return torch.ops.kvtrain.shift_qkv(mixed, coef_k, coef_v, _int64(doc_ids), query_width)


def _int64(doc_ids: Optional[Tensor]) -> Optional[Tensor]:
    return doc_ids if doc_ids is None or doc_ids.dtype == torch.int64 else doc_ids.long()
