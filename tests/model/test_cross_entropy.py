"""kvtrain's fused vocab-parallel cross-entropy (``kvtrain.model.cross_entropy``,
``model.cross_entropy_kernel``).

The Triton kernels run in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``,
a process of its own): losses and gradients against the loss in fp64, shards of a
TP group over 2 gloo ranks, whole models against megatron's loss, and what the
node keeps. Compilation for a GPU and speed are the ``gpu`` tests' part.
"""

from __future__ import annotations

import pytest
import torch

from kvtrain.config import ConfigError
from kvtrain.model.cross_entropy import choose_cross_entropy

from ..scripts import script_env
from .interpreter import REPO, run_interpreted

CHECK = r'''
import json, torch
from kvtrain.model.cross_entropy import FusedCrossEntropy, vocab_parallel_cross_entropy
from kvtrain.testing import run_distributed
from tests.model.test_cross_entropy import reference, tp_rank

from megatron.core import tensor_parallel
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
init_distributed(seed=1)
init_model_parallel(1, 1)

torch.manual_seed(0)
out = {"cases": [], "tp": [], "models": {}}
# (tokens, batch, vocabulary, dtype, layout): one block, a part block, 3 blocks of 4096
for n, b, v, dtype, layout in [(7, 1, 37, torch.float32, "contiguous"),
                               (5, 2, 4500, torch.float32, "batch first"),
                               (6, 1, 2 * 4096 + 5, torch.float32, "contiguous"),
                               (4, 3, 70, torch.float32, "vocabulary strided"),
                               (9, 1, 300, torch.bfloat16, "contiguous")]:
    # far from 0: the maximum matters in fp32
    x = {"contiguous": lambda: torch.randn(n, b, v),
         "batch first": lambda: torch.randn(b, n, v).transpose(0, 1),  # reshape copies
         "vocabulary strided": lambda: torch.randn(v, n, b).permute(1, 2, 0)}[layout]() * 4 + 30
    labels = torch.randint(0, v, (n, b))
    labels[0] = -100  # outside the vocabulary: no target logit (megatron's masking)
    dloss = torch.rand(n, b)
    a = x.to(dtype).clone().requires_grad_()  # (the backward overwrites it; same strides)
    loss = vocab_parallel_cross_entropy(a, labels)
    (grad,) = torch.autograd.grad(loss, a, dloss)
    ref_loss, ref_grad = reference(x.to(dtype).double(), labels, dloss.double())
    # megatron's loss, in the same dtype (it views its input: contiguous only)
    m = x.to(dtype).contiguous().requires_grad_()
    theirs = tensor_parallel.vocab_parallel_cross_entropy(m, labels)
    (their_grad,) = torch.autograd.grad(theirs, m, dloss)
    out["cases"].append({"v": v, "dtype": str(dtype), "loss_dtype": str(loss.dtype),
                         "grad_dtype": str(grad.dtype), "shape": list(loss.shape),
                         "layout": layout, "input_contiguous": x.is_contiguous(),
                         "loss": (loss.double() - ref_loss).abs().max().item(),
                         "loss_scale": ref_loss.abs().max().item(),
                         "grad": (grad.double() - ref_grad).abs().max().item(),
                         "grad_scale": ref_grad.abs().max().item(),
                         # megatron's loss of a target outside the vocabulary differs
                         "megatron_loss": (theirs[1:].double() - ref_loss[1:]).abs().max().item(),
                         "megatron_grad": (their_grad.double() - ref_grad).abs().max().item()})

# a row whose first block is all -inf (finite after it): finite, as megatron's
x = torch.randn(2, 1, 5000)
x[0, 0, :4096] = float("-inf")
labels = torch.full((2, 1), 4500)
ref_loss, _ = reference(x.double(), labels, torch.ones(2, 1).double())
out["neg_inf"] = (vocab_parallel_cross_entropy(x.clone(), labels).double()
                  - ref_loss).abs().max().item()

# another node that saved the logits and runs its backward after the loss's: an error
w = torch.randn(8, 2, 50, requires_grad=True)
logits = w * 1.0
z = 1e-2 * (logits ** 2).sum()  # made first: its backward runs after the loss's
try:
    loss = vocab_parallel_cross_entropy(logits, torch.randint(0, 50, (8, 2))).sum()
    torch.autograd.grad(loss + z, w)
    out["shared"] = None
except RuntimeError as e:
    out["shared"] = str(e).splitlines()[0]

# the shards of a TP group of 2 (gloo), each against the whole vocabulary in fp64
for rank in run_distributed(tp_rank, 2):
    out["tp"].append(rank)

# what the node keeps: the logits in their dtype, the labels and two fp32 per token
saved = []
x = torch.randn(8, 2, 256, dtype=torch.bfloat16, requires_grad=True)
with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
    loss = vocab_parallel_cross_entropy(x * 1, torch.randint(0, 256, (8, 2)))
out["saved"] = sorted([str(t.dtype), list(t.shape)] for t in saved)
loss.sum().backward(retain_graph=True)
try:
    loss.sum().backward()
    out["twice"] = None
except RuntimeError as e:
    out["twice"] = str(e)

# whole models: the fused loss in place of megatron's, logits' gradients and weights'
from kvtrain.config import ModelConfig
from kvtrain.model.builder import build_gpt, transformer_config
from tests.model.interpreter import autograd_nodes

tokens = torch.randint(0, 100, (2, 24))
labels = torch.randint(0, 100, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
for attention in ("vanilla", "kv_shift"):
    runs = {}
    for kernel in ("triton", "torch"):
        set_seed(7)
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                          num_query_groups=2, vocab_size=100, max_position_embeddings=32,
                          attention=attention)
        model = build_gpt(cfg, transformer_config(cfg), backend="torch", cross_entropy=kernel)
        loss = model(tokens, pos, None, labels=labels)
        (loss * torch.rand(loss.shape, generator=torch.Generator().manual_seed(3))).sum().backward()
        runs[kernel] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                        sum(n == "FusedCrossEntropyBackward" for n in autograd_nodes(loss)))
    (l_f, g_f, n_f), (l_r, g_r, n_r) = runs["triton"], runs["torch"]
    out["models"][attention] = {"shape": list(l_f.shape), "loss": (l_f - l_r).abs().max().item(),
                                "grads": max(((g_f[n] - g).abs().max() / g.abs().max()).item()
                                             for n, g in g_r.items()),
                                "nodes": [n_f, n_r]}
print(json.dumps(out))
'''


