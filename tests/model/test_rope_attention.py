"""Attention layers whose QKV split, RoPE and K+V shift are one node
(``kvtrain.model.rope_attention``: the ``torch`` backend with kvtrain's Triton RoPE).

In Triton's interpreter on the CPU (``TRITON_INTERPRET=1``): whole models with
the fused node against the same models on megatron's path (the split, the shift's
own node, RoPE), logits and every gradient; where megatron's path must run
instead; and what a layer keeps for backward against ``kvtrain plan``.
"""

from __future__ import annotations

import pytest

from .interpreter import run_interpreted

CHECK = r'''
import json, torch
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig
from kvtrain.config.model import ShiftHeadsConfig
from kvtrain.config.schema import KVShiftConfig, ParallelConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.documents import DocumentParams
from kvtrain.plan.memory import layer_activation_bytes
from kvtrain.model import triton_rope
from tests.model.interpreter import autograd_nodes

init_distributed(seed=1)
init_model_parallel(1, 1)
out = {"models": {}, "kept": {}}
tokens = torch.randint(0, 64, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
docs = torch.tensor([[0] * 9 + [1] * 15, [0] * 20 + [1] * 4])  # [b, s] document ids
CASES = {  # name: (attention, KV groups, shift options, documents)
    "vanilla": ("vanilla", 4, KVShiftConfig(), False),
    "vanilla gqa": ("vanilla", 2, KVShiftConfig(), False),
    "kv_shift": ("kv_shift", 4, KVShiftConfig(), False),
    "kv_shift gqa window 2": ("kv_shift", 2, KVShiftConfig(window=2), False),
    "kv_shift fixed heads": ("kv_shift", 4, KVShiftConfig(
        heads=ShiftHeadsConfig(k=[0], v=[1], fixed=True)), False),
    "kv_shift documents": ("kv_shift", 2, KVShiftConfig(), True),
    "q shifted (megatron's path)": ("kv_shift", 4, KVShiftConfig(shift=["q", "k", "v"]), False),
}


def model_of(name, fusion, layers=2, hidden=32, heads=4, vocab=64):
    attention, groups, shift, _ = CASES[name]
    set_seed(7)
    cfg = ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                      num_query_groups=groups, vocab_size=vocab, max_position_embeddings=64,
                      attention=attention, kv_shift=shift)
    return cfg, build_gpt(cfg, transformer_config(cfg, rope_fusion=fusion), backend="torch")


table_of = triton_rope._table_of
for name, (_, _, _, documents) in CASES.items():
    runs = {}
    for fusion in (True, False):
        cfg, model = model_of(name, fusion)
        tables = []  # the cos/sin tables the model's forward and backward computed
        triton_rope._table_of = lambda f: tables.append(1) or table_of(f)
        packed = DocumentParams.from_ids(docs.int()) if documents else None
        logits = model(tokens, pos, None, packed_seq_params=packed)
        logits.float().pow(2).mean().backward()
        names = autograd_nodes(logits)
        runs[fusion] = (logits.detach(), {n: p.grad for n, p in model.named_parameters()},
                        sum(n == "QKVRoPEBackward" for n in names),
                        sum(n == "FusedRoPEBackward" for n in names), len(tables))
    (l_f, g_f, n_f, r_f, t_f), (l_r, g_r, n_r, r_r, _) = runs[True], runs[False]
    out["models"][name] = {
        "logits": ((l_f - l_r).abs().max() / l_r.abs().max()).item(),
        "grads": max(((g_f[n] - g).abs().max() / g.abs().max()).item() for n, g in g_r.items()),
        "nodes": [n_f, n_r], "rope_nodes": [r_f, r_r], "tables": t_f}
triton_rope._table_of = table_of


def kept(cfg, model, seq=64, batch=2):
    """Bytes autograd keeps for backward over the first layer (parameters excluded)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t.detach()  # a saved output itself would keep its graph (and groups) alive

    hidden = torch.randn(seq, batch, cfg.hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.decoder.layers[0](hidden, attention_mask=None,
                                rotary_pos_emb=model.rotary_pos_emb(seq))
    return sum(storages.values())


for name in ("vanilla", "vanilla gqa", "kv_shift", "kv_shift gqa window 2",
             "kv_shift fixed heads"):
    cfg, model = model_of(name, True, layers=1, hidden=256, heads=8, vocab=128)
    plan = layer_activation_bytes(cfg, ParallelConfig(), 64, 2, "fp32", backend="torch")
    out["kept"][name] = [kept(cfg, model), plan]


# where megatron's path must run although the slot holds kvtrain's RoPE (from a review:
# each took the node before): gated attention (the node had taken the angles away),
# layers megatron leaves unrotated (no_rope_freq), an explicit shift kernel
def run(attention, fusion, tweak=None, shift_kernel=None):
    set_seed(7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=4,
                      vocab_size=64, max_position_embeddings=64, attention=attention)
    tc = transformer_config(cfg, rope_fusion=fusion)
    for k, v in (tweak or {}).items():  # megatron TransformerConfig fields
        setattr(tc, k, v)
    model = build_gpt(cfg, tc, backend="torch", shift_kernel=shift_kernel)
    logits = model(tokens, pos, None)
    return logits.detach(), sum(n == "QKVRoPEBackward" for n in autograd_nodes(logits))


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


out["megatrons"] = {}
# megatron's gate as written, eager: its torch.compile (dynamo and inductor on the CPU,
# ~7 s) is megatron's own and not what this checks
from megatron.core.transformer.attention import Attention

Attention._apply_output_gate = getattr(Attention._apply_output_gate, "__wrapped__",
                                       Attention._apply_output_gate)
for name, tweak in (("output gate", {"attention_output_gate": True}),
                    ("no_rope_freq", {"no_rope_freq": [1, 0]})):
    (fused, n), (ref, _) = run("vanilla", True, tweak), run("vanilla", False, tweak)
    out["megatrons"][name] = {"nodes": n, "vs_megatron": rel(fused, ref)}
for kernel in ("torch", "native"):
    (fused, n), (ref, _) = (run("kv_shift", True, shift_kernel=kernel),
                            run("kv_shift", False, shift_kernel=kernel))
    out["megatrons"][f"kv_shift.kernel {kernel}"] = {"nodes": n, "vs_megatron": rel(fused, ref)}

# Transformer Engine installed: its kernel holds megatron's fused-RoPE slot (a stand-in
# that must not be called), and the torch backend's layers still take kvtrain's node
from megatron.core.models.common.embeddings import rope_utils


def te_stand_in(*args, **kwargs):
    raise AssertionError("TE's RoPE ran where the QKV node should have")


slot = rope_utils.fused_apply_rotary_pos_emb
rope_utils.fused_apply_rotary_pos_emb = te_stand_in
out["te_slot"] = {}
for attention in ("vanilla", "kv_shift"):
    (fused, n), (ref, _) = run(attention, True), run(attention, False)
    out["te_slot"][attention] = {"nodes": n, "vs_megatron": rel(fused, ref),
                                 "slot_kept": rope_utils.fused_apply_rotary_pos_emb is te_stand_in}
rope_utils.fused_apply_rotary_pos_emb = slot

# TP = 2 (gloo ranks; with sequence parallelism for the shift) and full recomputation
from kvtrain.testing import run_distributed
from tests.model.test_rope_attention import parallel_rank

out["parallel"] = {f"tp2 {attention}{' sp' if sp else ''}": run_distributed(
    parallel_rank, 2, attention, sp, "none") for attention, sp in (("kv_shift", True),
                                                                   ("vanilla", False))}
out["parallel"]["recompute full"] = [parallel_rank(0, 1, "kv_shift", False, "full")]
out["parallel"]["recompute selective"] = [parallel_rank(0, 1, "kv_shift", False, "selective")]
print(json.dumps(out))
'''


