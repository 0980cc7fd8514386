"""The ``torch`` backend (SDPA core attention) equals the ``local`` reference.

Same weights on both backends (their state dicts have the same keys: the core
attention has no parameters): logits and every gradient, the KV-shift
coefficients included, agree to 1e-5 in fp32 - MHA and GQA, vanilla and KV
shift, packed documents, TP=2 with SP and PP=2 (one spawn of 2 gloo ranks),
and a checkpoint saved on ``local`` loads on ``torch`` with the same logits.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.config.schema import KVShiftConfig
from kvtrain.model.attention import LocalDotProductAttention, TorchAttention, sdpa_has_gqa
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.documents import DocumentParams, document_ids
from kvtrain.testing import run_distributed
from tests.asserts import assert_close_to_scale
from tests.model.test_parallel import shard

SEQ, BATCH, VOCAB = 16, 2, 128
TOL = dict(atol=1e-5, rtol=1e-5)


def model_config(attention: str = "kv_shift", groups: int = 2, layers: int = 2,
                 hidden: int = 32, **kv_shift) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4,
                       num_query_groups=groups, ffn_hidden_size=64, vocab_size=VOCAB,
                       make_vocab_size_divisible_by=64, max_position_embeddings=64,
                       attention=attention, kv_shift=KVShiftConfig(**kv_shift))


def batch(seed: int = 11):
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def run(model, tokens, labels, packed=None):
    """(logits [b, s, V], loss, {name: grad}) of one forward and backward."""
    model.zero_grad()
    pos = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    logits = model(tokens, pos, None, packed_seq_params=packed, runtime_gather_output=True)
    loss = model(tokens, pos, None, labels=labels, packed_seq_params=packed).mean()
    loss.backward()
    return logits.detach(), loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def both(cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig()):
    """A ``local`` model and a ``torch`` model holding the local one's weights."""
    tc = transformer_config(cfg, parallel)
    local = build_gpt(cfg, tc, backend="local")
    torch_model = build_gpt(cfg, tc, seed=77, backend="torch")  # other init: weights are loaded
    torch_model.load_state_dict(local.state_dict())
    return local, torch_model


def assert_same(a, b):
    (la, lossa, ga), (lb, lossb, gb) = a, b
    torch.testing.assert_close(lb, la, **TOL)
    torch.testing.assert_close(lossb, lossa, **TOL)
    assert ga.keys() == gb.keys()
    for name in ga:  # relative to each gradient's size: some are ~1e-7 at init
        assert_close_to_scale(gb[name], ga[name], TOL["rtol"], msg=name)


def test_specs_differ_only_in_core_attention(mp1):
    local, torch_model = both(model_config())
    assert list(local.state_dict()) == list(torch_model.state_dict())
    assert isinstance(local.decoder.layers[0].self_attention.core_attention,
                      LocalDotProductAttention)
    assert isinstance(torch_model.decoder.layers[0].self_attention.core_attention, TorchAttention)
    assert sdpa_has_gqa()  # torch >= 2.5: GQA without repeated K/V


