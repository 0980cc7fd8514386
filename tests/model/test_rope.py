"""kvtrain's fused RoPE (``kvtrain.model.rope``, ``model.rope_kernel``).

The Triton kernel runs in Triton's interpreter on the CPU (``TRITON_INTERPRET=1``,
a process of its own: the interpreter is chosen when ``triton.jit`` decorates the
kernel, at import): values and gradients against megatron's torch-ops RoPE in
fp64, and whole models with the kernel in megatron's fused-RoPE slot against
megatron's ops. Compilation for a GPU and speed are the ``gpu`` tests' part.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtrain.config import ConfigError
from kvtrain.model.rope import choose_rope


from .interpreter import REPO, run_interpreted

CHECK = r'''
import json, torch
from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
from kvtrain.model import rope
torch.manual_seed(0)
cases = []
for s, b, h, d, r, dtype, strided in [(37, 2, 3, 40, 40, torch.float32, False),
                                       (37, 2, 3, 40, 20, torch.float32, True),
                                       (16, 1, 8, 64, 64, torch.float32, True),
                                       (33, 3, 5, 32, 32, torch.bfloat16, False)]:
    base = torch.randn(s, b, h, 3 * d)
    x = base[..., d:2 * d] if strided else base[..., :d].contiguous()
    freqs = torch.randn(s + 3 * strided, 1, 1, r // 2) * 3  # longer than t: its first s rows
    freqs = torch.cat([freqs, freqs], dim=-1)  # megatron's layout: both halves the same
    dy = torch.randn(s, b, h, d)
    a = x.to(dtype).detach().requires_grad_()
    y = rope.fused_rope(a, freqs)
    (dx,) = torch.autograd.grad(y, a, dy.to(dtype))
    ref_in = x.to(dtype).double().detach().requires_grad_()
    ref = _apply_rotary_pos_emb_bshd(ref_in, freqs[:s].double())
    (ref_dx,) = torch.autograd.grad(ref, ref_in, dy.double())
    theirs = _apply_rotary_pos_emb_bshd(x.to(dtype), freqs[:s])  # megatron's ops, in dtype
    cases.append({"d": d, "r": r, "dtype": str(dtype), "strided": strided,
                  "scale": ref.abs().max().item(), "dx_scale": ref_dx.abs().max().item(),
                  "megatron_y": (theirs.double() - ref).abs().max().item(),
                  "y": (y.double() - ref).abs().max().item(),
                  "dx": (dx.double() - ref_dx).abs().max().item(),
                  "contiguous": y.is_contiguous(), "dtype_out": str(y.dtype),
                  "node": y.grad_fn.name()})

# The kernels take cos and sin from triton_rope.cos_sin's table, not from the angles:
# a table of cos 1, sin 0 (edited in place, as no run would) rotates nothing.
from kvtrain.model import triton_rope
x = torch.randn(8, 2, 4, 32)
freqs = torch.randn(8, 1, 1, 32)
moved = (rope.fused_rope(x, freqs) - x).abs().max().item()
table = triton_rope.cos_sin(freqs)
table[:, :32], table[:, 32:] = 1.0, 0.0
identity = (rope.fused_rope(x, freqs) - x).abs().max().item()

# A whole model with megatron's fused-RoPE slot holding kvtrain's kernel, against
# megatron's torch ops: logits and every gradient (vanilla and KV shift).
from kvtrain.backend import init_distributed, init_model_parallel, set_seed
from kvtrain.config import ModelConfig
from kvtrain.model.builder import build_gpt, transformer_config
from tests.model.interpreter import autograd_nodes

init_distributed(seed=1)
init_model_parallel(1, 1)
tokens = torch.randint(0, 64, (2, 24))
pos = torch.arange(24)[None].expand_as(tokens)
models = {}
table_of = triton_rope._table_of
for attention in ("vanilla", "kv_shift"):
    runs = {}
    for fusion in (True, False):
        set_seed(7)
        cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          vocab_size=64, max_position_embeddings=32, attention=attention)
        tc = transformer_config(cfg, rope_fusion=fusion)
        computed = []  # the cos/sin tables this model's two steps computed
        triton_rope._table_of = lambda f: computed.append(1) or table_of(f)
        # local: megatron's split and RoPE call (torch fuses the split with RoPE where
        # the slot holds this kernel: tests/model/test_rope_attention.py)
        model = build_gpt(cfg, tc, backend="local")
        out = model(tokens, pos, None)
        out.float().pow(2).mean().backward()
        names = autograd_nodes(out)
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model(tokens, pos, None).float().pow(2).mean().backward()  # a second step
        runs[fusion] = (out.detach(), grads, sum("FusedRoPE" in n for n in names),
                        tc.apply_rope_fusion, len(computed))
    (o_f, g_f, n_f, flag_f, t_f), (o_r, g_r, n_r, flag_r, _) = runs[True], runs[False]
    models[attention] = {"logits": (o_f - o_r).abs().max().item(),
                         "grads": max(((g_f[n] - g).abs().max() / g.abs().max()).item()
                                      for n, g in g_r.items()),
                         "fused_nodes": n_f, "unfused_nodes": n_r, "tables": t_f,
                         "flags": [flag_f, flag_r]}
# Decoding (megatron's static batching, its KV cache): RoPE gets slices of the angles
# per step and layer; the tokens with the kernel in the slot against megatron's ops.
from kvtrain.inference.generate import SamplingOptions, generate_ids
generated = {}
for fusion in (True, False):
    set_seed(7)
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      vocab_size=64, max_position_embeddings=64, attention="kv_shift")
    model = build_gpt(cfg, transformer_config(cfg, rope_fusion=fusion), backend="local").eval()
    computed = []
    triton_rope._table_of = lambda f: computed.append(1) or table_of(f)
    new = generate_ids(model, [[1, 2, 3, 4], [5, 6, 7, 8]],
                       SamplingOptions(max_new_tokens=6, stop_at_eod=False), eod=0, vocab_size=64)
    generated[str(fusion)] = {"tokens": [t for t, _ in new], "tables": len(computed)}
print(json.dumps({"cases": cases, "models": models, "generated": generated,
                  "table": {"moved": moved, "identity": identity}}))
'''


@pytest.fixture(scope="module")
def interpreted():
    """The check's results from a process with ``TRITON_INTERPRET=1``."""
    return run_interpreted(CHECK)


