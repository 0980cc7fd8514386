"""megatron's dataset index caches, never left torn.

megatron writes a dataset's indices into ``data.cache_dir`` as a set of files
named ``<hash>-<Class>-<split>-<what>``: ``description.txt`` first, then each
``.npy`` (``numpy.save``, in place), and takes a set whose files all exist for
a cache hit. A write cut short (a full disk, a quota, a kill) left a short
``.npy``: the build failed with pages of megatron's tracebacks ("Failed to
write dataset materials ..."), and every later start that found the set
complete failed to map the short file, until someone deleted the cache.

``built_whole`` wraps a build on the rank that writes (rank 0, as megatron's
builder has it): under a lock on the cache folder (another run sharing it may
be writing its own sets), a set holding a short or unreadable ``.npy`` is
removed first, so megatron builds it again; a build that fails on an OS error
removes what it had written and says so in one line.
"""

from __future__ import annotations

import fcntl
import math
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import numpy

from kvtrain.config import ConfigError

LOCK = ".kvtrain-index.lock"
_SET = re.compile(r"^(?P<base>[0-9a-f]{32}-\w+-(?:train|valid|test))-\w+\.(?:npy|txt)$")


class IndexCacheError(ConfigError):
    """The index caches could not be written (a full disk, a quota)."""

    kind = "data error"


def npy_problem(path: Path) -> Optional[str]:
    """Why the ``.npy`` file ``path`` cannot be mapped whole (None: it can): its
    header read, its size against the header's shape and dtype."""
    fmt = numpy.lib.format
    try:
        with open(path, "rb") as f:
            reader = {(1, 0): fmt.read_array_header_1_0,
                      (2, 0): fmt.read_array_header_2_0}.get(fmt.read_magic(f))
            if reader is None:  # a version this does not read: megatron's to judge
                return None
            shape, _, dtype = reader(f)
            expected = f.tell() + math.prod(shape) * dtype.itemsize
            size = os.fstat(f.fileno()).st_size
    except (OSError, ValueError, EOFError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if dtype.hasobject or size == expected:
        return None
    return f"{size} bytes, its header asks for {expected}"


def torn_sets(cache_dir: Path) -> dict[str, str]:
    """The index sets of ``cache_dir`` holding a short or unreadable ``.npy``: base
    name -> why."""
    torn: dict[str, str] = {}
    for path in sorted(cache_dir.iterdir()) if cache_dir.is_dir() else ():
        match = _SET.match(path.name)
        if match and path.suffix == ".npy" and match["base"] not in torn:
            if (why := npy_problem(path)) is not None:
                torn[match["base"]] = f"{path.name}: {why}"
    return torn


def _files(cache_dir: Path) -> dict[str, int]:
    """The index files of ``cache_dir``: name -> mtime (ns)."""
    out = {}
    for path in cache_dir.iterdir() if cache_dir.is_dir() else ():
        if _SET.match(path.name):
            try:
                out[path.name] = path.stat().st_mtime_ns
            except FileNotFoundError:
                pass
    return out


def _os_error(e: BaseException) -> Optional[OSError]:
    """The OSError that ``e`` stands for (megatron wraps it in Exceptions of its own)."""
    while e is not None:
        if isinstance(e, OSError):
            return e
        e = e.__cause__ or e.__context__
    return None


@contextmanager
def _locked(cache_dir: Path) -> Iterator[bool]:
    """Holds the cache folder's lock inside; False: the folder takes no file (a
    read-only cache, a team's, built once: megatron only reads it)."""
    try:
        fd = os.open(cache_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"kvtrain: data: waiting for another run's index build in {cache_dir}",
                  flush=True)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)  # the lock goes with it


@contextmanager
def built_whole(cache_dir: Optional[str], writes: bool) -> Iterator[None]:
    """Around a megatron builder's ``build()``; ``writes``: this rank writes the
    caches (rank 0). See the module's docstring."""
    if not cache_dir or not writes:  # "": built in memory (kvtrain perplexity's)
        yield
        return
    folder = Path(cache_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder) as writable:
        for base, why in torn_sets(folder).items() if writable else ():
            for path in folder.glob(f"{base}-*"):
                path.unlink(missing_ok=True)
            print(f"kvtrain: data: dropped the damaged index cache {base} in {folder} ({why}: "
                  "a write cut short); it is built again", flush=True)
        before = _files(folder)
        try:
            yield
        except Exception as e:  # noqa: BLE001 - megatron's own wrap an OSError
            error = _os_error(e)
            if error is None:
                raise
            for name, mtime in _files(folder).items():
                if before.get(name) != mtime:  # written by this build: cut short or not
                    (folder / name).unlink(missing_ok=True)
            raise IndexCacheError(
                f"data.cache_dir: writing the dataset indices in {folder} failed: "
                f"{error.strerror or error}; what the build had written there is removed "
                "(free space, or set data.cache_dir to a folder with room)") from None


__all__ = ["IndexCacheError", "built_whole", "npy_problem", "torn_sets"]
