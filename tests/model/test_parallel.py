"""Tensor, sequence and pipeline parallelism give the single-rank results.

The TP=1 / PP=1 model is built here; 2 gloo ranks (kvtrain.testing) build the
parallel one and load the same weights, each rank slicing its shard by the
parameter's megatron partition attributes.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from kvtrain.config import ModelConfig, ParallelConfig
from kvtrain.model.builder import build_gpt, transformer_config
from kvtrain.testing import run_distributed
from tests.asserts import assert_close_to_scale

pytestmark = pytest.mark.slow

SEQ, BATCH, VOCAB = 16, 4, 128


def model_config(attention="kv_shift", groups=2, layers=2):
    # vocab 128 with divisible_by 64: the padded vocabulary is 128 at TP=1 and TP=2
    return ModelConfig(num_layers=layers, hidden_size=32, num_attention_heads=4,
                       num_query_groups=groups, ffn_hidden_size=64, vocab_size=VOCAB,
                       make_vocab_size_divisible_by=64, max_position_embeddings=64,
                       attention=attention)


def batch():
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def shard(name: str, full: torch.Tensor, param: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This TP rank's slice of a full (TP=1) tensor."""
    if not getattr(param, "tensor_model_parallel", False) or tp == 1:
        return full
    if "linear_fc1" in name:  # SwiGLU: [gate; up], each split over TP
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]])
    return full.chunk(tp, dim=param.partition_dim)[rank]


def global_layer_name(name: str, offset: int) -> str:
    parts = name.split(".")
    if parts[:2] == ["decoder", "layers"]:
        parts[2] = str(int(parts[2]) + offset)
    return ".".join(parts)


def load_full(model, full_state, rank, tp, layer_offset=0):
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(shard(name, full_state[global_layer_name(name, layer_offset)], p, rank, tp))


def forward_backward(model, tokens, labels):
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    loss = model(tokens, pos, None, labels=labels)  # [b, s] per-token loss
    loss.mean().backward()
    return loss.detach()


# ----------------------------------------------------------------------------- TP (+SP)
TP_CASES = [(attention, sp) for attention in ("kv_shift", "vanilla") for sp in (False, True)]


def tp_case(rank, world, attention, sp, full_state, tokens, labels):
    """(logits, loss, grads of the shift scalars and norms) of one TP=2 model."""
    from kvtrain.backend import set_seed

    set_seed(0)
    cfg = model_config(attention)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(tensor=world, sequence_parallel=sp)))
    load_full(model, full_state, rank, world)
    pos = torch.arange(SEQ)[None].expand_as(tokens)
    logits = model(tokens, pos, None, runtime_gather_output=True).detach()  # [b, s, vocab]
    loss = forward_backward(model, tokens, labels)
    if sp:
        # SP norms' weight grads are partial per rank; megatron's finalize_model_grads
        # all-reduces them over TP (what the trainer does after backward).
        for p in model.parameters():
            if getattr(p, "sequence_parallel", False):
                dist.all_reduce(p.grad)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        if getattr(p, "tensor_model_parallel", False) and "shift" in name:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous())
            g = torch.cat(parts, dim=p.partition_dim)
        if "shift" in name or "layernorm" in name:
            grads[name] = g.clone()
    return logits, loss, grads


def tp_worker(rank, world, states, tokens, labels):
    """Every TP case in one launch of 2 ranks (a launch costs more than the cases),
    plus the error of a KV-shift model whose groups do not divide over TP."""
    from kvtrain.backend import init_model_parallel

    init_model_parallel(tensor=world)
    out = {case: tp_case(rank, world, *case, states[case[0]], tokens, labels) for case in TP_CASES}
    cfg = model_config("kv_shift", groups=1)
    try:
        build_gpt(cfg, transformer_config(cfg, ParallelConfig(tensor=world)))
        out["gqa_error"] = None
    except ValueError as e:
        out["gqa_error"] = str(e)
    return out


@pytest.fixture(scope="module")
def tp_runs(single_rank):
    """(TP=1 reference per attention, per-rank TP=2 results of every case)."""
    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(1, 1)
    set_seed(1234)
    tokens, labels = batch()
    refs, states = {}, {}
    for attention in ("kv_shift", "vanilla"):
        cfg = model_config(attention)
        ref = build_gpt(cfg, transformer_config(cfg))
        states[attention] = {k: v.detach().clone() for k, v in ref.state_dict().items()
                             if "_extra_state" not in k}
        logits = ref(tokens, torch.arange(SEQ)[None].expand_as(tokens), None,
                     runtime_gather_output=True).detach()
        loss = forward_backward(ref, tokens, labels)
        refs[attention] = (logits, loss, {n: p.grad for n, p in ref.named_parameters()})
    return refs, run_distributed(tp_worker, 2, states, tokens, labels)


@pytest.mark.parametrize("sp", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("attention", ["kv_shift", "vanilla"])
def test_tp2_equals_tp1(tp_runs, sp, attention):
    refs, per_rank = tp_runs
    ref_logits, ref_loss, ref_grads = refs[attention]
    for results in per_rank:
        logits, loss, grads = results[(attention, sp)]
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
        checked = [n for n in grads if "shift" in n]
        assert len(checked) == (4 if attention == "kv_shift" else 0)
        for name, g in grads.items():
            # relative to each gradient's size: some are ~1e-7 at init
            assert_close_to_scale(g, ref_grads[name], 1e-5, msg=name)


def test_kv_groups_must_divide_by_tp(tp_runs):
    for results in tp_runs[1]:
        message = results["gqa_error"]
        assert message and "num_query_groups=1" in message and "tensor-parallel size (2)" in message


# ----------------------------------------------------------------------------- PP
def pipeline_loss(model_chunks, tokens, labels, microbatches):
    """Mean loss through megatron's schedule (1F1B for PP > 1)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    micro = list(zip(tokens.chunk(microbatches), labels.chunk(microbatches)))
    data = iter(micro)

    def forward_step(data_iterator, model):
        tok, lab = next(data_iterator)
        out = model(tok, torch.arange(SEQ)[None].expand_as(tok), None, labels=lab)

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"loss": loss.detach()}

        return out, loss_func

    results = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data, model=model_chunks,
        num_microbatches=microbatches, seq_length=SEQ,
        micro_batch_size=BATCH // microbatches, forward_only=False,
    )
    if not results:
        return None  # not the last stage
    return torch.stack([r["loss"] for r in results]).mean()


def pp_worker(rank, world, attention, full_state, tokens, labels):
    from megatron.core import parallel_state

    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(pipeline=world)
    set_seed(0)
    cfg = model_config(attention, layers=4)
    model = build_gpt(cfg, transformer_config(cfg, ParallelConfig(pipeline=world)))
    stage = parallel_state.get_pipeline_model_parallel_rank()
    load_full(model, full_state, 0, 1, layer_offset=stage * cfg.num_layers // world)
    loss = pipeline_loss([model], tokens, labels, microbatches=2)
    return None if loss is None else loss.item()


@pytest.mark.parametrize("attention", ["kv_shift"])
def test_pp2_equals_pp1(mp1, attention):
    cfg = model_config(attention, layers=4)
    ref = build_gpt(cfg, transformer_config(cfg))
    full_state = {k: v.detach().clone() for k, v in ref.state_dict().items() if "_extra_state" not in k}
    tokens, labels = batch()
    ref_loss = pipeline_loss([ref], tokens, labels, microbatches=2).item()
    first, last = run_distributed(pp_worker, 2, attention, full_state, tokens, labels)
    assert first is None
    assert last == pytest.approx(ref_loss, abs=1e-6)