def reference(x, labels, dloss):
    """The loss ``[n, b]`` of ``x [n, b, v]`` and its gradient, in x's dtype (fp64 here)."""
    lse = torch.logsumexp(x, dim=-1)
    inside = (labels >= 0) & (labels < x.shape[-1])
    target = torch.where(inside, x.gather(-1, labels.clamp(0, x.shape[-1] - 1)[..., None])[..., 0],
                         torch.zeros_like(lse))
    onehot = torch.zeros_like(x)
    onehot.scatter_(-1, labels.clamp(0, x.shape[-1] - 1)[..., None], inside[..., None].to(x.dtype))
    return lse - target, (torch.softmax(x, dim=-1) - onehot) * dloss[..., None]


def tp_rank(rank: int, world: int) -> dict:
    """One rank of a TP group: its shard of the same logits (every rank draws all of
    them from one seed), a label in each shard and one outside both."""
    import torch.distributed as dist

    from kvtrain.model.cross_entropy import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(11)
    n, v = 10, 2 * 300
    x = torch.randn(n, 1, v, generator=gen) * 3
    labels = torch.randint(0, v, (n, 1), generator=gen)
    labels[0], labels[1], labels[2] = 5, v - 5, v + 7  # rank 0's, rank 1's, nobody's
    x[3, 0, :v // 2], labels[3] = float("-inf"), v - 3  # rank 0's half of row 3: -inf
    dloss = torch.rand(n, 1, generator=gen)
    shard = x[..., rank * v // world:(rank + 1) * v // world].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, labels, dist.group.WORLD)
    (grad,) = torch.autograd.grad(loss, shard, dloss)
    ref_loss, ref_grad = reference(x.double(), labels, dloss.double())
    ref_grad = ref_grad[..., rank * v // world:(rank + 1) * v // world]
    return {"loss": (loss.double() - ref_loss).abs().max().item(),
            "grad": (grad.double() - ref_grad).abs().max().item(),
            "scale": ref_loss.abs().max().item()}


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


def test_kernels_match_the_loss_in_fp64(interpreted):
    """fp32: loss and gradient within fp32 rounding of fp64, as megatron's (one
    block, a partial block, three blocks; a batch-first input the reshape copies,
    one strided along the vocabulary; a target outside the vocabulary); bf16: the
    gradient rounded once to bf16, the loss fp32."""
    cases = interpreted["cases"]
    assert [c["v"] for c in cases] == [37, 4500, 8197, 70, 300]
    assert [c["input_contiguous"] for c in cases] == [True, False, True, False, True]
    for c in cases:
        assert c["loss_dtype"] == "torch.float32" and c["grad_dtype"] == c["dtype"], c
        assert c["loss"] < 1e-7 * c["loss_scale"], c  # fp32 rounding of the loss
        assert c["megatron_loss"] < 1e-7 * c["loss_scale"], c  # the same bound holds there
        if c["dtype"] == "torch.float32":  # megatron's: 3e-8 to 1.3e-7
            assert c["grad"] < 4e-7 * c["grad_scale"], c
            assert c["megatron_grad"] < 4e-7 * c["grad_scale"], c
        else:  # a bf16 ulp of the largest (the interpreter may truncate, a GPU rounds)
            assert c["grad"] <= 2 ** -7 * c["grad_scale"], c


def test_rows_of_minus_infinity_stay_finite(interpreted):
    """A row whose first 4096 logits are -inf (a mask, say) has the loss of its finite
    ones, as megatron's; and on two TP ranks, a row whose half on one rank is -inf."""
    assert interpreted["neg_inf"] < 1e-5


def test_a_node_that_saved_the_logits_too_fails_instead_of_reading_the_gradient(interpreted):
    """The backward writes over the logits; another node that saved them and runs later
    raises autograd's in-place error rather than computing with the gradient."""
    assert interpreted["shared"] is not None and "inplace" in interpreted["shared"]


def test_shards_of_a_tp_group_make_the_whole_vocabularys_loss(interpreted):
    """Two ranks, each with half of the vocabulary: every rank's loss is that of the
    whole vocabulary, and its gradient that of its columns (targets in either shard,
    and one in neither)."""
    assert len(interpreted["tp"]) == 2
    for rank in interpreted["tp"]:
        assert rank["loss"] < 1e-6 * rank["scale"] and rank["grad"] < 1e-6, rank


def test_keeps_the_logits_not_an_fp32_softmax(interpreted):
    """The node keeps the bf16 logits (2 bytes each; megatron's loss keeps an fp32
    softmax, 4), the labels and two fp32 per token; a second backward is refused."""
    assert interpreted["saved"] == sorted([["torch.bfloat16", [16, 256]], ["torch.int64", [16]],
                                           ["torch.float32", [16]], ["torch.float32", [16]]])
    assert "backward ran twice" in interpreted["twice"]


def test_models_with_the_fused_loss_match_megatrons(interpreted):
    """A whole model, vanilla and KV shift: the fused loss replaces megatron's (one
    node), with the same per-token losses and every weight's gradient (fp32)."""
    for attention in ("vanilla", "kv_shift"):
        m = interpreted["models"][attention]
        assert m["shape"] == [2, 24] and m["nodes"] == [1, 0], m
        assert m["loss"] < 2e-6 and m["grads"] < 2e-6, m  # measured 5e-7, 3e-7


@pytest.mark.parametrize("requested, backend, cuda, want", [
    ("auto", "torch", False, ("torch", "auto: no GPU")),
    ("auto", "torch", True, ("triton", "auto: GPU")),
    ("auto", "local", True, ("torch", "auto: the local backend keeps megatron's loss")),
    ("auto", "te", True, ("triton", "auto: GPU")),
    ("torch", "torch", True, ("torch", "model.cross_entropy_kernel: torch")),
    ("triton", "local", True, ("triton", "model.cross_entropy_kernel: triton")),
])
def test_choice(requested, backend, cuda, want):
    assert choose_cross_entropy(requested, backend, cuda) == want


def test_triton_without_a_gpu_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        choose_cross_entropy("triton", "torch", False)
    assert str(e.value) == ("model.cross_entropy_kernel: triton needs a GPU "
                            "(use auto or torch on the CPU)")


def test_a_cpu_run_records_megatrons_loss(single_rank, tmp_path):
    """What a run on this machine prints and records: megatron's loss."""
    from kvtrain.config import load_config
    from kvtrain.train.setup import build_run

    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"), [
        "data.type=mock", "train.max_steps=1"])
    run = build_run(cfg, tmp_path)
    assert run.backend.cross_entropy == "torch (auto: no GPU)"
    assert "; cross-entropy: torch (auto: no GPU)" in run.backend.describe()
    assert run.backend.as_dict()["cross_entropy"] == "torch (auto: no GPU)"
    assert run.model[0].module.cross_entropy == "torch"


@pytest.mark.gpu
def test_a_gpu_model_takes_the_compiled_kernels_and_matches_megatrons_loss(single_rank):
    """On a GPU the torch backend takes the compiled kernels: fp32 and bf16 models
    against megatron's loss, per-token losses and every gradient within each dtype's
    rounding, and the peak memory of the loss below megatron's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.transformer.module import Float16Module

    from kvtrain.backend import set_seed
    from kvtrain.config import ModelConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config

    from .interpreter import autograd_nodes

    assert choose_cross_entropy("auto", "torch", True)[0] == "triton"
    tokens = torch.randint(0, 5000, (2, 128), device="cuda")
    labels = torch.randint(0, 5000, (2, 128), device="cuda")
    pos = torch.arange(128, device="cuda")[None].expand_as(tokens)
    for numerics, tol in ((Numerics(), 1e-4), (Numerics.from_precision("bf16"), 2e-2)):
        runs = {}
        for kernel in ("triton", "torch"):
            set_seed(3)
            cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                              num_query_groups=4, vocab_size=5000,
                              max_position_embeddings=128, attention="kv_shift")
            tc = transformer_config(cfg, numerics=numerics)
            model = build_gpt(cfg, tc, backend="torch", cross_entropy=kernel).cuda()
            if numerics.bf16:
                model = Float16Module(tc, model)
            loss = model(tokens, pos, None, labels=labels)
            loss.mean().backward()
            nodes = sum(n == "FusedCrossEntropyBackward" for n in autograd_nodes(loss))
            runs[kernel] = (loss.detach(), {n: p.grad.float() for n, p in model.named_parameters()},
                            nodes)
        (l_f, g_f, n_f), (l_r, g_r, n_r) = runs["triton"], runs["torch"]
        assert (n_f, n_r) == (1, 0)
        assert (l_f - l_r).abs().max() <= tol * l_r.abs().max()
        for name, g in g_r.items():
            assert (g_f[name] - g).abs().max() <= tol * g.abs().max(), name


def test_plan_counts_what_each_loss_keeps(interpreted, single_rank):
    """``kvtrain plan``'s bytes per logit: megatron's loss keeps an fp32 softmax while
    the bf16 logits are alive (6), the fused one keeps the logits (2, measured in
    the interpreter above); fp32 logits: 4 either way."""
    from kvtrain.config import ModelConfig
    from kvtrain.plan.memory import logit_bytes
    from megatron.core import tensor_parallel

    saved = []
    x = torch.randn(16, 1, 256, dtype=torch.bfloat16, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        tensor_parallel.vocab_parallel_cross_entropy(x * 1, torch.randint(0, 256, (16, 1)))
    per_logit = sum(t.numel() * t.element_size() for t in saved if t.numel() >= x.numel())
    assert per_logit / x.numel() + 2 == 6 == logit_bytes(ModelConfig(), "bf16", "local")
    fused = [s for s in interpreted["saved"] if s[1] == [16, 256]]
    assert fused == [["torch.bfloat16", [16, 256]]]
    assert logit_bytes(ModelConfig(), "bf16", "torch") == logit_bytes(ModelConfig(), "bf16",
                                                                      "te") == 2
    assert logit_bytes(ModelConfig(cross_entropy_kernel="torch"), "bf16", "torch") == 6
    # an explicit triton runs on any backend (choose_cross_entropy): counted there too
    assert logit_bytes(ModelConfig(cross_entropy_kernel="triton"), "bf16", "te") == 2
    assert logit_bytes(ModelConfig(), "fp32", "local") == logit_bytes(ModelConfig(), "fp32",
                                                                      "torch") == 4


def test_the_benchmark_refuses_a_cpu_in_one_line():
    """benchmarks/cross_entropy.py times the compiled kernels: a GPU only."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cross_entropy.py")],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stdout.strip().count("\n") == 0 and "needs a GPU" in done.stdout


