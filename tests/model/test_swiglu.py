"""kvtrain's SwiGLU (``kvtrain.model.swiglu``): megatron's eager SwiGLU bit for bit,
keeping only fc1's output for backward (3f per token in the MLP, not 5f); its
Triton kernels (``model.swiglu_kernel: triton``) in Triton's interpreter against
fp64, and whole models on them against the torch ops; which kernel a run takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvtrain.config import ConfigError
from kvtrain.model.swiglu import SwiGLUFunction, choose_swiglu

from .interpreter import REPO, run_interpreted

CHECK = r'''
import json, torch
import torch.nn.functional as F
from kvtrain.model import triton_swiglu
from kvtrain.model.swiglu import SwiGLUFunction

gen = torch.Generator().manual_seed(0)
out = {"cases": [], "models": {}}


def reference(x, grad):
    """fp64 output and input gradient of silu(gate) * linear."""
    x = x.double().requires_grad_()
    gate, linear = x.chunk(2, dim=-1)
    y = F.silu(gate) * linear
    y.backward(grad.double())
    return y.detach(), x.grad


# (rows, f, dtype, layout): a part block, 2 blocks of 1024 with a masked tail, rows
# with a stride past 2f, a gradient strided by the layout attention leaves
for rows, f, dtype, layout in [((7, 2), 40, torch.float32, "contiguous"),
                               ((3, 1), 1500, torch.float32, "contiguous"),
                               ((4, 3), 24, torch.float32, "strided rows"),
                               ((5, 2), 96, torch.float32, "strided gradient"),
                               ((9, 2), 1100, torch.bfloat16, "contiguous"),
                               ((6, 1), 80, torch.float16, "contiguous")]:
    n = rows[0] * rows[1]
    x = 3 * torch.randn(*rows, 2 * f + (8 if layout == "strided rows" else 0), generator=gen)
    x = x[..., :2 * f].to(dtype)
    grad = torch.randn(*rows, f, generator=gen)
    if layout == "strided gradient":
        grad = torch.randn(f, *rows, generator=gen).permute(1, 2, 0)
    grad = grad.to(dtype)
    ref_y, ref_dx = reference(x, grad)
    errs = {}
    for name, fused in (("fused", True), ("eager", False)):
        leaf = x.detach().clone().requires_grad_()
        y = SwiGLUFunction.apply(leaf, fused)
        y.backward(grad)
        errs[name] = {"y": (y.double() - ref_y).abs(), "dx": (leaf.grad.double() - ref_dx).abs(),
                      "dtype": [str(y.dtype), str(leaf.grad.dtype)]}
    fused, eager = errs["fused"], errs["eager"]
    case = {"f": f, "dtype": str(dtype), "layout": layout, "dtypes": fused["dtype"],
            "x_strided": x.stride(-2) != 2 * f, "grad_contiguous": grad.is_contiguous()}
    for part, ref in (("y", ref_y), ("dx", ref_dx)):
        case[part] = {"fused": fused[part].max().item(), "eager": eager[part].max().item(),
                      "scale": ref.abs().max().item(),
                      # worst error over the rounding of each value: <= 1/2 ulp of it
                      "ulps": (fused[part] / (ref.abs() * torch.finfo(dtype).eps + 1e-30
                                              + 1e-6 * ref.abs().max())).max().item()}
    out["cases"].append(case)

# the checks of the wrappers
out["refusals"] = {}
for name, call in (("odd", lambda: triton_swiglu.forward(torch.randn(3, 7))),
                   ("grad", lambda: triton_swiglu.backward(torch.randn(3, 8), torch.randn(3, 3)))):
    try:
        call()
        out["refusals"][name] = None
    except ValueError as e:
        out["refusals"][name] = str(e)
empty = torch.randn(0, 2, 16, requires_grad=True)
y = SwiGLUFunction.apply(empty, True)
y.backward(torch.ones_like(y))
out["empty"] = [list(y.shape), list(empty.grad.shape)]

# whole models: the kernel in every layer's MLP against the torch ops (fp32)
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig
from kvtrain.model.builder import build_gpt, transformer_config

init_distributed(seed=1)
init_model_parallel(1, 1)
calls = []
forward, backward = triton_swiglu.forward, triton_swiglu.backward
triton_swiglu.forward = lambda *a: calls.append("forward") or forward(*a)
triton_swiglu.backward = lambda *a: calls.append("backward") or backward(*a)
tokens = torch.randint(0, 100, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
for attention in ("vanilla", "kv_shift"):
    for backend in ("torch", "local"):
        runs = {}
        for kernel in ("triton", "torch"):
            set_seed(7)
            calls.clear()
            cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                              num_query_groups=2, ffn_hidden_size=88, vocab_size=100,
                              max_position_embeddings=32, attention=attention)
            model = build_gpt(cfg, transformer_config(cfg), backend=backend, swiglu=kernel)
            logits = model(tokens, pos, None)
            logits.pow(2).mean().backward()
            runs[kernel] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()},
                            sorted(calls))
        (l_f, g_f, c_f), (l_r, g_r, c_r) = runs["triton"], runs["torch"]
        out["models"][f"{attention} {backend}"] = {
            "logits": ((l_f - l_r).abs().max() / l_r.abs().max()).item(),
            "grads": max(((g_f[n] - g).abs().max() / g.abs().max()).item()
                         for n, g in g_r.items()),
            "calls": [c_f, c_r]}
print(json.dumps(out))
'''


def _megatron_glu(x: torch.Tensor) -> torch.Tensor:
    """megatron's MLP without bias_activation_fusion (glu_linear_offset 0.0)."""
    x_glu, x_linear = torch.chunk(x, 2, dim=-1)
    return F.silu(x_glu) * (x_linear + 0.0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_values_and_gradients_are_megatrons_bit_for_bit(dtype, device):
    gen = torch.Generator().manual_seed(0)
    x = (3 * torch.randn(16, 3, 2 * 40, generator=gen)).to(device, dtype)
    grad = torch.randn(16, 3, 40, generator=gen).to(device, dtype)
    outs, grads = [], []
    for fn in (SwiGLUFunction.apply, _megatron_glu):
        leaf = x.clone().requires_grad_()
        out = fn(leaf)
        out.backward(grad)
        outs.append(out)
        grads.append(leaf.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


def _kept_bytes(fn, *inputs) -> dict[int, int]:
    kept: dict[int, int] = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return kept


def test_an_mlp_keeps_its_input_fc1s_output_and_fc2s_input(mp1):
    """h + 2f + f elements per token (megatron's eager SwiGLU: h + 5f)."""
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import build_gpt, transformer_config

    cfg = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96,
                      vocab_size=128, make_vocab_size_divisible_by=64,
                      max_position_embeddings=32)
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    mlp = model.decoder.layers[0].mlp
    params = {p.untyped_storage().data_ptr() for p in mlp.parameters()}
    tokens = 32 * 2
    hidden = torch.randn(32, 2, 64, requires_grad=True)
    kept = _kept_bytes(mlp, hidden)
    activations = sum(n for ptr, n in kept.items() if ptr not in params)
    assert activations == 4 * tokens * (64 + 2 * 96 + 96)


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


def test_the_kernels_round_once_against_fp64(interpreted):
    """Forward and backward in fp32, each value rounded once to the tensor's dtype:
    fp32 within 1e-6 of scale (as the torch ops), fp16 within half an ulp of each
    value (the torch ops round ``silu(gate)`` and each product first, and land
    further off), bf16 within one ulp (Triton's interpreter truncates fp32 to bf16
    where a GPU rounds to nearest: the ``gpu`` test). Shapes: part of a block, two
    blocks with a masked tail, rows strided past 2f, a gradient laid out as
    attention's."""
    cases = interpreted["cases"]
    assert [c["layout"] for c in cases].count("strided rows") == 1
    assert [c["x_strided"] for c in cases] == [False, False, True, False, False, False]
    assert [c["grad_contiguous"] for c in cases] == [True, True, True, False, True, True]
    for c in cases:
        assert c["dtypes"] == [c["dtype"]] * 2, c
        for part in ("y", "dx"):
            m = c[part]
            if c["dtype"] == "torch.float32":
                assert m["fused"] <= 1e-6 * m["scale"], (c, part)  # measured <= 3e-7
            elif c["dtype"] == "torch.bfloat16":
                assert m["ulps"] < 1, (c, part)
            else:
                assert m["ulps"] <= 0.5 + 1e-3 and m["fused"] <= m["eager"], (c, part)


def test_the_wrappers_refuse_what_the_kernels_cannot_take(interpreted):
    r = interpreted["refusals"]
    assert r["odd"] == "SwiGLU's input has an even last dim [gate | linear], got 7"
    assert r["grad"] == ("expected a gradient (3, 4) for SwiGLU's input (3, 8), "
                         "got (3, 3)")
    assert interpreted["empty"] == [[0, 2, 8], [0, 2, 16]]


@pytest.mark.parametrize("name", ["vanilla torch", "kv_shift torch", "vanilla local",
                                  "kv_shift local"])
def test_models_on_the_kernels_match_the_torch_ops(interpreted, name):
    """Every layer's MLP runs the kernels (2 layers: 2 forward and 2 backward launches,
    none with the torch ops), and the logits and every gradient equal the torch
    ops' (fp32), on the torch and local backends, vanilla and KV shift."""
    m = interpreted["models"][name]
    assert m["calls"] == [["backward"] * 2 + ["forward"] * 2, []], m
    assert m["logits"] < 1e-6 and m["grads"] < 1e-5, m


@pytest.mark.parametrize("requested, backend, cuda, dtype, want", [
    ("auto", "torch", False, torch.float32, ("torch", "auto: no GPU")),
    ("auto", "torch", True, torch.bfloat16, ("triton", "auto: GPU")),
    ("auto", "te", True, torch.bfloat16, ("triton", "auto: GPU")),
    ("auto", "local", True, torch.bfloat16,
     ("torch", "auto: the local backend keeps the torch ops")),
    ("auto", "torch", True, torch.float64,
     ("torch", "auto: the Triton kernels compute in fp32, not fp64")),
    ("torch", "torch", True, torch.bfloat16, ("torch", "model.swiglu_kernel: torch")),
    ("triton", "local", True, torch.float32, ("triton", "model.swiglu_kernel: triton")),
    # asked for, the kernels take fp64 too (in fp32, as the config key says)
    ("triton", "torch", True, torch.float64, ("triton", "model.swiglu_kernel: triton")),
])
def test_choice(requested, backend, cuda, dtype, want):
    assert choose_swiglu(requested, backend, cuda, dtype) == want


@pytest.mark.parametrize("requested, message", [
    ("triton", "model.swiglu_kernel: triton needs a GPU (use auto or torch on the CPU)"),
    ("fast", "model.swiglu_kernel must be auto, triton or torch, got 'fast'"),
])
def test_what_cannot_run_is_refused_in_one_line(requested, message):
    with pytest.raises(ConfigError) as e:
        choose_swiglu(requested, "torch", False, torch.float32)
    assert str(e.value) == message


def test_triton_missing_falls_back_or_is_refused(monkeypatch):
    from kvtrain.model import triton_swiglu

    monkeypatch.setattr(triton_swiglu, "triton", None)
    assert choose_swiglu("auto", "torch", True, torch.bfloat16) == (
        "torch", "auto: Triton is not installed")
    with pytest.raises(ConfigError, match="^model.swiglu_kernel: triton, but Triton is not "
                                          "installed \\(use torch\\)$"):
        choose_swiglu("triton", "torch", True, torch.bfloat16)


def test_a_run_records_its_swiglu_kernel(single_rank, tmp_path, monkeypatch):
    """What a run on this machine prints, records and builds: the torch ops; and what a
    GPU run on the torch backend resolves (a GPU stood in for): the kernel."""
    from kvtrain.config import load_config
    from kvtrain.model.builder import Numerics
    from kvtrain.train import setup

    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"), [
        "data.type=mock", "train.max_steps=1"])
    run = setup.build_run(cfg, tmp_path)
    assert run.backend.swiglu == "torch (auto: no GPU)"
    assert "; SwiGLU: torch (auto: no GPU)" in run.backend.describe()
    assert run.backend.as_dict()["swiglu"] == "torch (auto: no GPU)"
    assert not run.model[0].module.decoder.layers[0].mlp.activation_func.fused
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    backend, kernels = setup._resolve_backend(cfg, Numerics.from_precision("bf16"))
    assert backend.swiglu == "triton (auto: GPU)" and kernels.swiglu == "triton"


