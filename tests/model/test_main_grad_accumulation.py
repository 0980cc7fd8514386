"""The shift's K+V nodes accumulate the coefficients' gradients into megatron's
``main_grad`` themselves (``kvtrain.model.coefficient_grads``).

In Triton's interpreter on the CPU: models with the node (the GPU path: SDPA, the
Triton QKV/shift/RoPE node) wrapped in megatron's DDP, two micro batches, against
the same models on megatron's path (the split, the shift's own node, RoPE), whose
gradients reach ``main_grad`` through megatron's hook: every ``main_grad`` alike;
without ``overlap_grad_reduce`` the coefficients outside autograd (no AccumulateGrad
node for them, nothing left in ``.grad``), with it through autograd, marked
``grad_added_to_main_grad`` (so the hook adds nothing); and what the shift adds to
the host's work per layer, counted in dispatched operators.
"""

from __future__ import annotations

import pytest

from .interpreter import run_interpreted

CHECK = r'''
import collections, json, torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.coefficient_grads import untrack_coefficients
from kvtrain.model.documents import DocumentParams
from tests.model.interpreter import autograd_nodes

init_distributed(seed=1)
init_model_parallel(1, 1)
tokens = torch.randint(0, 64, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
docs = DocumentParams.from_ids(torch.tensor([[0] * 9 + [1] * 15, [0] * 20 + [1] * 4]).int())

launching = [0]  # the interpreter's own torch calls inside a launch are not the host's
launch = interpreter.GridExecutor.__call__
def counted_launch(self, *args, **kwargs):
    launching[0] += 1
    try:
        return launch(self, *args, **kwargs)
    finally:
        launching[0] -= 1
interpreter.GridExecutor.__call__ = counted_launch


from kvtrain.model import triton_qkv_rope
node_calls = [0]  # the QKV node's forward kernels, recomputed ones included
node_forward = triton_qkv_rope.forward
def counted_forward(*args, **kwargs):
    node_calls[0] += 1
    return node_forward(*args, **kwargs)
triton_qkv_rope.forward = counted_forward


class Ops(TorchDispatchMode):
    """Operators dispatched on the host, outside kernel launches."""
    def __init__(self):
        super().__init__()
        self.count = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not launching[0]:
            self.count[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def coefficient_edges(out):
    """AccumulateGrad nodes of the shift's coefficients in out's graph."""
    count, stack, seen = 0, [out.grad_fn], set()
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += getattr(getattr(fn, "variable", None), "kv_shift", False)
        stack.extend(f for f, _ in fn.next_functions)
    return count


def run(attention, fusion, shift=KVShiftConfig(), groups=4, packed=None, overlap=False,
        kernel=None, frozen=False, recompute="none"):
    set_seed(7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                      num_query_groups=groups, vocab_size=64, max_position_embeddings=64,
                      attention=attention, kv_shift=shift)
    tc = transformer_config(cfg, ParallelConfig(recompute=recompute), rope_fusion=fusion)
    module = build_gpt(cfg, tc, backend="torch", shift_kernel=kernel)
    for name, p in module.named_parameters():
        if frozen and "shift_" not in name:  # a study that trains the coefficients alone
            p.requires_grad_(False)
    model = DistributedDataParallel(
        tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                          overlap_grad_reduce=overlap), module)
    untrack_coefficients(model)  # as the trainer's setup does
    ops, nodes = None, None
    for step in range(2):  # the second step counts: caches warm, buffers zeroed again
        model.zero_grad_buffer()
        node_calls[0] = 0
        with Ops() as ops:
            for micro in range(2):
                logits = model(tokens, pos, None, packed_seq_params=packed)
                (logits.float().pow(2).mean() * (micro + 1)).backward()
        nodes = autograd_nodes(logits)
        edges = coefficient_edges(logits)
    if overlap:
        model.finish_grad_sync()
    params = {n: p for n, p in model.module.named_parameters() if p.requires_grad}
    return {
        "main": {n: p.main_grad.clone() for n, p in params.items()},
        "edges": edges,
        "node_calls": node_calls[0],
        "added": {n: bool(p.grad_added_to_main_grad) for n, p in params.items()
                  if "shift_" in n},
        "grads_left": [n for n, p in params.items() if p.grad is not None],
        "fused": sum(n == "QKVRoPEBackward" for n in nodes),
        "shift_nodes": sum(n == "QKVShiftBackward" for n in nodes),
        "ops": ops.count,
    }


def compare(got, ref, nodes):
    """main_grads' largest relative difference; flags, .grad left and nodes side by side."""
    return {"main_grad": max(((got["main"][n] - g).abs().max() / g.abs().max()).item()
                             for n, g in ref["main"].items()),
            **{key: [got[key], ref[key]] for key in ("added", "grads_left", "edges",
                                                     "node_calls")},
            "nodes": [got[nodes], ref[nodes]]}


out = {"cases": {}}
for name, kwargs in (("kv_shift", {}),
                     ("gqa window 2 documents", {"shift": KVShiftConfig(window=2),
                                                 "groups": 2, "packed": docs}),
                     ("overlap_grad_reduce", {"overlap": True}),
                     ("coefficients alone learn", {"frozen": True}),
                     ("recompute full", {"recompute": "full"})):
    fused, ref = run("kv_shift", True, **kwargs), run("kv_shift", False, **kwargs)
    out["cases"][name] = compare(fused, ref, "fused")
    if name == "kv_shift":
        vanilla = run("vanilla", True)
        extra = fused["ops"].copy()
        extra.subtract(vanilla["ops"])
        out["extra_ops"] = {k: v for k, v in extra.items() if v}
        out["extra_ops_per_layer"] = sum(extra.values()) / 2  # 2 layers, micro batches alike
        out["micro_batches"] = 2
# the shift's own K+V node (megatron's RoPE: as the te backend runs it), on the Triton
# kernels and on torch ops, against the native operators (a C++ node: the hook's path)
out["shift_node"] = {}
ref = run("kv_shift", False, shift=KVShiftConfig(window=2), packed=docs, kernel="native")
for kernel in ("triton", "torch"):
    got = run("kv_shift", False, shift=KVShiftConfig(window=2), packed=docs, kernel=kernel)
    out["shift_node"][kernel] = compare(got, ref, "shift_nodes")
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def interpreted():
    return run_interpreted(CHECK)


@pytest.mark.parametrize("case", ["kv_shift", "gqa window 2 documents", "overlap_grad_reduce",
                                  "coefficients alone learn", "recompute full"])
def test_main_grads_match_megatrons_hook_path(interpreted, case):
    """Every parameter's main_grad after two micro batches equals megatron's path's
    (fp32, 1e-5 of the largest), and the hook left no .grad on either. Without
    ``overlap_grad_reduce`` the node has the coefficients outside autograd (no
    AccumulateGrad node for them: 2 layers x K, V on megatron's path); with it (its
    hook tells the bucket a parameter is ready) through autograd, marked as added by
    the node; and where no graph runs through the QKV output to call the node's
    backward (the first layer, when the coefficients alone learn) through autograd
    too (the second layer's input depends on the first's coefficients: outside).
    Full recomputation re-runs each layer, the node with it, in the backward (the
    checkpointed layers hide both paths' nodes from the logits' graph)."""
    c = interpreted["cases"][case]
    hidden = case == "recompute full"
    assert c["nodes"] == [0 if hidden else 2, 0], c  # the node; megatron's path without
    # 2 layers x 2 micro batches, each run again in the backward with recomputation
    assert c["node_calls"] == [8 if hidden else 4, 0], c
    assert c["main_grad"] <= 1e-5, c
    fused, ref = c["added"]
    tracked = {"overlap_grad_reduce": 4, "coefficients alone learn": 2}.get(case, 0)
    assert c["edges"] == [tracked, 0 if hidden else 4], c  # 2 layers x K, V: megatron's
    assert fused and sum(fused.values()) == tracked, c
    assert ref and not any(ref.values()), c
    assert c["grads_left"] == [[], []], c


@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_the_shifts_own_node_adds_into_main_grad_too(interpreted, kernel):
    """The shift's own K+V node (``QKVShift``: the te backend's, and the torch backend's
    without the fused RoPE), on the Triton kernels and on torch ops, GQA with documents
    and window 2: every main_grad equals the native operators' (whose C++ node leaves
    the coefficients' gradients to megatron's hook), the coefficients marked added."""
    c = interpreted["shift_node"][kernel]
    assert c["nodes"] == [2, 0], c  # the native operator's node has another name
    assert c["main_grad"] <= 1e-5, c
    assert c["edges"] == [0, 4], c  # outside autograd (no overlap_grad_reduce)
    got, ref = c["added"]
    assert got and not any(got.values()) and not any(ref.values()), c
    assert c["grads_left"] == [[], []], c


def test_what_the_shift_adds_to_the_hosts_work(interpreted):
    """Dispatched operators (outside kernel launches) that KV shift adds to vanilla per
    layer and micro batch on the node's path: the coefficients' reduction, its split in
    two, one multi-tensor add into main_grad and the detach of the gradient in mixed's
    memory, less the gradient buffer that backward no longer allocates: 3. Session 27:
    7 (autograd's two placeholders and AccumulateGrad's two detaches more); before it
    12 (the reduction, a transpose, a cast's empty_like and copy_, two selects, four
    detaches and megatron's hook's two adds). The count the GPU's host time follows at
    small shapes (on an H200 the small shape's step is the host's)."""
    extra = interpreted["extra_ops"]
    per_micro = interpreted["extra_ops_per_layer"] / interpreted["micro_batches"]
    assert "aten.add_" not in extra and "aten.copy_" not in extra, extra
    assert "aten.empty_like" not in extra, extra  # no placeholders
    assert extra.get("aten._foreach_add_") == 2 * 2, extra  # a layer a micro batch
    assert per_micro <= 3, extra


@pytest.mark.gpu
def test_main_grads_match_on_a_gpu(mp1):
    """The same on a GPU, compiled (the gradient written over the QKV output by real
    programs, whose barrier the interpreter cannot test): fp32 and bf16 models in
    megatron's DDP (bf16 through its Float16Module, as the trainer builds them), two
    micro batches, every main_grad against megatron's path within the dtype's rounding
    (fp32 1e-4, bf16 5e-2 of the largest); the node's coefficients outside autograd
    (the trainer's default) and, with ``overlap_grad_reduce``, through it."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    from kvtrain.backend import set_seed
    from kvtrain.config import ModelConfig
    from kvtrain.config.schema import KVShiftConfig
    from kvtrain.model.builder import Numerics, build_gpt, transformer_config
    from kvtrain.model.coefficient_grads import untrack_coefficients

    tokens = torch.randint(0, 256, (2, 256), device="cuda")
    pos = torch.arange(256, device="cuda")[None].expand_as(tokens)
    for numerics, tol in ((Numerics(), 1e-4), (Numerics.from_precision("bf16"), 5e-2)):
        mains, added = {}, {}
        for fusion, overlap in ((True, False), (True, True), (False, False)):
            set_seed(3)
            cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                              num_query_groups=4, vocab_size=256, max_position_embeddings=256,
                              attention="kv_shift", kv_shift=KVShiftConfig(window=2))
            tc = transformer_config(cfg, numerics=numerics, rope_fusion=fusion)
            module = build_gpt(cfg, tc, backend="torch").cuda()
            if numerics.bf16:
                module = Float16Module(tc, module)
            model = DistributedDataParallel(
                tc, DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                  overlap_grad_reduce=overlap), module)
            untrack_coefficients(model)
            model.zero_grad_buffer()
            for micro in range(2):
                logits = model(tokens, pos, None)
                (logits.float().pow(2).mean() * (micro + 1)).backward()
            if overlap:
                model.finish_grad_sync()
            params = dict(model.module.named_parameters())
            key = (fusion, overlap)
            mains[key] = {n: p.main_grad.clone() for n, p in params.items()}
            added[key] = [p.grad_added_to_main_grad for n, p in params.items()
                          if "shift_" in n]
            assert all(p.grad is None for p in params.values()), key
        # through autograd (placeholders) with overlap only; megatron's path never
        assert all(added[True, True]) and not any(added[True, False] + added[False, False])
        for name, ref in mains[False, False].items():
            for key in ((True, False), (True, True)):
                err = ((mains[key][name] - ref).abs().max() / ref.abs().max()).item()
                assert err <= tol, (numerics, key, name, err)