def parallel_rank(rank: int, world: int, attention: str, sp: bool, recompute: str) -> dict:
    """One rank of a TP group of ``world`` (1: this process): the fused node against
    megatron's path, this rank's logits and gradients."""
    import torch

    from kvtrain.backend import init_model_parallel, set_seed
    from kvtrain.config import ModelConfig, ParallelConfig
    from kvtrain.model import kv_shift, rope_attention
    from kvtrain.model.builder import build_gpt, transformer_config

    from .interpreter import autograd_nodes

    calls = []  # the node's calls, forward and recomputed (the graph hides the latter)
    node = rope_attention.qkv_rope

    def counted(*args, **kwargs):
        calls.append(1)
        return node(*args, **kwargs)

    rope_attention.qkv_rope = kv_shift.qkv_rope = counted
    init_model_parallel(world, 1)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 128, (2, 16), generator=gen)
    pos = torch.arange(16)[None].expand_as(tokens)
    runs = {}
    for fusion in (True, False):
        set_seed(5)
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                          num_query_groups=2, ffn_hidden_size=64, vocab_size=128,
                          make_vocab_size_divisible_by=64, max_position_embeddings=64,
                          attention=attention)
        parallel = ParallelConfig(tensor=world, sequence_parallel=sp, recompute=recompute)
        model = build_gpt(cfg, transformer_config(cfg, parallel, rope_fusion=fusion),
                          backend="torch")
        calls.clear()
        logits = model(tokens, pos, None)
        nodes = sum(x == "QKVRoPEBackward" for x in autograd_nodes(logits))
        logits.float().pow(2).mean().backward()
        runs[fusion] = (logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()},
                        nodes, len(calls))
    rope_attention.qkv_rope = kv_shift.qkv_rope = node
    (l_f, g_f, n_f, c_f), (l_r, g_r, n_r, c_r) = runs[True], runs[False]
    return {"nodes": [n_f, n_r], "calls": [c_f, c_r],
            "logits": ((l_f - l_r).abs().max() / l_r.abs().max()).item(),
            "grads": max(((g_f[k] - g).abs().max() / g.abs().max()).item()
                         for k, g in g_r.items())}


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


