"""megatron's ``torch.compile`` decorations deferred to a function's first call
(``kvtrain._megatron_jit``): a process that imports megatron through kvtrain does not
import dynamo and inductor (3-5 s of CPU) until it calls a fused function."""

from __future__ import annotations

import subprocess
import sys
import types

import torch

from kvtrain import _megatron_jit
from kvtrain._megatron_jit import deferred_compile


def test_importing_the_trainer_imports_no_compiler():
    code = ("import sys, kvtrain.train.loop, megatron.core.jit as jit\n"
            "from megatron.core.fusions.fused_bias_swiglu import swiglu\n"
            "print(jit.jit_fuser.__name__, 'torch._dynamo' in sys.modules,"
            " 'torch._inductor' in sys.modules, swiglu.__wrapped__.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["deferred_compile", "False", "False", "swiglu"]


def test_a_deferred_function_is_compiled_once_at_its_first_call(monkeypatch):
    compiled = []

    def fake_compile(fn):
        compiled.append(fn)
        return lambda *a, **k: ("compiled", fn(*a, **k))

    def double(x, scale=2):
        return x * scale

    monkeypatch.setattr(torch, "compile", fake_compile)
    call = deferred_compile(double)
    assert compiled == [] and call.__wrapped__ is double and call.__name__ == "double"
    assert call(3) == ("compiled", 6) and call(3, scale=5) == ("compiled", 15)
    assert compiled == [double]


def test_megatron_imported_before_kvtrain_defers_what_it_decorates_next(monkeypatch):
    jit = types.SimpleNamespace(jit_fuser=torch.compile)
    monkeypatch.setitem(sys.modules, "megatron.core.jit", jit)
    _megatron_jit.install()
    assert jit.jit_fuser is deferred_compile
    # megatron chose no fuser (megatron.core.jit.disable_jit_fuser): left alone
    noop = types.SimpleNamespace(jit_fuser=lambda fn: fn)
    fuser = noop.jit_fuser
    monkeypatch.setitem(sys.modules, "megatron.core.jit", noop)
    _megatron_jit.install()
    assert noop.jit_fuser is fuser