@pytest.mark.parametrize("groups", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("attention,kv_shift", [
    ("vanilla", {}), ("kv_shift", {}),
    ("kv_shift", dict(shift=["q", "k", "v"], window=2, mode="gate")),
], ids=["vanilla", "kv_shift", "qkv-w2-gate"])
def test_torch_equals_local(mp1, groups, attention, kv_shift):
    local, torch_model = both(model_config(attention, groups, **kv_shift))
    tokens, labels = batch()
    ref = run(local, tokens, labels)
    assert_same(ref, run(torch_model, tokens, labels))
    if attention == "kv_shift":
        assert any("shift" in n and g.abs().sum() > 0 for n, g in ref[2].items())


def test_gqa_on_a_torch_without_sdpa_gqa_repeats_kv_heads(mp1, monkeypatch):
    """pyproject allows torch 2.4, whose SDPA has no ``enable_gqa``: there each KV
    head is repeated for its group's query heads. That path (stood in for here)
    gives local's logits and gradients."""
    from kvtrain.model import attention

    local, torch_model = both(model_config("kv_shift", 2))
    tokens, labels = batch()
    ref = run(local, tokens, labels)
    repeats = []
    repeat = torch.Tensor.repeat_interleave
    monkeypatch.setattr(attention, "sdpa_has_gqa", lambda: False)
    monkeypatch.setattr(torch.Tensor, "repeat_interleave",
                        lambda t, *a, **k: repeats.append(t.shape) or repeat(t, *a, **k))
    assert_same(ref, run(torch_model, tokens, labels))
    kv = (BATCH, 2, SEQ, 32 // 4)  # [b, ng, s, hn]: K and V of 2 layers, 2 forwards
    assert [shape for shape in repeats if len(shape) == 4] == [kv] * 8, repeats


def _value_kept(core, documents, device="cpu", dtype=torch.float32) -> bool:
    """Whether ``core``, given a view of a QKV output as its value (the fused node's Q
    and K are new tensors), keeps the QKV output alive after its forward; it is freed
    with the attention's saved tensors by the backward either way (asserted)."""
    import weakref

    c = core.config
    groups = c.num_query_groups or c.num_attention_heads
    d, r = c.hidden_size // c.num_attention_heads, c.num_attention_heads // groups
    leaf = torch.randn(12, BATCH, groups, (r + 2) * d, device=device, dtype=dtype,
                       requires_grad=True)
    mixed = leaf * 1  # an intermediate, as the QKV projection's output
    gone = []
    weakref.finalize(mixed.untyped_storage(), gone.append, True)
    query = mixed[..., :r * d].reshape(12, BATCH, groups * r, d).clone()
    key = mixed[..., r * d:(r + 1) * d].clone()
    value = mixed[..., (r + 1) * d:]  # a view, as the node's (vanilla's V columns)
    out = core(query, key, value, None, packed_seq_params=documents)
    del mixed, query, key, value
    kept = not gone
    out.float().sum().backward()
    assert gone
    return kept


def _documents(device="cpu") -> DocumentParams:
    ids = torch.tensor([[0] * 5 + [1] * 7] * BATCH, dtype=torch.int32, device=device)
    return DocumentParams.from_ids(ids)


def test_attention_keeps_the_value_it_is_given_where_it_says_so(mp1, monkeypatch):
    """``keeps_value`` (what the fused QKV node reads to write the QKV output's gradient
    over it, keeping the QKV output to the node's backward) checked against what the
    attention keeps: SDPA, with and without documents, keeps it; an older torch's GQA
    path (stood in for), which takes copies, frees it at once."""
    from kvtrain.model import attention

    for groups, has_gqa, documents in ((4, True, None), (2, True, None),
                                       (2, True, _documents()), (4, False, None),
                                       (2, False, None)):
        monkeypatch.setattr(attention, "sdpa_has_gqa", lambda has_gqa=has_gqa: has_gqa)
        cfg = model_config("vanilla", groups)
        core = build_gpt(cfg, transformer_config(cfg), backend="torch") \
            .decoder.layers[0].self_attention.core_attention
        kept = _value_kept(core, documents)
        assert kept == core.keeps_value(documents is not None), (groups, has_gqa, documents)
    assert not core.keeps_value(False)  # the last case: GQA taking copies


def test_fewer_queries_than_keys_attend_bottom_right(mp1):
    """Causal attention of the last ``sq`` positions over ``sk`` keys (megatron's
    causal mask when a call hands fewer queries than keys): each query sees the keys
    up to its own position, as the full sequence's last rows do."""
    from megatron.core.transformer.enums import AttnMaskType

    cfg = model_config("vanilla", 2)
    core = build_gpt(cfg, transformer_config(cfg), backend="torch") \
        .decoder.layers[0].self_attention.core_attention
    gen = torch.Generator().manual_seed(5)
    sk, sq, b, d = 12, 5, 2, cfg.hidden_size // cfg.num_attention_heads
    q = torch.randn(sk, b, cfg.num_attention_heads, d, generator=gen)
    k, v = (torch.randn(sk, b, 2, d, generator=gen) for _ in range(2))
    full = core(q, k, v, None, AttnMaskType.causal)  # [sk, b, np * d]
    tail = core(q[-sq:], k, v, None, AttnMaskType.causal)
    torch.testing.assert_close(tail, full[-sq:], **TOL)
    assert not torch.allclose(tail, core(q[:sq], k[:sq], v[:sq], None, AttnMaskType.causal))


@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
def test_documents_torch_equals_local(mp1, attention):
    """DocumentParams (document ids of a packed batch) on both backends."""
    local, torch_model = both(model_config(attention))
    tokens, labels = batch(5)
    tokens[0, 5] = tokens[0, 11] = tokens[1, 3] = 0  # EOD = 0: 3, 2 documents
    packed = DocumentParams.from_ids(document_ids(tokens, 0))
    ref = run(local, tokens, labels, packed)
    assert_same(ref, run(torch_model, tokens, labels, DocumentParams.from_ids(packed.doc_ids)))
    # and the documents are separated: unpacked logits differ after the first EOD
    assert not torch.allclose(run(torch_model, tokens, labels)[0][0, 6:], ref[0][0, 6:], atol=1e-3)


def test_dropout_matches_megatron_in_expectation(mp1):
    """attention_dropout is applied in training only (SDPA's dropout_p), off in eval."""
    cfg = model_config("vanilla")
    cfg.attention_dropout = 0.5
    model = build_gpt(cfg, transformer_config(cfg), backend="torch")
    tokens, _ = batch()
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    with torch.no_grad():
        a, b = model(tokens, pos, None), model(tokens, pos, None)
        model.eval()
        c, d = model(tokens, pos, None), model(tokens, pos, None)
    assert not torch.allclose(a, b)
    torch.testing.assert_close(c, d)


# ----------------------------------------------------------------------------- checkpoints
def test_local_checkpoint_loads_on_torch(mp1, tmp_path):
    from megatron.core import dist_checkpointing

    cfg = model_config("kv_shift")
    tc = transformer_config(cfg)
    local = build_gpt(cfg, tc, seed=3, backend="local")
    with torch.no_grad():  # coefficients away from their init
        for name, p in local.named_parameters():
            if "shift" in name:
                p.copy_(torch.randn_like(p))
    dist_checkpointing.save(local.sharded_state_dict(), str(tmp_path))
    torch_model = build_gpt(cfg, tc, seed=4, backend="torch")
    torch_model.load_state_dict(dist_checkpointing.load(torch_model.sharded_state_dict(),
                                                        str(tmp_path)))
    tokens, _ = batch()
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    with torch.no_grad():
        expected = local(tokens, pos, None, runtime_gather_output=True)
        torch.testing.assert_close(torch_model(tokens, pos, None, runtime_gather_output=True),
                                   expected, **TOL)


# ----------------------------------------------------------------------------- TP + SP, PP
def tp_sp_case(rank: int, world: int, attention: str, state: dict, tokens, labels):
    """(logits, loss, this rank's grads, their partition dims) of a torch model at
    TP=2 with SP."""
    from tests.model.test_parallel import load_full

    cfg = model_config(attention)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(tensor=world,
                                                                  sequence_parallel=True)),
                      backend="torch")
    load_full(model, state, rank, world)
    logits, loss, grads = run(model, tokens, labels)
    dims = {}
    for name, p in model.named_parameters():
        if getattr(p, "sequence_parallel", False):
            dist.all_reduce(grads[name])  # what finalize_model_grads does for SP norms
        dims[name] = p.partition_dim if getattr(p, "tensor_model_parallel", False) else None
    return logits, loss, grads, dims


