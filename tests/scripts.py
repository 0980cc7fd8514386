"""Scripts of the repository (``benchmarks/``: no package): loaded as modules by tests, and the
environment a test runs one in (:func:`script_env`)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Iterator

from .forkserver import REPO


def load_script(path: Path, name: str):
    """The script at ``path`` as the module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up there)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# A rendezvous the pytest process may hold (tests that build a run in-process): left
# out of the environment of every process a test starts.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                   "MASTER_PORT", "GROUP_RANK")


def without_rendezvous() -> dict:
    """This process's environment less :data:`RENDEZVOUS_VARS`."""
    return {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}


def python_path() -> str:
    """PYTHONPATH for a script of the repository: the repository first, then the
    caller's entries (on the lent GPU machine megatron-core is installed there)."""
    return os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])


def script_env(**extra: str) -> dict:
    """The environment of a one-process script run as a user runs it: this one less a
    rendezvous pytest may hold, one thread, :func:`python_path`; then ``extra``."""
    env = without_rendezvous()
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=python_path(), **extra)
    return env


@contextlib.contextmanager
def a_taken_port_first(monkeypatch, module) -> Iterator[None]:
    """``module.free_port`` gives, once, a port another socket listens on, then free
    ones: the race of a port taken between finding it free and binding it, made sure."""
    busy = socket.socket()
    busy.bind(("0.0.0.0", 0))
    busy.listen()
    ports = [busy.getsockname()[1]]
    real = module.free_port
    monkeypatch.setattr(module, "free_port", lambda: ports.pop() if ports else real())
    try:
        yield
    finally:
        busy.close()