@pytest.mark.parametrize("name", ["vanilla", "vanilla gqa", "kv_shift", "kv_shift gqa window 2",
                                  "kv_shift fixed heads", "kv_shift documents"])
def test_the_fused_split_matches_megatrons_path(interpreted, name):
    """Every layer takes the one node (2 layers, no separate RoPE node), and the logits
    and every gradient (the shift's coefficients too) equal megatron's split, the
    shift's own node and RoPE (fp32): MHA and GQA, windows 1 and 2, selected fixed
    heads, packed documents. One cos/sin table serves both layers both ways."""
    m = interpreted["models"][name]
    assert m["nodes"] == [2, 0] and m["rope_nodes"][0] == 0 and m["tables"] == 1, m
    assert m["logits"] < 1e-5 and m["grads"] < 1e-5, m


def test_a_shifted_query_keeps_megatrons_path(interpreted):
    """The Q shift (not the paper's K+V in place) runs the shift's own nodes and
    kvtrain's RoPE node per rotated tensor: the same values."""
    m = interpreted["models"]["q shifted (megatron's path)"]
    assert m["nodes"] == [0, 0] and m["rope_nodes"] == [4, 0], m
    assert m["logits"] < 1e-5 and m["grads"] < 1e-5, m


@pytest.mark.parametrize("name", ["tp2 kv_shift sp", "tp2 vanilla", "recompute full",
                                  "recompute selective"])
def test_tensor_parallelism_and_recomputation(interpreted, name):
    """TP = 2 over gloo (the KV shift with sequence parallelism: the node sees each
    rank's heads over the whole sequence), full recomputation (megatron re-runs the
    layer, and the node, in the backward) and selective (core attention re-run, which
    keeps V̂, a view of the QKV output the node's backward then writes over): every
    rank's logits and gradients equal megatron's path. With full recomputation the
    checkpointed layers hide the node from the graph of the logits: it is called twice
    per layer instead."""
    for rank in interpreted["parallel"][name]:
        recompute = name == "recompute full"
        assert rank["nodes"] == ([0, 0] if recompute else [2, 0]), rank
        assert rank["calls"] == ([4, 0] if recompute else [2, 0]), rank
        assert rank["logits"] < 1e-5 and rank["grads"] < 1e-5, rank


@pytest.mark.parametrize("name", ["output gate", "no_rope_freq", "kv_shift.kernel torch",
                                  "kv_shift.kernel native"])
def test_megatrons_path_where_the_node_must_not_run(interpreted, name):
    """Gated attention and megatron's per-layer RoPE switch (``no_rope_freq``) keep
    megatron's path, with RoPE where it puts it; an explicit ``model.kv_shift.kernel``
    other than triton is the kernel that runs (and is recorded). Each took the node
    before a review: gated attention lost RoPE in every layer."""
    m = interpreted["megatrons"][name]
    assert m["nodes"] == 0 and m["vs_megatron"] < 1e-6, m


