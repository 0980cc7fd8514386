"""The text and JSON forms of a plan."""

from __future__ import annotations

from typing import Any

from kvtrain.config.backend import FLEX_MIN_HEAD_DIM, context_attention, document_attention
from kvtrain.config.schema import ModelConfig

from .flops import human_duration
from .layout import Plan
from .memory import GiB
from .params import human


def _loss(plan) -> str:
    """Which loss the logits' bytes assume: kvtrain's fused one keeps them alone."""
    from .memory import fused_loss

    if fused_loss(plan.cfg.model, plan.memory.attention):
        return "kvtrain's fused loss"
    return "megatron's loss, its fp32 copy included"


def _gib(x: float) -> str:
    return f"{x / GiB:6.1f} GiB"


def _attention_memory(plan: Plan) -> str:
    """Which backend the activation estimate assumed (kvtrain/plan/memory.py)."""
    backend = plan.cfg.model.backend
    if plan.memory.attention == "local":
        return (f"attention memory: local spec (model.backend {backend}): s x s scores "
                "materialised (torch softmax: fp32 scores + probabilities per layer)")
    assumed = "assumed (model.backend auto: a GPU cluster with Transformer Engine)" \
        if backend == "auto" else f"(model.backend {backend})"
    cp = plan.cfg.parallel
    cp = (f"; context parallel: {context_attention(plan.memory.attention, cp.cp_comm_type)}"
          if cp.context > 1 else "")
    if plan.memory.attention == "torch":
        docs = ""
        if plan.cfg.data.reset_attention_mask:
            docs = _document_attention(plan.cfg)
        return (f"attention memory: torch spec {assumed}: SDPA flash kernels, "
                f"no s x s scores{docs}{cp}")
    return f"attention memory: te spec {assumed}: flash attention, no s x s scores{cp}"


def _document_attention(cfg) -> str:
    """How the torch backend will separate documents on a GPU (the kernel the run
    records: ``kvtrain.config.backend.document_attention``), and what is not counted."""
    dropout, context = cfg.model.attention_dropout, cfg.parallel.context
    if document_attention("torch", True, dropout, context, cfg.model.head_dim) == "flex":
        return "; documents: FlexAttention block mask"
    if context > 1:  # TorchAttention._attend_context_parallel
        return ("; documents: SDPA with a [b, 1, s/(2 x CP), s] mask per chunk and layer "
                "(not counted: context parallelism)")
    why = ("attention_dropout > 0" if dropout > 0 else
           f"heads of {cfg.model.head_dim} < {FLEX_MIN_HEAD_DIM} channels")
    return f"; documents: SDPA with a [b, 1, s, s] mask per micro batch (not counted: {why})"


def describe_attention(m: ModelConfig) -> str:
    """The attention variant of model ``m`` in words (shift options, MLA shape)."""
    attention = "KV shifting attention" if m.attention == "kv_shift" else "vanilla attention"
    if m.attention == "kv_shift":
        attention += f" (shift {'+'.join(m.kv_shift.shift)}, window {m.kv_shift.window}, " \
                     f"{m.kv_shift.mode})"
        if m.kv_shift.heads is not None:
            hs = m.kv_shift.heads
            selected = {t: getattr(hs, t) for t in m.kv_shift.shift}
            # a shifted tensor the selection leaves null is shifted in every head
            picked = ", ".join(f"{t} all heads" if h is None else f"{t} heads {h}"
                               for t, h in selected.items()) \
                if any(h is not None for h in selected.values()) else ""
            attention += f" [{picked or 'all heads'}{', fixed (0, 1)' if hs.fixed else ''}]"
    if m.mla is not None:
        q = f"query rank {m.mla.q_lora_rank}" if m.mla.q_lora_rank else "full-rank query"
        attention += (f", multi-latent attention (K/V latent {m.mla.kv_lora_rank}, {q}, "
                      f"head dims {m.mla.qk_head_dim}+{m.mla.qk_pos_emb_head_dim} RoPE / "
                      f"V {m.mla.v_head_dim})")
    return attention


