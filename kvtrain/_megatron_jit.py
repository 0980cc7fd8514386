"""megatron-core's ``torch.compile`` decorations, applied at a function's first call.

megatron-core 0.16.1 decorates ~45 fused functions with ``megatron.core.jit.jit_fuser``,
which is ``torch.compile``, as its modules are imported. Applying ``torch.compile``
imports dynamo and inductor: 3–5 s of CPU in every process that imports megatron
(each `kvtrain` command, each rank), before anything is compiled. Compiling happens
at a function's first call either way; kvtrain makes ``jit_fuser`` defer the
decoration to that call too, so a process that never calls a fused function (a CPU
run: kvtrain enables none of megatron's fusions there) never imports the compiler.

Stdlib only: ``kvtrain/__init__`` installs it before anything imports megatron.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

_JIT = "megatron.core.jit"


def deferred_compile(fn):
    """``torch.compile(fn)``, made on the first call."""
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            import torch

            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def _defer(jit_module) -> None:
    import torch

    if jit_module.jit_fuser is torch.compile:  # not when megatron chose no fuser
        jit_module.jit_fuser = deferred_compile


class _JitLoader(importlib.abc.Loader):
    """megatron.core.jit's own loader, then ``jit_fuser`` replaced before any module
    that decorates with it has read it."""

    def __init__(self, inner):
        self.inner = inner

    def create_module(self, spec):
        return self.inner.create_module(spec)

    def exec_module(self, module):
        self.inner.exec_module(module)
        _defer(module)

    def __getattr__(self, name):  # get_source, get_filename, ... for tracebacks
        return getattr(self.inner, name)


class _JitFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _JIT:
            return None
        sys.meta_path.remove(self)  # once
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _JitLoader(spec.loader)
        return spec


def install() -> None:
    """Defers megatron's decorations in this process (idempotent)."""
    if _JIT in sys.modules:  # megatron imported first: the decorations still to come
        _defer(sys.modules[_JIT])
    elif not any(isinstance(f, _JitFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _JitFinder())