def test_kernel_matches_megatrons_rope(interpreted):
    """fp32: within fp32 rounding of megatron's RoPE in fp64 (all of d rotated, half of
    it with the rest passed through, d not a power of two, 3 and 5 heads, strided
    input); bf16: rounded once, no further from fp64 than megatron's bf16 ops."""
    assert len(interpreted["cases"]) == 4
    for c in interpreted["cases"]:
        assert c["node"] == "FusedRoPEBackward" and c["contiguous"], c
        if c["dtype"] == "torch.float32":
            assert c["y"] < 1e-6 * c["scale"] and c["dx"] < 1e-6 * c["scale"], c
        else:
            # within a bf16 ulp of the largest value (Triton's interpreter may truncate
            # where a GPU rounds to nearest); megatron's ops round four times
            assert c["dtype_out"] == "torch.bfloat16", c
            assert c["y"] <= 2 ** -7 * c["scale"] and c["dx"] <= 2 ** -7 * c["dx_scale"], c
            assert c["y"] <= c["megatron_y"], c


def test_decoding_with_the_kernel_gives_megatrons_tokens_from_one_table(interpreted):
    fused, theirs = interpreted["generated"]["True"], interpreted["generated"]["False"]
    assert fused["tokens"] == theirs["tokens"] and len(fused["tokens"][0]) == 6
    assert fused["tables"] == 1 and theirs["tables"] == 0


def test_the_kernel_reads_cos_and_sin_from_the_table(interpreted):
    assert interpreted["table"]["moved"] > 0.5
    assert interpreted["table"]["identity"] == 0.0


def test_the_angle_table_is_computed_once_per_angles_tensor():
    """cos and sin of ``freqs`` (fp32, as torch computes them), the same table for the
    same unchanged tensor, a new one after it changes in place, one per tensor."""
    from kvtrain.model.triton_rope import cos_sin

    freqs = torch.randn(6, 1, 1, 8, dtype=torch.float64)  # as fp32 in the table
    table = cos_sin(freqs)
    angles = freqs.reshape(6, 8).float()
    assert table.dtype == torch.float32 and table.shape == (6, 16)
    assert torch.equal(table, torch.cat((angles.cos(), angles.sin()), dim=-1))
    assert cos_sin(freqs) is table
    other = freqs.clone()  # equal values, another tensor: a table of its own
    assert cos_sin(other) is not table and cos_sin(freqs) is table
    freqs.mul_(2)  # changed in place: computed again
    again = cos_sin(freqs)
    assert again is not table and torch.equal(again[:, :8], (2 * angles).cos())
    assert cos_sin(freqs) is again