def render(plan: Plan, source: str = "") -> str:
    cfg = plan.cfg
    m, p, t = cfg.model, cfg.parallel, cfg.train
    pc = plan.params
    mem = plan.memory
    kv = m.kv_heads
    heads = f"{m.num_attention_heads} heads" + (
        f" ({kv} KV heads, GQA)" if kv != m.num_attention_heads else "")
    attention = describe_attention(m)
    lines = [
        f"plan for {source or cfg.name}: {cfg.name}, {attention}",
        "",
        f"model        {m.num_layers} layers, hidden {m.hidden_size}, {heads}, FFN {m.ffn_size}, "
        f"vocab {m.vocab_size} (padded {pc.vocab_padded}), "
        f"{'untied' if m.untie_embeddings else 'tied'} embeddings, seq {t.seq_length}",
        f"parameters   {human(pc.total)} total = {human(pc.non_embedding)} non-embedding + "
        f"{human(pc.embedding)} embedding ({human(pc.input_embedding)} input"
        + (f" + {human(pc.output_layer)} output layer)" if pc.output_layer else ", tied)")
        + (f"; KV shift adds {pc.kv_shift}" if pc.kv_shift else ""),
        f"             {pc.total:,} exactly; {mem.params:,} on the busiest GPU (stage {mem.stage})",
        f"cluster      {plan.world} x {plan.gpu.name} = {plan.nodes} node(s) x "
        f"{plan.gpus_per_node}; {plan.peak[0]:g} TFLOP/s {plan.peak[1]} and "
        f"{plan.gpu.memory_gib:.0f} GiB each",
        f"layout       TP {p.tensor} x PP {p.pipeline}"
        + (f" (virtual {p.virtual_pipeline})" if p.virtual_pipeline else "")
        + f" x CP {p.context} x DP {plan.dp}; sequence parallel "
        f"{'on' if p.sequence_parallel else 'off'}, distributed optimizer "
        f"{'on' if p.distributed_optimizer else 'off'}, recompute {p.recompute}, "
        f"precision {t.precision}",
        f"batch        global {t.global_batch_size} sequences = micro {t.micro_batch_size} x DP "
        f"{plan.dp} x {plan.num_microbatches} accumulation = {plan.tokens_per_step:,} tokens "
        f"({plan.tokens_per_step / 2**20:.2f} Mi) per step",
        f"steps        {plan.steps:,} (from {plan.steps_from}: "
        + (f"{t.train_tokens:,} tokens" if plan.steps_from == "train.train_tokens"
           else f"{t.max_steps:,}")
        + f"); {human(plan.total_tokens)} tokens in all; warmup {cfg.optimizer.lr_warmup_steps}, "
        f"lr {cfg.optimizer.lr:g} {cfg.optimizer.lr_schedule}",
        "",
        f"memory per GPU (estimate for stage {mem.stage} of {p.pipeline}; Korthikanti et al. 2022 "
        "activations, Megatron distributed-optimizer states: kvtrain/plan/memory.py)",
        f"  weights        {_gib(mem.weights)}",
        f"  gradients      {_gib(mem.grads)}   (fp32 main grads)",
        f"  optimizer      {_gib(mem.optimizer)}   (fp32 params + Adam m, v"
        + ((f"; sharded over DP {plan.dp}" + (f" x CP {p.context})" if p.context > 1 else ")"))
           if p.distributed_optimizer else "; not sharded)"),
        f"  activations    {_gib(mem.activations)}   ({mem.in_flight:g} micro batch"
        f"{'es' if mem.in_flight != 1 else ''} of "
        f"{t.micro_batch_size} x {t.seq_length}"
        + (f" (a 1/{p.context} share per CP rank)" if p.context > 1 else "")
        + f" in flight, recompute {mem.recompute}"
        + (f"; logits {mem.logits / GiB:.1f} GiB, {_loss(plan)}" if mem.logits else "") + ")",
        f"  overhead       {_gib(mem.overhead)}   (CUDA context, NCCL, workspaces, fragmentation)",
        f"  total          {_gib(mem.total)}   of {plan.gpu.memory_gib:.0f} GiB "
        f"({mem.total / (plan.gpu.memory_gib * GiB):.0%})",
        "  alternatives   " + ", ".join(f"{k}: {v / GiB:.1f} GiB"
                                        for k, v in mem.alternatives.items()),
        f"  {_attention_memory(plan)}",
        "",
        f"compute      {plan.flops.model:.3e} model FLOPs per step "
        f"({plan.flops.model / plan.tokens_per_step / 1e9:.2f} GFLOP per token: attention "
        f"{plan.flops.part('attention') / plan.flops.model:.1%}"
        + (f", KV shift {100 * plan.flops.part('kv_shift') / plan.flops.model:.2g}%"
           if plan.flops.part("kv_shift") else "")
        + ")"
        + (f"; {plan.flops.hardware:.3e} with the recomputed "
           + ("forward" if plan.flops.recompute == "full" else "core attention")
           if plan.flops.hardware != plan.flops.model else ""),
        f"time         at MFU {plan.mfu:g}: {plan.step_seconds:.2f} s per step, "
        f"{plan.tokens_per_step / plan.step_seconds / plan.world:,.0f} tokens/s per GPU, "
        f"{human_duration(plan.total_seconds)} for {plan.steps:,} steps "
        f"({plan.total_seconds / 86400:.2f} days, {plan.total_seconds * plan.world / 3600:,.0f} "
        "GPU hours)",
        _evaluation(plan),
    ]
    for w in plan.warnings:
        lines.append(f"warning      {w}")
    return "\n".join(lines)