def parallel_worker(rank: int, world: int, states: dict, tokens, labels):
    """Every multi-rank case in one launch: TP=2 + SP per attention, then a PP=2 loss."""
    from megatron.core import parallel_state

    from kvtrain.backend import init_model_parallel, set_seed
    from tests.model.test_parallel import load_full

    init_model_parallel(tensor=world)
    set_seed(0)
    out = {a: tp_sp_case(rank, world, a, states[a], tokens, labels)
           for a in ("vanilla", "kv_shift")}
    init_model_parallel(pipeline=world)
    set_seed(0)
    cfg = model_config("kv_shift", layers=4)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(pipeline=world)),
                      backend="torch")
    stage = parallel_state.get_pipeline_model_parallel_rank()
    load_full(model, states["pp"], 0, 1, layer_offset=stage * cfg.num_layers // world)
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    out["pp"] = pipeline_loss(model, tokens, labels, pos)
    return out


def pipeline_loss(model, tokens, labels, pos):
    """Mean loss over 2 micro batches through megatron's 1F1B schedule (last stage only)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = iter(zip(tokens.chunk(2), labels.chunk(2), pos.chunk(2)))

    def forward_step(data_iterator, chunk):
        tok, lab, p = next(data_iterator)
        return chunk(tok, p, None, labels=lab), lambda out: (out.mean(), {"loss": out.mean()})

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=2,
        seq_length=SEQ, micro_batch_size=BATCH // 2, forward_only=False)
    return torch.stack([r["loss"] for r in results]).mean().item() if results else None


@pytest.mark.slow
def test_tp2_sp_and_pp2_torch_equal_local_tp1(mp1):
    tokens, labels = batch()
    refs, states = {}, {}
    for attention in ("vanilla", "kv_shift"):
        local = build_gpt(model_config(attention), transformer_config(model_config(attention)),
                          backend="local")
        states[attention] = {k: v.detach().clone() for k, v in local.state_dict().items()
                             if "_extra_state" not in k}
        refs[attention] = run(local, tokens, labels)
    deep = model_config("kv_shift", layers=4)
    local = build_gpt(deep, transformer_config(deep), backend="local")
    states["pp"] = {k: v.detach().clone() for k, v in local.state_dict().items()
                    if "_extra_state" not in k}
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    pp_ref = pipeline_loss(local, tokens, labels, pos)
    ranks = run_distributed(parallel_worker, 2, states, tokens, labels)
    for rank, out in enumerate(ranks):
        for attention in ("vanilla", "kv_shift"):
            logits, loss, grads, dims = out[attention]
            ref_logits, ref_loss, ref_grads = refs[attention]
            torch.testing.assert_close(logits, ref_logits, **TOL)
            torch.testing.assert_close(loss, ref_loss, **TOL)
            assert (attention == "kv_shift") == any("shift" in n for n in grads)
            for name, g in grads.items():
                param = SimpleNamespace(tensor_model_parallel=dims[name] is not None,
                                        partition_dim=dims[name])
                expected = shard(name, ref_grads[name], param, rank, 2)
                assert_close_to_scale(g, expected, TOL["rtol"], msg=name)
    assert ranks[0]["pp"] is None
    assert ranks[1]["pp"] == pytest.approx(pp_ref, abs=1e-5)


# ----------------------------------------------------------------------------- FlexAttention
def test_flex_block_mask_equals_explicit_mask():
    """The GPU path's document-causal block mask, run by eager FlexAttention on the CPU."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from kvtrain.model.attention import document_block_mask

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 256, 16, generator=gen)
    k, v = (torch.randn(2, 2, 256, 16, generator=gen) for _ in range(2))
    tokens = torch.randint(1, 50, (2, 256), generator=gen)
    tokens[0, 100] = tokens[1, 17] = tokens[1, 200] = 0
    packed = DocumentParams.from_ids(document_ids(tokens, 0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention warns that it is slow
        flex = flex_attention(q, k, v, block_mask=document_block_mask(packed.doc_ids),
                              scale=0.25, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=~packed.mask(), scale=0.25, enable_gqa=True)
    torch.testing.assert_close(flex, ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_documents_equal_sdpa_mask_on_gpu(dtype):
    """FlexAttention's block mask (compiled) gives SDPA-with-mask's output."""
    from kvtrain.model.attention import compiled_flex_attention, document_block_mask

    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(2, 2, 256, 64, device="cuda", dtype=dtype, generator=gen)
            for _ in range(2))
    tokens = torch.randint(1, 50, (2, 256), device="cuda", generator=gen)
    tokens[0, 100] = tokens[1, 17] = tokens[1, 200] = 0
    packed = DocumentParams.from_ids(document_ids(tokens, 0))
    flex = compiled_flex_attention()(q, k, v, block_mask=document_block_mask(packed.doc_ids),
                                     scale=0.125, enable_gqa=True)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=~packed.mask(), scale=0.125, enable_gqa=True)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(flex, ref, **tol)


def test_bf16_torch_close_to_local(mp1):
    from kvtrain.model.builder import Numerics

    cfg = model_config("kv_shift")
    tc = transformer_config(cfg, numerics=Numerics.from_precision("bf16"))
    local = build_gpt(cfg, tc, backend="local")
    torch_model = build_gpt(cfg, tc, seed=9, backend="torch")
    torch_model.load_state_dict(local.state_dict())
    tokens, labels = batch()
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    with torch.no_grad():
        a = local(tokens, pos, None, labels=labels)
        b = torch_model(tokens, pos, None, labels=labels)
    assert a.dtype == b.dtype == torch.float32  # megatron's loss is fp32
    torch.testing.assert_close(b, a, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["vanilla", "kv_shift"])
def test_torch_equals_local_on_gpu_with_documents(mp1, attention):
    """On a GPU: SDPA's flash kernels and the compiled FlexAttention path (documents)."""
    cfg = model_config(attention, hidden=128)  # head dim 32: Triton's flex kernels want >= 16
    tc = transformer_config(cfg)
    local = build_gpt(cfg, tc, backend="local").cuda()
    torch_model = build_gpt(cfg, tc, seed=77, backend="torch").cuda()
    torch_model.load_state_dict(local.state_dict())
    assert torch_model.decoder.layers[0].self_attention.core_attention.documents_kernel == "flex"
    tokens, labels = (t.cuda() for t in batch(5))
    tokens[0, 5] = tokens[1, 3] = 0
    ids = document_ids(tokens, 0)
    for packed in (None, "documents"):
        ref = run(local, tokens, labels, packed and DocumentParams.from_ids(ids))
        got = run(torch_model, tokens, labels, packed and DocumentParams.from_ids(ids))
        torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
        for name in ref[2]:  # to each gradient's size: an absolute 1e-4 checks few here
            assert_close_to_scale(got[2][name], ref[2][name], 1e-4, msg=name)


@pytest.mark.gpu
def test_on_a_gpu_attention_keeps_the_value_where_it_says_so(mp1):
    """The same on a GPU in bf16, MHA and GQA: SDPA's flash kernels keep their inputs;
    for documents so does compiled FlexAttention, whose saved tensors are its compiler's
    choice (on an H200 with torch 2.11 it kept them where ``keeps_value`` said it did
    not: the QKV node then gave its gradient a buffer of its own)."""
    for groups in (4, 2):
        cfg = model_config("vanilla", groups, hidden=128)  # head dim 32: flex wants >= 16
        core = build_gpt(cfg, transformer_config(cfg), backend="torch").cuda() \
            .decoder.layers[0].self_attention.core_attention
        assert core.documents_kernel == "flex"
        for documents in (None, _documents("cuda")):
            kept = _value_kept(core, documents, "cuda", torch.bfloat16)
            assert kept == core.keeps_value(documents is not None), (groups, documents)


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("backend", ["torch", "local"])
def test_recompute_gives_the_gradients_of_none(mp1, backend, recompute):
    """parallel.recompute re-runs the core attention (selective) or whole layers
    (full) in backward with the documents captured from the forward, and the
    dropout mask drawn again from the saved RNG state: the same logits, loss and
    gradients (alpha/beta included) as no recompute, with and without packed
    documents, and with attention dropout in training."""
    from kvtrain.backend import set_seed

    cfg = model_config("kv_shift", shift=["k", "v"], window=2)
    cfg.attention_dropout = 0.25
    ref_model = build_gpt(cfg, transformer_config(cfg, ParallelConfig()), backend=backend)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(recompute=recompute)),
                      seed=77, backend=backend)
    model.load_state_dict(ref_model.state_dict())
    calls = {id(ref_model): 0, id(model): 0}  # the core attention's forwards, recomputed too
    for m in (ref_model, model):
        for layer in m.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(
                lambda *_, key=id(m): calls.__setitem__(key, calls[key] + 1))
    tokens, labels = batch(5)
    tokens[0, 5] = tokens[1, 3] = 0  # EOD = 0
    for packed in (None, DocumentParams.from_ids(document_ids(tokens, 0))):
        runs = []
        for m in (ref_model, model):
            set_seed(3)  # the dropout masks (megatron's RNG tracker): the same draws in both
            runs.append(run(m, tokens, labels, packed))
        assert_same(*runs)
        assert any("shift" in n and g.abs().sum() > 0 for n, g in runs[1][2].items())
    # per run: 2 forwards x 2 layers, and the backward's 2 recomputations
    assert (calls[id(ref_model)], calls[id(model)]) == (2 * 4, 2 * 6)
    set_seed(3)
    other = run(ref_model, tokens, labels)
    set_seed(4)
    assert not torch.allclose(run(ref_model, tokens, labels)[1], other[1])  # dropout is on