@pytest.mark.gpu
def test_the_benchmark_runs_on_a_gpu(tmp_path):
    """benchmarks/cross_entropy.py on a small shape: both losses timed, the fused
    one allocating less above its logits than megatron's. (On an H200 it inherited
    the MASTER_ADDR/MASTER_PORT of an earlier test's group in this process, whose
    store still held the port: EADDRINUSE.)"""
    import json
    import subprocess
    import sys

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    out = tmp_path / "ce.json"
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "cross_entropy.py"),
                           "--tokens", "512", "--vocab", "5000", "--rounds", "3",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=script_env())  # not the port of pytest's group
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    peak = r["peak_bytes_above_logits"]
    assert peak["fused"] < peak["megatron"] and r["ms"]["fused"] > 0, r


def test_the_plan_says_which_loss_its_logits_assume():
    """``kvtrain plan`` names the loss behind its logits' bytes: the paper's 1.5B run
    (16,384 tokens x 36,096 per micro batch) keeps 1.1 GiB with the fused loss and
    3.3 GiB with megatron's."""
    from kvtrain.config import load_config
    from kvtrain.plan import make_plan, render

    paper = str(REPO / "configs" / "paper" / "1.5b_kv_shift.yaml")
    fused = render(make_plan(load_config(paper), nodes=1, gpu="a100"))
    theirs = render(make_plan(load_config(paper, ["model.cross_entropy_kernel=torch"]), nodes=1,
                              gpu="a100"))
    assert "; logits 1.1 GiB, kvtrain's fused loss)" in fused
    assert "; logits 3.3 GiB, megatron's loss, its fp32 copy included)" in theirs
