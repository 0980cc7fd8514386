"""The Triton shift kernels, run by Triton's interpreter on the CPU.

The kernels (``kvtrain.model.shift_kernels``) are what a GPU run computes the
shift with; on the CPU ``TRITON_INTERPRET=1`` executes the same kernel source
(every program of the grid, with numpy), so their indexing, masks, document
resets and coefficient sums are checked here against ``shift_tokens`` on every
``make test``. What the interpreter cannot check - compilation for a GPU and
speed - is left to the ``gpu`` tests (tests/model/test_fused_shift.py).

The interpreter is chosen when Triton's ``jit`` decorates the kernels, at the
import of ``shift_kernels``, so the check runs in a fresh interpreter process.
"""

from __future__ import annotations

import pytest

from .interpreter import run_interpreted

CHECK = r"""
import json, sys
import torch
from kvtrain.model import shift_kernels
from kvtrain.model.kv_shift import shift_tokens

assert shift_kernels.triton_available(), "triton did not import"
torch.manual_seed(0)


def documents(kind, s, b):  # None, or [s, b] ids: one-token documents, some back to back
    if kind == "none":
        return None
    ids = torch.zeros(s, b, dtype=torch.int64)
    for row, starts in enumerate(([1, 2, 17, 40], [5, 6, s - 1])):
        for t in starts:
            ids[t:, row] += 1
    return ids


results = []
for window in (1, 2, 3):
    for docs in ("none", "starts"):
        # several token blocks per program grid, d not a power of two, strided x
        s, b, h, d = 70, 2, 3, 40
        mixed = torch.randn(s, b, h, 3 * d)
        x = mixed[..., d:2 * d]
        coef = torch.randn(h, window + 1)
        ids = documents(docs, s, b)
        dy = torch.randn(s, b, h, d)
        out = {}
        for name, fn in (("triton", lambda a, c: shift_kernels.fused_shift(a, c, ids, "triton")),
                         ("ref", lambda a, c: shift_tokens(a.double(), c.double(), ids))):
            a, c = x.detach().clone().requires_grad_(), coef.detach().clone().requires_grad_()
            y = fn(a, c)
            da, dc = torch.autograd.grad(y, (a, c), dy.to(y.dtype))
            out[name] = (y.double(), da.double(), dc.double())
        err = [(t - r).abs().max().item() for t, r in zip(out["triton"], out["ref"])]
        results.append({"window": window, "docs": docs, "y": err[0], "dx": err[1],
                        "dcoef": err[2]})
qkv = []
for window in (1, 3):
    for docs in ("none", "starts"):
        for grads in ("all", "no_q"):
            # GQA (3 query heads per group), d not a power of two, a query width
            # that is not a multiple of the block; V's gradient [b, s]-strided (SDPA)
            s, b, g, d = 70, 2, 2, 40
            qw = 3 * d
            mixed = torch.randn(s, b, g, qw + 2 * d)
            coefs = [torch.randn(g, window + 1) for _ in range(2)]
            ids = documents(docs, s, b)
            dys = [torch.randn(s, b, g, qw), torch.randn(s, b, g, d),
                   torch.randn(b, s, g, d).transpose(0, 1)]
            used = [1, 2] if grads == "no_q" else [0, 1, 2]
            out = {}
            for name, dtype in (("triton", torch.float32), ("ref", torch.float64)):
                m = mixed.to(dtype).requires_grad_()
                cs = [c.to(dtype).requires_grad_() for c in coefs]
                if name == "triton":
                    ys = shift_kernels.fused_shift_qkv(m, *cs, ids, qw, impl="triton")
                else:
                    q, k, v = m.split([qw, d, d], dim=-1)
                    ys = (q, shift_tokens(k, cs[0], ids), shift_tokens(v, cs[1], ids))
                gr = torch.autograd.grad([ys[i] for i in used], (m, *cs),
                                         [dys[i].to(dtype) for i in used])
                out[name] = [y.double() for y in (*ys, *gr)]
            err = [(t - r).abs().max().item() for t, r in zip(out["triton"], out["ref"])]
            qkv.append({"window": window, "docs": docs, "grads": grads, "q": err[0],
                        "k": err[1], "v": err[2], "dmixed": err[3], "dcoef": max(err[4:])})

# Fixed coefficients (no gradient): no raw copy written or read, the QKV gradient alone.
fixed = torch.tensor([[0.25, 0.75], [0.5, 0.5]])
m = mixed.clone().requires_grad_()
ys = shift_kernels.fused_shift_qkv(m, fixed, fixed, None, qw, impl="triton")
got = torch.autograd.grad(ys, m, dys)[0]
m64 = mixed.double().requires_grad_()
q, k, v = m64.split([qw, d, d], dim=-1)
ys64 = (q, shift_tokens(k, fixed.double(), None), shift_tokens(v, fixed.double(), None))
want = torch.autograd.grad(ys64, m64, [g.double() for g in dys])[0]
fixed_err = (got.double() - want).abs().max().item()
# ... and per tensor (MLA, one-tensor variants): x not kept, dx alone
x = mixed[..., qw:qw + d].clone().requires_grad_()
got = torch.autograd.grad(shift_kernels.fused_shift(x, fixed, None, "triton"), x, dys[1])[0]
x64 = x.detach().double().requires_grad_()
want = torch.autograd.grad(shift_tokens(x64, fixed.double(), None), x64, dys[1].double())[0]
fixed_err = max(fixed_err, (got.double() - want).abs().max().item())

# The layer as a GPU run builds it (K and V shifted in the QKV output by the Triton
# node, then RoPE and SDPA), against the torch-ops kernel: a packed two-document
# batch, logits and every gradient.
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from tests.model.interpreter import autograd_nodes

init_distributed(seed=1)
init_model_parallel(1, 1)
tokens = torch.randint(0, 64, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
mask = ~torch.ones(24, 24, dtype=torch.bool).tril()[None, None]
mask[..., 9:, :9] = True
runs = {}
for kernel in ("triton", "torch"):
    set_seed(7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, max_position_embeddings=32, attention="kv_shift",
                      kv_shift=KVShiftConfig(kernel=kernel))
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    out = model(tokens, pos, mask)
    out.float().pow(2).mean().backward()
    nodes = autograd_nodes(out)
    runs[kernel] = (out.detach(), {n: p.grad for n, p in model.named_parameters()}, nodes)
(out_t, grads_t, nodes_t), (out_r, grads_r, _) = runs["triton"], runs["torch"]
layer = {"qkv_node": any("QKVShift" in n for n in nodes_t),
         "logits": (out_t - out_r).abs().max().item(),
         # relative to each gradient's size (at init some are ~1e-7)
         "grads": max(((grads_t[n] - g).abs().max() / g.abs().max()).item()
                      for n, g in grads_r.items()),
         "shift_grads": sorted(n for n in grads_t if "shift" in n)}
print(json.dumps({"shift": results, "qkv": qkv, "fixed": fixed_err, "layer": layer}))
"""


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