def test_angles_made_under_inference_mode_get_a_table_each_call():
    """megatron's inference engine runs under ``torch.inference_mode``: its tensors
    keep no version counter, so a kept table could not tell a change; computed per
    call, right."""
    from kvtrain.model.triton_rope import cos_sin

    with torch.inference_mode():
        freqs = torch.randn(6, 1, 1, 8)
        first = cos_sin(freqs)
        freqs.mul_(2)
        again = cos_sin(freqs[2:4])
    angles = freqs.reshape(6, 8)
    assert torch.equal(first[:, 8:], (angles / 2).sin())
    assert torch.equal(again, torch.cat((angles.cos(), angles.sin()), dim=-1)[2:4])


def test_a_slice_of_the_angles_takes_its_rows_of_their_table(single_rank, monkeypatch):
    """Decoding hands RoPE ``freqs[start:end]`` per step and layer, slices of
    megatron's angles (themselves a view of a ``[S, r]`` tensor): the rows of one
    table, computed once; other views get their own."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from kvtrain.model import triton_rope

    computed = []
    table_of = triton_rope._table_of
    monkeypatch.setattr(triton_rope, "_table_of", lambda f: computed.append(1) or table_of(f))
    freqs = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)(16)  # kvtrain's CPU backend
    assert freqs.shape == (16, 1, 1, 8) and freqs._base is not None  # as megatron makes it
    whole = triton_rope.cos_sin(freqs)
    for start, end in [(3, 4), (0, 7), (15, 16), (0, 16)]:
        rows = triton_rope.cos_sin(freqs[start:end])
        assert torch.equal(rows, whole[start:end])
        assert rows.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
    assert len(computed) == 1
    freqs[5:6].mul_(2)  # a slice changed in place: the whole table is computed again
    assert torch.equal(triton_rope.cos_sin(freqs[5:6]), table_of(freqs)[5:6])
    assert len(computed) == 2
    for other in (freqs[::2], freqs[:, :, :, :4]):  # not runs of whole rows: their own
        assert torch.equal(triton_rope.cos_sin(other), table_of(other))
    assert len(computed) == 4
    frozen = torch.empty_strided((4, 1, 1, 8), (0, 8, 8, 1))  # every row the same memory
    assert torch.equal(triton_rope.cos_sin(frozen[1:3]), table_of(frozen[1:3]))


def test_models_with_the_fused_slot_match_megatrons_ops(interpreted):
    """A whole model, vanilla and KV shift: with ``rope_fusion`` megatron calls the
    kernel for Q and K of every layer (4 nodes in 2 layers) and the logits and every
    gradient equal those of its own ops; the cos/sin table is computed once for both
    layers, forward and backward, over two steps (megatron hands every layer the same
    angles tensor)."""
    for attention in ("vanilla", "kv_shift"):
        m = interpreted["models"][attention]
        assert m["flags"] == [True, False], m
        assert m["fused_nodes"] == 4 and m["unfused_nodes"] == 0, m
        assert m["tables"] == 1, m
        assert m["logits"] < 1e-6 and m["grads"] < 1e-5, m


@pytest.mark.parametrize("requested, backend, cuda, mla, want", [
    ("auto", "torch", False, False, ("torch", "auto: no GPU")),
    ("auto", "torch", True, False, ("triton", "auto: GPU")),
    ("auto", "torch", True, True, ("torch", "auto: multi-latent attention")),
    ("auto", "local", True, False, ("torch", "auto: the local backend keeps megatron's RoPE")),
    ("auto", "te", True, False, ("transformer_engine", "auto: Transformer Engine's fused RoPE")),
    ("auto", "te", True, True, ("torch", "auto: multi-latent attention")),
    ("torch", "torch", True, False, ("torch", "model.rope_kernel: torch")),
    ("triton", "local", True, False, ("triton", "model.rope_kernel: triton")),
])
def test_choice(requested, backend, cuda, mla, want):
    assert choose_rope(requested, backend, cuda, mla) == want


@pytest.mark.parametrize("cuda, mla, words", [(False, False, "needs a GPU"),
                                              (True, True, "multi-latent attention")])
def test_triton_where_it_cannot_run_is_refused_in_one_line(cuda, mla, words):
    with pytest.raises(ConfigError) as e:
        choose_rope("triton", "torch", cuda, mla)
    assert "model.rope_kernel: triton" in str(e.value) and words in str(e.value)
    assert "\n" not in str(e.value)


def test_a_cpu_run_records_megatrons_rope(single_rank, tmp_path):
    """What a run on this machine prints and records: RoPE on megatron's ops."""
    from kvtrain.config import load_config
    from kvtrain.train.setup import build_run

    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"), [
        "data.type=mock", "train.max_steps=1", "model.attention=vanilla"])
    run = build_run(cfg, tmp_path)
    assert run.backend.rope == "torch (auto: no GPU)"
    assert "; RoPE: torch (auto: no GPU)" in run.backend.describe()
    assert run.backend.as_dict()["rope"] == "torch (auto: no GPU)"
    assert not run.model[0].config.apply_rope_fusion
    nope = build_run(load_config(str(REPO / "configs" / "bench" / "host.yaml"), [
        "data.type=mock", "train.max_steps=1", "model.position_embedding=none"]), tmp_path / "b")
    assert nope.backend.rope == "none (model.position_embedding: none)"