@pytest.mark.gpu
def test_a_gpu_model_on_the_compiled_kernels_matches_the_torch_ops(single_rank):
    """On a GPU: fp32 and bf16 models with the compiled kernels against the torch ops,
    logits and every gradient within each dtype's rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.transformer.module import Float16Module

    from kvtrain.backend import set_seed
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config

    assert choose_swiglu("auto", "torch", True, torch.bfloat16)[0] == "triton"
    tokens = torch.randint(0, 256, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda")[None].expand_as(tokens)
    for numerics, tol in ((Numerics(), 1e-4), (Numerics.from_precision("bf16"), 5e-2)):
        runs = {}
        for kernel in ("triton", "torch"):
            set_seed(3)
            cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                              num_query_groups=4, ffn_hidden_size=688, vocab_size=256,
                              max_position_embeddings=128, attention="kv_shift")
            tc = transformer_config(cfg, numerics=numerics)
            model = build_gpt(cfg, tc, backend="torch", swiglu=kernel).cuda()
            if numerics.bf16:
                model = Float16Module(tc, model)
            out = model(tokens, pos, None).float()
            out.pow(2).mean().backward()
            runs[kernel] = (out.detach(), {n: p.grad.float() for n, p in model.named_parameters()})
        (out_f, g_f), (out_r, g_r) = runs["triton"], runs["torch"]
        assert (out_f - out_r).abs().max() <= tol * out_r.abs().max(), numerics
        for name, g in g_r.items():
            assert (g_f[name] - g).abs().max() <= tol * g.abs().max(), (name, numerics)


@pytest.mark.gpu
def test_the_compiled_kernels_round_bf16_to_nearest_once():
    """On a GPU the kernels round each bf16 value to nearest once: within half an ulp
    of fp64, no further off than the torch ops (paper's width, f = 5504)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(256, 2, 2 * 5504, device="cuda", generator=gen)).bfloat16()
    grad = torch.randn(256, 2, 5504, device="cuda", generator=gen).bfloat16()
    ref = x.double().requires_grad_()
    gate, linear = ref.chunk(2, dim=-1)
    y_ref = F.silu(gate) * linear
    y_ref.backward(grad.double())
    for part_ref, fused_eager in ((y_ref.detach(), 0), (ref.grad, 1)):
        got = []
        for fused in (True, False):
            leaf = x.clone().requires_grad_()
            y = SwiGLUFunction.apply(leaf, fused)
            y.backward(grad)
            got.append((y, leaf.grad)[fused_eager].double())
        err_f, err_e = ((g - part_ref).abs() for g in got)
        eps = torch.finfo(torch.bfloat16).eps
        ulps = err_f / (part_ref.abs() * eps + 1e-6 * part_ref.abs().max())
        assert ulps.max() <= 0.5 + 1e-3 and err_f.max() <= err_e.max()


def test_the_benchmark_refuses_a_cpu_in_one_line():
    """benchmarks/swiglu.py times the compiled kernels: a GPU only."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "swiglu.py")], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().count("\n") == 0 and "needs a GPU" in done.stdout


@pytest.mark.gpu
def test_the_benchmark_runs_on_a_gpu(tmp_path):
    """benchmarks/swiglu.py on a small shape: both timed, the kernels allocating no
    more above their input than the torch ops."""
    import json
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "swiglu.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "swiglu.py"), "--tokens",
                           "512", "--ffn", "1024", "--rounds", "3", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    peak = r["peak_bytes_above_input"]
    assert peak["triton"] <= peak["torch"] and r["ms"]["triton"] > 0, r
