"""Runs a check script in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``).

The interpreter is chosen when ``triton.jit`` decorates a kernel, at the import of
its module, so a check runs in a process of its own; it prints its results as one
JSON line last. Used by the tests of kvtrain's Triton kernels (the shift's, RoPE's).

Each check runs in a child forked from a server that has imported torch, megatron
and kvtrain's kernels with the interpreter on (one server per pytest process): the
checks of eight test files paid those imports (~8 s of CPU) eight times. The child
takes the environment and working directory of the call, like a fresh process.
"""

from __future__ import annotations

import json
import platform
import sys

import pytest

from ..forkserver import REPO, ForkServer, NoExitCode
from ..scripts import without_rendezvous

TIMEOUT = 600  # seconds a check may take

_SERVER = ForkServer(  # the server's imports: the kernels' modules, interpreted
    "import kvtrain\n"  # first, as in every kvtrain process: megatron's torch.compile
    "import kvtrain.model.builder, triton\n"  # decorations wait for a first call
    "from tests.model.interpreter import patch_language_once\n"
    "patch_language_once()\n")


def patch_language_once() -> None:
    """Triton's interpreter patches ``triton.language`` for the interpreter (each
    builtin wrapped, found by ``inspect.getmembers`` of the modules a function sees) at
    every kernel launch, which undoes it at its end, and again at every call of a
    ``@triton.jit`` helper inside the launch, which does not undo it. Once the modules a
    helper sees were patched in the running launch, its patching changes nothing (a
    patched builtin is no builtin to patch again; the rest is set to the same again),
    and it took most of the interpreted checks' time (Triton 3.9: ~115k ``getmembers``
    in test_qkv_rope's check). Here such a helper call skips it; launches, and the first
    helper in a launch to see another module, patch as before."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter

    executor = interpreter.GridExecutor
    if getattr(executor.__call__, "patches_once", False):
        return
    launches = []  # per running launch: the modules patched in it so far
    seen: dict = {}  # (function, size of its module): the language modules it sees
    patch_lang, launch = interpreter._patch_lang, executor.__call__

    def modules(fn) -> frozenset:
        # looked at again when the module gains a name (the interpreter's rewrite of a
        # function runs in its module and can bind triton.language there)
        key = (fn, len(fn.__globals__))
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if inspect.ismodule(v) and v in (tl, tl.core))
        return seen[key]

    def patch(fn):
        if launches and launches[-1] is not None and modules(fn) <= launches[-1]:
            return interpreter._LangPatchScope()  # patched in this launch already
        scope = patch_lang(fn)
        if launches:  # the launch's own patching, or a helper's that saw other modules
            launches[-1] = modules(fn) | (launches[-1] or frozenset())
        return scope

    def launch_patching_once(self, *args, **kwargs):
        launches.append(None)
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    launch_patching_once.patches_once = True
    interpreter._patch_lang = patch
    executor.__call__ = launch_patching_once


def _environment() -> dict:
    # a one-process group of its own: not the address of the one pytest may hold
    env = without_rendezvous()
    env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    return env


def run_interpreted(check: str) -> dict:
    """The JSON results of ``check`` run with ``TRITON_INTERPRET=1`` in a process of
    its own (forked from the interpreter server)."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        pytest.skip("the dev extra installs Triton on Linux x86_64 only")
    try:
        import triton  # noqa: F401
    except ImportError:
        pytest.fail("triton is not installed: `make test` installs it (pyproject's dev extra) "
                    "so that kvtrain's Triton kernels are checked on the CPU")
    try:
        done = _SERVER.run(check, _environment(), timeout=TIMEOUT)
    except NoExitCode as e:
        pytest.fail(f"the interpreted check gave no result: {e}")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def autograd_nodes(out) -> list[str]:
    """The names of every node in ``out``'s backward graph (for a check script: which
    kernels a model's layers ran)."""
    names, stack, seen = [], [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.append(fn.name())
        stack.extend(f for f, _ in fn.next_functions)
    return names