@pytest.mark.parametrize("held, kernel, why", [
    (None, "torch", "auto: this Transformer Engine has no fused RoPE"),
    ("te", "transformer_engine", "auto: Transformer Engine's fused RoPE"),
    ("kvtrain", "torch", "auto: this Transformer Engine has no fused RoPE"),
])
def test_the_te_backend_takes_tes_fused_rope_where_it_has_one(held, kernel, why, monkeypatch):
    """The te backend (on a GPU; chosen here with a GPU and TE's kernels stood in for)
    takes TE's fused RoPE where megatron's slots hold TE's kernels, as Megatron-LM
    does, and megatron's ops where they are empty or hold kvtrain's: recorded, and
    ``apply_rope_fusion`` set to match."""
    import dataclasses

    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.config import load_config
    from kvtrain.model import rope, specs
    from kvtrain.model.builder import Numerics
    from kvtrain.train import setup

    def stand_in(*args, **kwargs):  # TE's kernel is never called: the choice is checked
        raise AssertionError("not called")

    slot = {None: None, "te": stand_in, "kvtrain": rope.fused_rope}[held]
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", slot)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd",
                        None if held is None else stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    te = dataclasses.replace(specs.backend_choice("torch"), name="te", requested="auto",
                             reason="auto: GPU with Transformer Engine")
    monkeypatch.setattr(specs, "backend_choice", lambda requested: te)
    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"), ["data.type=mock"])
    backend, kernels = setup._resolve_backend(cfg, Numerics.from_precision("bf16"))
    assert backend.rope == f"{kernel} ({why})"
    assert kernels.rope_fusion == (kernel == "transformer_engine")


@pytest.mark.parametrize("sets, kernel, why", [
    (["model.attention=vanilla"], "triton in the QKV split",
     "auto: GPU; Transformer Engine's kernel holds megatron's fused-RoPE slot, for decoding"),
    (["model.attention=kv_shift"], "triton in the QKV split",
     "auto: GPU; Transformer Engine's kernel holds megatron's fused-RoPE slot, for decoding"),
    (["model.attention=kv_shift", "model.kv_shift.kernel=torch"], "transformer_engine",
     "auto: GPU; megatron's fused-RoPE slot holds Transformer Engine's kernel"),
    (["model.attention=vanilla", "parallel.context=2"], "transformer_engine",
     "auto: GPU; megatron's fused-RoPE slot holds Transformer Engine's kernel"),
])
def test_the_torch_backend_with_te_installed_records_what_rotates(sets, kernel, why,
                                                                  monkeypatch):
    """The torch backend on a GPU where TE is installed (its kernel stood in for in
    megatron's slot): the layers that rotate in their QKV split take kvtrain's node
    (tests/model/test_rope_attention.py runs it so), recorded as such; elsewhere
    megatron's path calls the slot, TE's kernel, and the record says that. Both set
    ``apply_rope_fusion``."""
    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.config import load_config
    from kvtrain.model.builder import Numerics
    from kvtrain.train import setup

    def stand_in(*args, **kwargs):  # TE's kernel is never called: the choice is checked
        raise AssertionError("not called")

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", stand_in)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb_thd", stand_in)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"),
                      ["data.type=mock", "model.backend=torch", *sets])
    backend, kernels = setup._resolve_backend(cfg, Numerics.from_precision("bf16"))
    assert backend.rope == f"{kernel} ({why})"
    assert kernels.rope_fusion