def test_triton_kernels_match_shift_tokens(interpreted):
    """Values, input and coefficient gradients, windows 1-3, with and without
    document resets: fp32 kernels against the fp64 reference."""
    assert len(interpreted["shift"]) == 6
    for r in interpreted["shift"]:
        assert r["y"] < 1e-5 and r["dx"] < 1e-5, r
        assert r["dcoef"] < 1e-3, r  # sums of s*b*d = 5600 fp32 products per lag


def test_triton_qkv_kernels_match_shift_tokens(interpreted):
    """Q, K and V from the QKV output (GQA): values, the QKV output's gradient (the
    query's copied in, zeros where Q had none) and the coefficients'."""
    assert len(interpreted["qkv"]) == 8
    for r in interpreted["qkv"]:
        assert r["q"] == 0 and r["k"] < 1e-5 and r["v"] < 1e-5 and r["dmixed"] < 1e-5, r
        assert r["dcoef"] < 1e-3, r
    assert interpreted["fixed"] < 1e-5  # fixed coefficients: no raw copy, no partial sums


def test_triton_layer_matches_the_torch_kernel(interpreted):
    """The whole model with the Triton Q/K/V node in its layers (what ``auto`` takes on
    a GPU): logits and every gradient, the coefficients' included, equal the torch-ops
    kernel's on a packed two-document batch."""
    layer = interpreted["layer"]
    assert layer["qkv_node"], "the layers did not shift K and V in the QKV output"
    assert layer["shift_grads"], "no KV-shift coefficient has a gradient"
    assert layer["logits"] < 1e-5 and layer["grads"] < 1e-4, layer


PROBE = ("import json, os, triton\n"
         "print(json.dumps({'probe': os.environ.get('KVTRAIN_CHECK_PROBE'), 'pid': os.getpid(),\n"
         "                  'interpret': triton.knobs.runtime.interpret}))\n")


def test_each_check_runs_in_a_child_of_its_own_with_the_calls_environment(monkeypatch):
    """The harness itself: a check forked from the interpreter server sees the
    environment of the call (not the server's), runs with the interpreter on, in a
    process of its own each time; a check that raises fails with its traceback."""
    monkeypatch.setenv("KVTRAIN_CHECK_PROBE", "first")
    first = run_interpreted(PROBE)
    monkeypatch.setenv("KVTRAIN_CHECK_PROBE", "second")
    second = run_interpreted(PROBE)
    assert (first["probe"], second["probe"]) == ("first", "second")
    assert first["interpret"] and second["interpret"] and first["pid"] != second["pid"]
    with pytest.raises(AssertionError, match="ValueError: the check failed"):
        run_interpreted("raise ValueError('the check failed')")
