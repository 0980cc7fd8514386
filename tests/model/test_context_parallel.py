"""Context parallelism on the torch backend gives the CP=1 results (gloo ranks).

The CP=1 reference is built here; one launch of 2 ranks runs every CP=2 case
(vanilla and KV shift, window 1 and 2, with and without packed documents, one
document starting exactly on a chunk boundary) plus the halo alone at CP=2;
one launch of 4 ranks runs TP=2 x CP=2 and the halo at CP=4.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.config.model import KVShiftConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.model.documents import DocumentParams, document_ids
from kvtrain.testing import run_distributed
from tests.asserts import assert_close_to_scale

from .test_parallel import load_full

pytestmark = pytest.mark.slow

SEQ, BATCH, VOCAB, EOD = 16, 2, 128, 127
# (attention, window, documents)
CASES = [("vanilla", 1, False), ("vanilla", 1, True)] + [
    ("kv_shift", w, docs) for w in (1, 2) for docs in (False, True)]


def model_config(attention: str, window: int = 1) -> ModelConfig:
    return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                       ffn_hidden_size=64, vocab_size=VOCAB, make_vocab_size_divisible_by=64,
                       max_position_embeddings=64, attention=attention, backend="torch",
                       kv_shift=KVShiftConfig(window=window))


def batch() -> dict:
    """Tokens with end-of-document tokens: at CP=2 the chunks are 4 tokens, and
    row 0's second document starts at 4 (a chunk boundary), row 1's at 6 and 10."""
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB - 1, (BATCH, SEQ + 1), generator=gen)
    tokens[0, 3] = EOD
    tokens[1, 5] = EOD
    tokens[1, 9] = EOD
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:],
            "position_ids": torch.arange(SEQ)[None].expand(BATCH, SEQ)}


def documents(tokens: torch.Tensor, on: bool):
    return DocumentParams.from_ids(document_ids(tokens, EOD)) if on else None


def run_model(model, b: dict, packed, total_tokens: int):
    """(logits, loss sum) of one forward each; backward of loss sum / all tokens."""
    logits = model(b["tokens"], b["position_ids"], None, packed_seq_params=packed).detach()
    if packed is not None:
        packed.cache.clear()
    loss = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                 packed_seq_params=packed)  # [b, s]
    (loss.sum() / total_tokens).backward()
    return logits, loss.sum().detach()


# ----------------------------------------------------------------------------- reference
@pytest.fixture(scope="module")
def references(single_rank):
    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(1, 1)
    set_seed(1234)
    b = batch()
    out = {}
    for attention, window, docs in CASES:
        cfg = model_config(attention, window)
        ref = build_gpt(cfg, transformer_config(cfg), backend="torch")
        state = {k: v.detach().clone() for k, v in ref.state_dict().items()
                 if "_extra_state" not in k}
        logits, loss = run_model(ref, b, documents(b["tokens"], docs), BATCH * SEQ)
        grads = {n: p.grad.clone() for n, p in ref.named_parameters()}
        out[(attention, window, docs)] = (state, logits, loss, grads)
    return out


# ----------------------------------------------------------------------------- workers
def cp_case(group, tp: int, rank_tp: int, case, state, b):
    """(gathered logits, loss sum, full grads) of one case on this rank."""
    from megatron.core import parallel_state

    from kvtrain.model.context_parallel import gather_batch_sequence, split_micro_batch

    attention, window, docs = case
    cp = dist.get_world_size(group)
    cfg = model_config(attention, window)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(tensor=tp, context=cp)),
                      backend="torch")
    load_full(model, state, rank_tp, tp)
    local, packed = split_micro_batch(b, documents(b["tokens"], docs), group)
    logits, loss = run_model(model, local, packed, BATCH * SEQ)
    logits = gather_batch_sequence(logits, group)  # [b, S, V/TP]
    dist.all_reduce(loss, group=group)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=group)  # replicated over CP: the parts add up
        if tp > 1 and getattr(p, "tensor_model_parallel", False) and "shift" in name:
            parts = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(parts, g, group=parallel_state.get_tensor_model_parallel_group())
            g = torch.cat(parts, dim=p.partition_dim)
        grads[name] = g
    return logits, loss, grads


def halo_case(group, window: int, docs: bool, device: str = "cpu"):
    """(shifted local tokens, grads of x and coef) of the CP halo shift, and of
    the unsplit shift on the same data (every rank computes the reference):
    ``out`` against the kernel the CP=1 model runs (``fused_shift``, exact),
    ``math`` and the gradients against the plain math (``shift_tokens``)."""
    from kvtrain.model.context_parallel import slice_sequence
    from kvtrain.model.kv_shift import shift_tokens
    from kvtrain.model.kv_shift_cp import shift_context_parallel
    from kvtrain.model.shift_kernels import fused_shift

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(window)
    s = 4 * cp * window  # chunks of 2w tokens
    x = torch.randn(s, 2, 3, 4, generator=gen, dtype=torch.float64).to(device)  # [S, b, h, d]
    coef = torch.randn(3, window + 1, generator=gen, dtype=torch.float64).to(device)
    weight = torch.randn(s, 2, 3, 4, generator=gen, dtype=torch.float64).to(device)
    ids = None
    if docs:  # a document starting at every chunk boundary in row 0, mid-chunk in row 1
        ids = torch.zeros(2, s, dtype=torch.int32)
        ids[0] = torch.arange(s) // (2 * window)
        ids[1] = (torch.arange(s) + window // 2 + 1) // 3
        ids = ids.to(device)
    ref_x, ref_c = x.clone().requires_grad_(), coef.clone().requires_grad_()
    ref = shift_tokens(ref_x, ref_c, None if ids is None else ids.t())
    (ref * weight).sum().backward()
    mine_x = slice_sequence(x, cp, rank, dim=0).clone().requires_grad_()
    mine_c = coef.clone().requires_grad_()
    out = shift_context_parallel(mine_x, mine_c, group, ids)
    (out * slice_sequence(weight, cp, rank, dim=0)).sum().backward()
    dist.all_reduce(mine_c.grad, group=group)
    unsplit = fused_shift(x, coef, None if ids is None else ids.t())
    return {"out": (out.detach(), slice_sequence(unsplit, cp, rank, dim=0)),
            "math": (out.detach(), slice_sequence(ref.detach(), cp, rank, dim=0)),
            "x_grad": (mine_x.grad, slice_sequence(ref_x.grad, cp, rank, dim=0)),
            "coef_grad": (mine_c.grad, ref_c.grad)}


def attention_case(group, docs: bool, device: str = "cpu"):
    """TorchAttention at CP over this rank's chunks against SDPA over the whole
    sequence: (local output, reference), and the same for the q/k/v gradients."""
    import torch.nn.functional as F

    from kvtrain.model.attention import TorchAttention
    from kvtrain.model.context_parallel import slice_sequence
    from kvtrain.model.documents import document_causal_mask
    from megatron.core.transformer.enums import AttnMaskType

    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg = model_config("vanilla")
    attn = TorchAttention(transformer_config(cfg, ParallelConfig(context=cp)), 1,
                          AttnMaskType.causal, "self")
    gen = torch.Generator().manual_seed(3)
    s, b, heads, groups, hn = 8 * cp, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, n, hn, generator=gen).to(device)
               for n in (heads, groups, groups))  # [S, b, heads, hn]
    weight = torch.randn(s, b, heads * hn, generator=gen).to(device)
    ids = torch.arange(s).div(3, rounding_mode="floor").expand(b, s).contiguous().to(device)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    mask = ~document_causal_mask(ids) if docs else None  # [b, 1, S, S], True = attend
    ref = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in ref_in), attn_mask=mask, is_causal=not docs,
        enable_gqa=True).permute(2, 0, 1, 3).reshape(s, b, heads * hn)  # [S, b, np*hn]
    (ref * weight).sum().backward()
    mine_in = [slice_sequence(t, cp, rank, dim=0).clone().requires_grad_() for t in (q, k, v)]
    packed = None
    if docs:
        packed = DocumentParams.from_ids(slice_sequence(ids, cp, rank))
        packed.global_doc_ids = ids
    out = attn(*mine_in, None, packed_seq_params=packed)
    (out * slice_sequence(weight, cp, rank, dim=0)).sum().backward()
    result = {"out": (out.detach(), slice_sequence(ref.detach(), cp, rank, dim=0))}
    for name, mine, full in zip("qkv", mine_in, ref_in):
        result[f"d{name}"] = (mine.grad, slice_sequence(full.grad, cp, rank, dim=0))
    return result


def cp2_worker(rank, world, refs, b):
    from megatron.core import parallel_state

    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(context=world)
    set_seed(0)
    group = parallel_state.get_context_parallel_group()
    out = {case: cp_case(group, 1, 0, case, refs[case], b) for case in CASES}
    out["halo"] = {(w, docs): halo_case(group, w, docs) for w in (1, 2) for docs in (False, True)}
    out["attention"] = {docs: attention_case(group, docs) for docs in (False, True)}
    return out


def tp2_cp2_worker(rank, world, state, b):
    from megatron.core import parallel_state

    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(tensor=2, context=2)
    set_seed(0)
    group = parallel_state.get_context_parallel_group()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    _, loss, grads = cp_case(group, 2, tp_rank, ("kv_shift", 1, True), state, b)
    shift_grads = {n: g for n, g in grads.items() if "shift" in n}
    init_model_parallel(context=world)  # CP=4 over all ranks for the halo alone
    group = parallel_state.get_context_parallel_group()
    halo = {(w, docs): halo_case(group, w, docs) for w in (1, 2) for docs in (False, True)}
    return loss, shift_grads, halo


@pytest.fixture(scope="module")
def cp2(references):
    refs = {case: value[0] for case, value in references.items()}
    return run_distributed(cp2_worker, 2, refs, batch())


@pytest.fixture(scope="module")
def tp2_cp2(references):
    return run_distributed(tp2_cp2_worker, 4, references[("kv_shift", 1, True)][0], batch())


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-w{c[1]}-{'docs' if c[2] else 'nodocs'}")
def test_cp2_equals_cp1(references, cp2, case):
    _, ref_logits, ref_loss, ref_grads = references[case]
    for per_rank in cp2:
        logits, loss, grads = per_rank[case]
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        assert sorted(grads) == sorted(ref_grads)
        assert sum("shift" in n for n in grads) == (4 if case[0] == "kv_shift" else 0)
        for name, g in grads.items():
            # relative to each gradient's size: some are ~1e-7 at init
            assert_close_to_scale(g, ref_grads[name], 1e-5, msg=name)


def test_tp2_cp2_equals_tp1_cp1(references, tp2_cp2):
    _, _, ref_loss, ref_grads = references[("kv_shift", 1, True)]
    for loss, shift_grads, _ in tp2_cp2:
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        assert len(shift_grads) == 4
        for name, g in shift_grads.items():
            # relative to each gradient's size: some are ~1e-7 at init
            assert_close_to_scale(g, ref_grads[name], 1e-5, msg=name)


@pytest.mark.parametrize("cp", [2, 4])
def test_halo_matches_unsplit_shift(cp2, tp2_cp2, cp):
    per_rank = [r["halo"] for r in cp2] if cp == 2 else [r[2] for r in tp2_cp2]
    for halo in per_rank:
        assert len(halo) == 4
        for key, result in halo.items():
            out, ref = result["out"]
            assert torch.equal(out, ref), key  # forward exact
            for name in ("math", "x_grad", "coef_grad"):
                torch.testing.assert_close(*result[name], atol=1e-6, rtol=1e-6, msg=f"{key} {name}")


def test_torch_cp_attention_matches_full_sdpa(cp2):
    for per_rank in cp2:
        for docs, result in per_rank["attention"].items():
            for name, (mine, ref) in result.items():
                torch.testing.assert_close(mine, ref, atol=1e-5, rtol=1e-5, msg=f"{docs} {name}")