@pytest.mark.gpu
def test_a_gpu_run_rotates_with_the_kernel_and_matches_megatrons_ops(single_rank, monkeypatch):
    """On a GPU the compiled kernel rotates Q and K of every layer where megatron's
    RoPE call runs (the local backend; the torch backend's layers take it inside
    their QKV split): fp32 and bf16 models against megatron's ops, logits and every
    gradient within each dtype's rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.model.rope import fused_rope

    from .gpu_models import assert_fused_matches

    assert choose_rope("auto", "torch", True, False)[0] == "triton"
    # kvtrain's kernel in the slot even where TE's would hold it
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_rope)
    # local: megatron's RoPE call (Q and K of 2 layers; torch fuses it with the split)
    assert_fused_matches("kv_shift", "local", "FusedRoPEBackward", 4)


@pytest.mark.gpu
def test_decoding_on_a_gpu_with_the_kernel_gives_megatrons_tokens(single_rank, monkeypatch):
    """Decoding hands the kernel slices of the angles per step and layer; on a GPU the
    compiled kernel gives megatron's tokens (greedy, fp32) from one cos/sin table."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.backend import set_seed
    from kvtrain.config import ModelConfig
    from kvtrain.inference.generate import SamplingOptions, generate_ids
    from kvtrain.model import triton_rope
    from kvtrain.model.builder import build_gpt, transformer_config
    from kvtrain.model.rope import fused_rope

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", fused_rope)
    table_of = triton_rope._table_of
    runs = {}
    for fusion in (True, False):
        computed = []
        monkeypatch.setattr(triton_rope, "_table_of",
                            lambda f, c=computed: c.append(1) or table_of(f))
        set_seed(7)
        cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=8,
                          num_query_groups=4, vocab_size=256, max_position_embeddings=64,
                          attention="kv_shift")
        model = build_gpt(cfg, transformer_config(cfg, rope_fusion=fusion),
                          backend="local").cuda().eval()
        new = generate_ids(model, [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]],
                           SamplingOptions(max_new_tokens=8, stop_at_eod=False), eod=0,
                           vocab_size=256)
        runs[fusion] = ([t for t, _ in new], len(computed))
    assert runs[True][0] == runs[False][0] and len(runs[True][0][0]) == 8
    assert runs[True][1] == 1 and runs[False][1] == 0


def test_install_fills_an_empty_slot_and_leaves_tes_kernel(monkeypatch):
    """Without TE the slot gets kvtrain's kernel; where TE's kernel is there it stays,
    and the run records that (``transformer_engine``)."""
    from megatron.core.models.common.embeddings import rope_utils

    from kvtrain.model import rope

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    assert rope.install() == "triton" and rope_utils.fused_apply_rotary_pos_emb is rope.fused_rope

    def te_kernel(t, freqs, interleaved=False):  # a stand-in for TE's
        return t

    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", te_kernel)
    assert rope.install() == "transformer_engine"
    assert rope_utils.fused_apply_rotary_pos_emb is te_kernel