@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
def test_the_node_runs_where_transformer_engines_rope_holds_the_slot(interpreted, attention):
    """With TE installed its kernel holds megatron's fused-RoPE slot (stood in for by a
    kernel that fails when called); the torch backend's layers still take kvtrain's
    node (which does not go through the slot), the same values as megatron's path,
    and TE's kernel stays in the slot for megatron's own calls. Before, the layers
    checked the slot, and such a run lost the node (and the shift's memory saving)."""
    m = interpreted["te_slot"][attention]
    assert m["slot_kept"] and m["nodes"] == 2 and m["vs_megatron"] < 1e-5, m


def test_what_a_layer_keeps_is_what_the_plan_counts(interpreted):
    """With the fused node the KV-shift layer keeps what the vanilla one keeps (the QKV
    output, held by V or the shifted V written over its query columns, and the
    rotated Q and K): KV shift - vanilla is 0 bytes, MHA and GQA, learned and fixed
    coefficients, and the plan's difference is the same."""
    k = interpreted["kept"]
    for shifted, base in (("kv_shift", "vanilla"), ("kv_shift fixed heads", "vanilla"),
                          ("kv_shift gqa window 2", "vanilla gqa")):
        measured = k[shifted][0] - k[base][0]
        planned = k[shifted][1] - k[base][1]
        # (the coefficients' bytes are parameters: excluded; freqs are per position)
        assert measured == pytest.approx(planned, abs=256) and abs(measured) <= 256, (shifted, k)
    # each whole layer, to the byte, once what only the CPU keeps is added: torch's
    # composite RMSNorm keeps x·rstd and rstd per norm; the node keeps its angles
    # [s, 1, 1, d] (per position, not per token); the coefficients are parameters
    seq, batch, h, d = 64, 2, 256, 32
    cpu_only = 4 * seq * batch * 2 * (h + 1) + 4 * seq * d
    for name, (measured, planned) in k.items():
        assert measured == pytest.approx(planned + cpu_only, abs=64), (name, k)


@pytest.mark.gpu
def test_a_gpu_model_takes_the_compiled_node_and_matches_megatrons_path(single_rank,
                                                                         monkeypatch):
    """On a GPU the torch backend takes the compiled node (kvtrain's RoPE in megatron's
    slot, as ``model.rope_kernel: auto`` gives it): fp32 and bf16 models, vanilla and
    KV shift, against megatron's split, the shift's node and RoPE, logits and every
    gradient within each dtype's rounding."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.model.rope import fused_rope

    from .gpu_models import assert_fused_matches

    # kvtrain's kernel in the slot even where TE's would hold it
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_rope)
    for attention in ("vanilla", "kv_shift"):
        assert_fused_matches(attention, "torch", "QKVRoPEBackward", 2, seq=256)


@pytest.mark.parametrize("backend, attention, shift, sets, splits", [
    ("torch", "vanilla", None, [], True),
    ("torch", "kv_shift", "triton", [], True),
    ("torch", "kv_shift", "torch", ["model.kv_shift.kernel=torch"], False),
    ("torch", "kv_shift", "triton", ["model.kv_shift.shift=[q,k,v]"], False),
    ("torch", "vanilla", None, ["parallel.context=2"], False),
    ("te", "vanilla", None, [], False),
])
def test_the_record_and_the_plan_say_where_the_split_takes_rope(backend, attention, shift,
                                                                sets, splits):
    """The run records ``triton in the QKV split`` and the plan counts the node's memory
    exactly where the layers take it: the torch backend without context parallelism,
    vanilla or the K+V shift on its Triton kernel."""
    from kvtrain.config import load_config
    from kvtrain.plan.memory import rope_in_the_split
    from kvtrain.train.setup import _rope_in_the_split

    from .interpreter import REPO

    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"),
                      ["data.type=mock", f"model.attention={attention}", *sets])
    assert _rope_in_the_split(cfg, backend, shift) == splits
    if attention == "kv_shift" and "parallel.context=2" not in sets:
        layer_fuses = splits or "shift=[q,k,v]" in " ".join(sets)  # (the variant: elsewhere)
        assert rope_in_the_split(cfg.model, backend) == (layer_fuses and backend == "torch")