def _evaluation(plan: Plan) -> str:
    """The validations' share of the time (forward-only passes, at the same MFU)."""
    t, sets = plan.cfg.train, len(plan.cfg.data.valid_sets)
    if not plan.evaluations:
        return "evaluation   none (train.eval_interval null)"
    named = f" x (1 + {sets} data.valid_sets)" if sets else ""
    return (f"evaluation   {plan.evaluations:,} validations x {t.eval_iters} batches{named}: "
            f"{human_duration(plan.eval_seconds)} more "
            f"({plan.eval_seconds / plan.total_seconds:.1%} of the training time)")


def as_dict(plan: Plan) -> dict[str, Any]:
    cfg = plan.cfg
    p, t = cfg.parallel, cfg.train
    mem = plan.memory
    return {
        "name": cfg.name,
        "attention": cfg.model.attention,
        "params": {"total": plan.params.total, "non_embedding": plan.params.non_embedding,
                   "embedding": plan.params.embedding, "kv_shift": plan.params.kv_shift,
                   "per_gpu": mem.params},
        "cluster": {"gpu": plan.gpu.name, "nodes": plan.nodes,
                    "gpus_per_node": plan.gpus_per_node, "gpus": plan.world},
        "layout": {"tensor": p.tensor, "pipeline": p.pipeline,
                   "virtual_pipeline": p.virtual_pipeline, "context": p.context,
                   "data": plan.dp, "sequence_parallel": p.sequence_parallel,
                   "distributed_optimizer": p.distributed_optimizer, "recompute": p.recompute},
        "batch": {"micro": t.micro_batch_size, "global": t.global_batch_size,
                  "accumulation": plan.num_microbatches, "tokens_per_step": plan.tokens_per_step},
        "steps": plan.steps,
        "steps_from": plan.steps_from,
        "memory_gib": {"weights": mem.weights / GiB, "grads": mem.grads / GiB,
                       "optimizer": mem.optimizer / GiB, "activations": mem.activations / GiB,
                       "overhead": mem.overhead / GiB, "total": mem.total / GiB,
                       "stage": mem.stage, "card": plan.gpu.memory_gib,
                       "attention_backend": mem.attention,
                       "alternatives": {k: v / GiB for k, v in mem.alternatives.items()}},
        "flops_per_step": plan.flops.model,
        "hardware_flops_per_step": plan.flops.hardware,
        "mfu": plan.mfu,
        "peak_tflops": plan.peak[0],
        "step_seconds": plan.step_seconds,
        "days": plan.total_seconds / 86400,
        "evaluations": plan.evaluations,
        "eval_seconds": plan.eval_seconds,
        "warnings": plan.warnings,
    }