@pytest.mark.parametrize("backend, kernel, vpp, tables", [
    ("torch", "auto", 0, 1), ("torch", "triton", 2, 1), ("torch", "torch", 0, 0),
    ("te", "auto", 0, 0), ("te", "triton", 2, 0), ("local", "auto", 0, 0),
    ("local", "triton", 0, 1),
])
def test_the_plan_counts_the_angles_and_table_a_chunk_keeps(single_rank, backend, kernel, vpp,
                                                           tables):
    """``kvtrain plan`` counts, per model chunk, the angles megatron's
    ``RotaryEmbedding`` caches for the run and, where kvtrain's Triton RoPE runs, the
    cos/sin table ``cos_sin`` keeps on them: the bytes of megatron's own tensor and
    of the table computed from it (two chunks with VPP 2)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from kvtrain.config import load_config
    from kvtrain.model import triton_rope
    from kvtrain.plan.memory import activation_bytes, rope_bytes

    seq = 256
    sets = ["data.type=mock", f"model.backend={backend}", f"model.rope_kernel={kernel}",
            f"train.seq_length={seq}", f"model.max_position_embeddings={seq}"]
    if vpp:
        sets += ["parallel.pipeline=2", f"parallel.virtual_pipeline={vpp}"]
    cfg = load_config(str(REPO / "configs" / "bench" / "host.yaml"), sets)
    m = cfg.model
    d = m.hidden_size // m.num_attention_heads
    freqs = RotaryEmbedding(d, rotary_percent=1.0, rotary_base=m.rotary_base,
                            use_cpu_initialization=True)(seq)  # (the CPU backend)
    kept = freqs.untyped_storage().nbytes() + tables * triton_rope.cos_sin(freqs).nbytes
    assert rope_bytes(m, seq, backend) == kept
    acts = activation_bytes(m, cfg.parallel, seq, 1, 4, "none", precision="bf16",
                            backend=backend)
    assert acts["rope"] == (vpp or 1) * kept


def test_models_without_rotary_embeddings_take_none():
    from kvtrain.config import ModelConfig
    from kvtrain.model.rope import choose_for

    assert choose_for(ModelConfig(position_embedding="none"), "torch", True) == (
        "none", "model.position_embedding: none")
    assert choose_for(ModelConfig(), "torch", True) == ("triton", "auto: GPU")


def test_an_odd_head_dim_with_rope_is_refused_in_one_line(single_rank, tmp_path, capsys):
    """RoPE rotates pairs of a head's channels: an odd head dim (hidden_size 24 over 8
    heads) stopped the first forward in a traceback from megatron's RoPE (``The size of
    tensor a (3) must match the size of tensor b (4)``), and ``kvtrain plan`` planned
    it; the config refuses it, naming the keys. Without RoPE the same shape is a model."""
    from kvtrain.cli import main
    from kvtrain.config import ModelConfig, load_config
    from kvtrain.train.setup import build_run

    want = ("model.hidden_size (24) / model.num_attention_heads (8) = 3 channels per head: "
            "RoPE rotates pairs of them and needs an even head dim (or "
            "model.position_embedding: none)")
    odd = dict(hidden_size=24, num_attention_heads=8)
    with pytest.raises(ConfigError) as e:
        ModelConfig(**odd).validate()
    assert str(e.value) == want
    ModelConfig(**odd, position_embedding="none").validate()
    sets = ["data.type=mock", "train.max_steps=1", "model.hidden_size=24",
            "model.num_attention_heads=8", "model.num_query_groups=null"]
    with pytest.raises(ConfigError) as e:
        build_run(load_config(str(REPO / "configs" / "tiny.yaml"), sets), tmp_path / "a")
    assert str(e.value) == want
    capsys.readouterr()
    plan = ["plan", str(REPO / "configs" / "tiny.yaml")] + [a for s in sets for a in ("--set", s)]
    assert main(plan) == 2
    assert capsys.readouterr().err.strip() == f"kvtrain: config error: {want}"


def test_the_plan_counts_one_angles_copy_per_mla_layer(mp1):
    """megatron's MLA layers build a ``RotaryEmbedding`` each, and its ``lru_cache``
    (keyed by the module) keeps a copy per layer: the plan counts as many, up to the
    cache's 32 entries; context parallelism keeps this rank's share of the rows."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from kvtrain.config import ParallelConfig
    from kvtrain.plan.memory import activation_bytes, rope_bytes, rope_copies
    from tests.model.test_mla import build, model_config

    cfg = model_config("vanilla", layers=3)
    model = build(cfg)
    RotaryEmbedding.forward.cache_clear()
    tokens = torch.randint(0, 128, (2, 10))
    model(tokens, torch.arange(10)[None].expand_as(tokens), None)
    kept = RotaryEmbedding.forward.cache_info().currsize * 4 * 10 * cfg.mla.qk_pos_emb_head_dim
    acts = activation_bytes(cfg, ParallelConfig(), 10, 2, 1, "none", precision="fp32",
                            backend="torch")
    assert acts["rope"] == kept == 3 * rope_bytes(cfg, 10, "torch")
    deep = dataclasses.replace(cfg, num_layers=80)
    assert rope_copies(deep, ParallelConfig(pipeline=2)) == 32
    assert rope_bytes(cfg, 64, "torch", context=2) == rope_bytes(cfg, 32, "torch")
