"""Per-GPU memory estimate of a training layout: model states plus activations.

Model states (bytes per parameter held by the GPU; Megatron-LM's
``docs/source/api-guide/dist_optimizer.md`` table, ``d`` = data-parallel size):

==========================  =======  =====  ====================  =============
precision                   weights  grads  optimizer             total
==========================  =======  =====  ====================  =============
bf16/fp16 (fp32 main grads)  2        4      12 (fp32 copy, m, v)  6 + 12/d dist.
fp32                         4        4      8  (m, v)             8 + 8/d dist.
==========================  =======  =====  ====================  =============

The optimizer column is divided by ``d`` only with the distributed optimizer
(ZeRO-1); without it every rank keeps all of it. Gradients are counted in
fp32, as megatron accumulates and reduces them for bf16 runs.

Activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", arXiv:2205.05198, §4), adapted to a Llama layer:
Korthikanti count ``sbh(34 + 5as/h)`` bytes per GPT layer (16-bit, LayerNorm,
GeLU MLP of 4h, dropout). For RMSNorm + GQA + SwiGLU(``f``) + fused (flash)
attention and no dropout, the tensors kept for the backward pass per token are,
in 16-bit elements:

* norm inputs and outputs (2 norms): ``4h``;
* Q, K, V after RoPE (what flash attention saves): ``h + 2·g·d``;
* attention output (input of the output projection): ``h``;
* SwiGLU: fc1 output ``2f`` and fc2 input ``f`` (kvtrain's one-node SwiGLU,
  ``kvtrain.model.swiglu``; megatron's eager one would keep ``5f``);

that is ``2·sb·(6h + 2gd + 3f)`` bytes, plus flash attention's fp32
log-sum-exp (``4·a·sb``). Where attention keeps its V input as given (SDPA on
the ``torch`` backend; megatron's local attention with MHA), vanilla's V, a
view of the QKV output, keeps all of it: ``h + gd`` more (Q and K of the
projection). For KV shifting, the paper's K+V shift (one node in the QKV
output, ``fused_shift_qkv``) keeps a copy of the raw K and V for the
coefficient gradients, ``2gd`` (none for fixed coefficients), and lets the QKV
output go (attention keeps the shifted V, a tensor of its own); on a GPU the
``torch`` backend's node that also applies RoPE (``rope_in_the_split``) writes
the shifted V over the QKV output's query columns instead and keeps what
vanilla keeps, ``h + gd``, learned or fixed (tests/model/test_rope_attention.py,
in Triton's interpreter); the other
variants (Q shifted, one of K or V, context parallelism) save the raw
tensors as views of the QKV output, ``h + 2gd`` (``gd`` less where an unshifted
V is one of them), and with GQA a shifted Q as a copy, ``h``. The raw tensors
serve the coefficients' gradient alone, so with fixed coefficients
(``kv_shift.heads.fixed``) no variant keeps them. All measured with
``torch.autograd.graph.saved_tensors_hooks`` (tests/faults/test_backend_faults.py;
``benchmarks/shift_saved_bytes.py``). Flash attention stores no
``s×s`` matrix, so Korthikanti's ``5as/h`` term is absent (which is also why
``selective`` recomputation, megatron's core-attention recompute, saves
nothing here). With TP ``t``: the norm tensors (``4h``) are split only with
sequence parallel (Korthikanti eq. 4 vs 5); the rest is always split by ``t``.

Multi-latent attention (``model.mla``; ``n`` heads, K/V latent ``r``, query latent
``r_q`` or none, per head Q/K widths ``d_q = qk_head_dim + qk_pos_emb_head_dim``
and V width ``d_v``) keeps, in place of the standard Q, K, V and output:

* the K/V latent: the down projection's output ``r + d_pe``, held whole by the
  latent norm's input (a view of it that leaves out the RoPE key's columns), and
  the norm's output ``r`` (the up projection's input); with a query latent, its
  norm's input and output, ``2·r_q``. Like the layer norms, these are split by
  ``t`` only with SP (the local spec's SP scatter frees the ``d_pe`` columns; te's
  fused norm keeps them);
* attention's Q and K (``n·d_q`` each: RoPE'd part and the rest concatenated into
  tensors of their own), V (``n·d_v``, a contiguous copy of the up projection's
  view) and output ``n·d_v``, split by ``t``. Nothing holds the projections'
  per-head outputs, so they are freed;
* KV shifting (per tensor, every kernel): the shift saves its raw input, a copy
  of the key's no-RoPE part (``n·qk_head_dim``; a view would hold the RoPE key's
  columns too) for ``k`` and the unshifted V copy (``n·d_v``) for ``v``, also when
  ``kv_shift.heads`` selects a few heads (the shift runs on all of them), none
  with fixed coefficients;

that is ``2r + d_pe + 2r_q + n·(2d_q + 2d_v)`` plus ``n·d_q`` / ``n·d_v`` shifted,
and flash attention's log-sum-exp of ``n`` heads as above (``local``: the scores
of ``n`` heads instead). Measured against the standard layer
(tests/faults/test_backend_faults.py). MLA refuses context parallelism, so the
plan has no MLA CP case.

The ``local`` backend (megatron's own ``DotProductAttention``, no flash) keeps,
with GQA, K and V repeated to every query head (``2(h - gd)`` more than the
rotated K and V) and materialises the ``[b, a/t, s, s]`` scores: a buffer of
them in the activation
dtype (megatron's global memory buffer, one per GPU, reused by every layer), and
per layer what the backward pass keeps: the softmax's fp32 output (scores are
upcast, ``attention_softmax_in_fp32``), the probabilities in the activation dtype
that the ``A·V`` matmul saves (in fp32 that is the softmax output itself):
4 and 4 + 2 bytes per score, as measured with ``saved_tensors_hooks``
(tests/faults/test_backend_faults.py). With ``attention_dropout``, CUDA's fused
dropout adds a 1-byte mask and the matmul saves the dropped copy; there is no
log-sum-exp. This assumes megatron's torch softmax (no apex kernels;
apex's fused kernel would keep 2 bytes instead of 4 + 2, so it is an upper
bound there). ``selective`` recompute re-runs core attention, so it keeps no
scores: one layer's are rebuilt at a time. ``kvtrain plan`` assumes ``te``
for ``model.backend: auto`` (a GPU cluster with Transformer Engine).

The ``torch`` backend (PyTorch's SDPA: flash / cuDNN kernels on a GPU) keeps
what flash attention keeps, like ``te``: no ``s×s`` scores. Separated documents
(``data.reset_attention_mask``) use FlexAttention's block mask there, a few
bytes per 128×128 block. Two cases hold an explicit ``[b, 1, s, s]`` boolean
mask instead, one per micro batch shared by the layers (``b·s²`` bytes, not
counted: a GPU plan with ``attention_dropout > 0``, which FlexAttention lacks,
and the CPU path, which the plan does not cover); the report says so.

Full recomputation (megatron ``uniform``, one layer per checkpoint) keeps only
each layer's input, ``2·sbh`` bytes (``/t`` with SP), plus one layer's full
activations while that layer is recomputed in the backward pass.

Pipeline (1F1B): stage ``s`` keeps ``min(m, p - s)`` micro batches in flight,
so the first stage's activations are those of ``L/p · min(m, p)`` layers
(Korthikanti §4.2.3: ``L`` layers' worth when ``m ≥ p``). The interleaved schedule
(``v`` chunks of ``L/(p·v)`` layers per stage) keeps megatron's warm-up plus one,
``2(p-s-1) + (v-1)·p + 1`` chunk micro batches (at most all ``m·v``), i.e. that
``/ v`` micro batches of ``L/p`` layers: ``p + (p-1)/v`` on the first stage
(Korthikanti's ``1 + (p-1)/(p·v)`` growth), ``p - (p-1)/v`` on the last. The last
stage also keeps the logits: ``s·b·V/t`` in bf16 and, with megatron's cross-entropy, their fp32 copy
(its softmax, kept for the backward); kvtrain's fused loss (the ``torch`` and
``te`` backends' on a GPU) keeps the bf16 logits alone (``logit_bytes``).

Each model chunk (with MLA, each layer) also keeps RoPE's fp32 angles for the run
(megatron caches them) and, where kvtrain's Triton RoPE runs, their cos/sin table
(``rope_bytes``: 3 MiB at 2048 tokens and head dim 128 on the ``torch`` backend,
192 MiB at 128k).

Overhead: CUDA context, NCCL and cuBLAS/TE workspaces and allocator
fragmentation, taken as 3 GiB plus 5% of the rest. Expect real usage within
about ±15% of the estimate. One calibration point: the paper (Table 13)
measured 42,584 MiB peak for its BlaGPT-scale vanilla model at context 4096 on
an A100 and 43,360 MiB with KV shifting (4 KV heads); ``kvtrain plan
configs/blagpt/vanilla.yaml --gpus-per-node 1`` (one GPU: no optimizer sharding)
at 4096 tokens x 16 sequences with
megatron's loss, as the paper ran (``model.cross_entropy_kernel: torch``),
estimates 44,499 MiB (te; 4.5% above), 46,918 MiB with KV shifting (+2.4 GiB: the
raw K/V copy of 12 KV heads; the paper's layer has 4, and measured +776 MiB).
kvtrain's fused loss (``auto``) takes 12.9 GiB off the estimate at this 50k
vocabulary (31,294 MiB): the fp32 copy of 65,536 x 50,304 logits and its share of
the overhead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvtrain.config.schema import ModelConfig, ParallelConfig, TrainConfig

from .params import attention_backend, stage_params

GiB = 1024**3
OVERHEAD_FIXED = 3 * GiB
OVERHEAD_FRACTION = 0.05


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter of model states."""

    weights: float
    grads: float
    optimizer: float  # before division by DP


def state_bytes(precision: str) -> StateBytes:
    """``auto`` is bf16 on GPU (the plan is for GPU runs)."""
    if precision in ("auto", "bf16", "fp16"):
        return StateBytes(weights=2, grads=4, optimizer=12)
    return StateBytes(weights=4, grads=4, optimizer=8)


def activation_dtype_bytes(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def score_elements(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                   micro_batch: int) -> float:
    """Elements of one layer's ``[b, a/t, s/cp, s]`` attention scores on one GPU."""
    queries = seq_length / parallel.context
    return micro_batch * model.num_attention_heads / parallel.tensor * queries * seq_length


def score_bytes_kept(model: ModelConfig, precision: str) -> float:
    """Bytes per score element the local spec keeps for backward (module doc)."""
    e = activation_dtype_bytes(precision)
    dropout = model.attention_dropout > 0
    separate_probs = e if (precision != "fp32" or dropout) else 0
    return 4 + separate_probs + (1 if dropout else 0)


def layer_activation_bytes(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                           micro_batch: int, precision: str = "bf16", backend: str = "te",
                           keep_scores: bool = True) -> float:
    """Bytes one layer keeps for backward per micro batch, per GPU, without recompute
    (``keep_scores`` False: core attention recomputed, local backend)."""
    t = parallel.tensor
    sb = seq_length * micro_batch / parallel.context
    h = model.hidden_size
    gd = model.kv_heads * (h // model.num_attention_heads)
    f = model.ffn_size
    e = activation_dtype_bytes(precision)
    norms = 4 * h / (t if parallel.sequence_parallel else 1)
    if model.mla is None:
        # the local spec's attention repeats K and V to every query head (GQA) and
        # keeps those copies instead of the rotated K and V: 2(h - gd) more
        expanded = 2 * (h - gd) if backend == "local" else 0
        attention_elements = ((h + 2 * gd) + h + expanded
                              + kept_by_the_shift(model, parallel, backend, h, gd)) / t
    else:
        attention_elements = mla_attention_elements(model, parallel)
    elements = norms + attention_elements + 3 * f / t
    dropout_masks = sb * h * 2 / (t if parallel.sequence_parallel else 1) \
        if model.hidden_dropout > 0 else 0.0
    if backend == "local":
        attention = score_bytes_kept(model, precision) * score_elements(
            model, parallel, seq_length, micro_batch) if keep_scores else 0.0
    else:  # flash attention: the fp32 log-sum-exp per query and head
        attention = 4.0 * model.num_attention_heads / t * sb
    if backend == "torch" and parallel.context > 1:
        # the torch backend's CP attention saves the all-gathered K and V of the
        # whole sequence for backward (te's ring re-sends them instead)
        attention += e * seq_length * micro_batch * 2 * gd / t
    return e * sb * elements + attention + dropout_masks


def kept_by_the_shift(model: ModelConfig, parallel: ParallelConfig, backend: str, h: int,
                      gd: int) -> int:
    """Elements per token that attention's Q/K/V and the shift keep beyond the
    rotated Q, K and the V attention gets (``h + 2gd``, counted by the caller)."""
    gqa = model.kv_heads < model.num_attention_heads
    # Whether attention keeps its V input as given, a view that keeps the whole QKV
    # output: SDPA does, and megatron's local attention with MHA (with GQA it keeps an
    # expanded copy); te is counted without (see the calibration above).
    v_view = parallel.context == 1 and (backend == "torch" or (backend == "local" and not gqa))
    shift = model.kv_shift.shift
    if model.attention != "kv_shift":
        return h + gd if v_view else 0  # the QKV output's Q and K, held by V
    if parallel.context == 1 and sorted(shift) == ["k", "v"]:
        if rope_in_the_split(model, backend):  # the shifted V over the QKV output's Q
            return h + gd
        return 0 if model.kv_shift.fixed else 2 * gd  # the raw K/V copy (learned coefficients)
    if model.kv_shift.fixed:  # the shift keeps no input: only an unshifted V (a view) holds the output
        return h + gd if v_view and "v" not in shift else 0
    # The QKV output, held by the shift's raw views (V's share counted already where V
    # is not shifted and attention keeps it as a view); with GQA a shifted query is a
    # copy (megatron's reshape of its view cannot be one) that the shift keeps.
    pinned = h + 2 * gd - (gd if "v" not in shift and v_view else 0)
    return pinned + (h if "q" in shift and gqa else 0)


def rope_in_the_split(model: ModelConfig, backend: str) -> bool:
    """Whether a GPU run splits the QKV output and applies RoPE (and the K+V shift) in
    one node (``kvtrain.model.rope_attention``): the ``torch`` backend with kvtrain's
    Triton RoPE (``model.rope_kernel`` auto or triton; with TE installed too) and,
    for the shift, its Triton kernel (auto or triton); not with MLA."""
    return (backend == "torch" and model.rope_kernel != "torch" and model.mla is None
            and model.position_embedding == "rope"
            and model.kv_shift.kernel in ("auto", "triton"))


def mla_attention_elements(model: ModelConfig, parallel: ParallelConfig) -> float:
    """Elements per token that one MLA layer's attention keeps for backward on one
    GPU, besides the layer norm's input and output (module doc): the latents, the
    per-head Q, K, V and output, and what the KV shift keeps."""
    m = model.mla
    t = parallel.tensor
    # The K/V latent norm's input is a view of the down projection's output, which
    # holds the RoPE key's columns too; the up projections save the norms' outputs.
    latents = 2 * m.kv_lora_rank + m.qk_pos_emb_head_dim + 2 * (m.q_lora_rank or 0)
    heads = 2 * m.q_head_dim + 2 * m.v_head_dim  # Q, K; V and attention's output
    if model.attention == "kv_shift" and not model.kv_shift.fixed:
        # The per-tensor shift saves its input for the coefficient gradients (none
        # for fixed ones): a copy of the key's no-RoPE part, and the V copy that the
        # up projection's view was turned into.
        shift = model.kv_shift.shift
        heads += (m.qk_head_dim if "k" in shift else 0) + (m.v_head_dim if "v" in shift else 0)
    sp = t if parallel.sequence_parallel else 1  # the latents are replicated over TP
    return latents / sp + model.num_attention_heads * heads / t


def layer_input_bytes(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                      micro_batch: int, precision: str = "bf16") -> float:
    """The checkpointed input of one layer under full recompute."""
    sb = seq_length * micro_batch / parallel.context
    t = parallel.tensor if parallel.sequence_parallel else 1
    return activation_dtype_bytes(precision) * sb * model.hidden_size / t


def fused_loss(model: ModelConfig, backend: str) -> bool:
    """Whether a GPU run on ``backend`` takes kvtrain's fused loss
    (``kvtrain.model.cross_entropy.choose_cross_entropy``)."""
    kernel = model.cross_entropy_kernel
    return kernel == "triton" or (kernel == "auto" and backend != "local")


def logit_bytes(model: ModelConfig, precision: str, backend: str) -> int:
    """Bytes per logit at the loss's peak. kvtrain's fused loss (what a GPU run takes
    for ``model.cross_entropy_kernel: triton``, or ``auto`` on the ``torch`` and ``te``
    backends) keeps the logits alone; megatron's holds them and their fp32 copy, the
    softmax it keeps (fp32 logits are shifted in place: one tensor)."""
    act = activation_dtype_bytes(precision)
    if fused_loss(model, backend):
        return act
    return 4 if act == 4 else act + 4


def rope_bytes(model: ModelConfig, seq_length: int, backend: str, context: int = 1) -> int:
    """Bytes of one copy of RoPE's angles that megatron's ``RotaryEmbedding`` caches for
    the whole run (``lru_cache``): fp32 ``[s/cp, 1, 1, r]``, this context-parallel
    rank's rows (megatron caches the slice), and where kvtrain's Triton RoPE runs
    (``model.rope_kernel`` triton, or auto on the ``torch`` backend; never ``te``'s,
    whose slot holds TE's kernel) the cos/sin table kept on them, fp32 ``[s/cp, 2r]``
    (``triton_rope.cos_sin``): both 3 MiB at 2048 tokens and head dim 128, 192 MiB at
    128k. (With TE installed, a ``torch`` run whose layers do not rotate in their QKV
    split takes TE's kernel and keeps no table: counted anyway, an upper bound.) A GPT
    model chunk keeps one copy; MLA layers keep one each (:func:`rope_copies`)."""
    if model.position_embedding != "rope":
        return 0
    r = model.mla.qk_pos_emb_head_dim if model.mla is not None else \
        model.hidden_size // model.num_attention_heads
    angles = 4 * (seq_length // context) * r
    kernel = model.rope_kernel
    triton = model.mla is None and backend != "te" and (
        kernel == "triton" or (kernel == "auto" and backend == "torch"))
    return angles * (3 if triton else 1)


def rope_copies(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Copies of RoPE's angles one GPU keeps: one per model chunk (its ``GPTModel``'s
    ``RotaryEmbedding``), or with MLA one per layer (megatron's MLA layers each build
    their own), up to the 32 entries of the ``lru_cache`` they share."""
    p = parallel.pipeline
    if model.mla is not None:
        return min(model.num_layers // p, 32)
    return parallel.virtual_pipeline if parallel.virtual_pipeline and p > 1 else 1


def micro_batches_in_flight(parallel: ParallelConfig, num_microbatches: int,
                            stage: int) -> float:
    """Micro batches (of the stage's ``L/p`` layers) whose activations pipeline ``stage``
    keeps at its peak: megatron's warm-up forwards plus one (``schedules.py``
    ``get_pp_rank_microbatches``; groups of ``p`` micro batches per virtual stage)."""
    p, v = parallel.pipeline, parallel.virtual_pipeline
    if not v or p == 1:
        return float(min(num_microbatches, p - stage))  # 1F1B: stage s keeps p - s
    # interleaved: each in-flight chunk micro batch holds one of the stage's v chunks
    chunks = min(2 * (p - stage - 1) + (v - 1) * p + 1, num_microbatches * v)
    return chunks / v


def activation_bytes(model: ModelConfig, parallel: ParallelConfig, seq_length: int,
                     micro_batch: int, num_microbatches: int, recompute: str, stage: int = 0,
                     precision: str = "bf16", backend: str = "te") -> dict[str, float]:
    """Activation bytes of one GPU of pipeline ``stage`` under ``recompute`` on
    ``backend`` (``te``: flash attention; ``local``: s x s scores).

    Returns ``total`` and its parts: ``layers`` (kept layer activations),
    ``working`` (one recomputed layer, full recompute only), ``logits`` (last
    stage), ``rope`` (RoPE's angles and table: ``rope_bytes`` x ``rope_copies``),
    and ``in_flight`` (micro batches whose activations are kept).
    """
    p = parallel.pipeline
    layers = model.num_layers // p
    in_flight = micro_batches_in_flight(parallel, num_microbatches, stage)
    full = layer_activation_bytes(model, parallel, seq_length, micro_batch, precision, backend)
    working = 0.0
    if backend == "local":  # the score buffer (global memory buffer, activation dtype)
        working = activation_dtype_bytes(precision) * score_elements(
            model, parallel, seq_length, micro_batch)
    if recompute == "full":
        per_layer = layer_input_bytes(model, parallel, seq_length, micro_batch, precision)
        working += full  # one layer is recomputed at a time in the backward pass
    elif recompute == "selective" and backend == "local":  # core attention recomputed
        per_layer = layer_activation_bytes(model, parallel, seq_length, micro_batch, precision,
                                           backend, keep_scores=False)
        working += full - per_layer  # one layer's scores, rebuilt in the backward pass
    else:  # none / selective (the same with flash attention, see the module doc)
        per_layer = full
    logits = 0.0
    if stage == p - 1:
        t = parallel.tensor
        sb = seq_length * micro_batch / parallel.context
        logits = sb * model.padded_vocab_size(t) / t * logit_bytes(model, precision, backend)
    kept = layers * in_flight * per_layer
    angles = rope_copies(model, parallel) * rope_bytes(model, seq_length, backend,
                                                        parallel.context)
    return {"total": kept + working + logits + angles, "layers": kept, "working": working,
            "logits": logits, "rope": angles, "per_layer": per_layer, "in_flight": in_flight}


@dataclass
class MemoryEstimate:
    """Estimated peak bytes on the busiest GPU."""

    stage: int
    params: int  # parameters held by the GPU
    weights: float
    grads: float
    optimizer: float
    activations: float
    logits: float  # part of ``activations`` (last stage)
    in_flight: float  # micro batches whose activations the stage keeps
    overhead: float
    recompute: str
    distributed_optimizer: bool
    attention: str = "te"  # the backend assumed: te / torch (flash) or local (s x s scores)
    # Totals of the alternatives, for the report.
    alternatives: dict[str, float] = field(default_factory=dict)

    @property
    def states(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.states + self.activations + self.overhead


def _estimate(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dp: int,
              num_microbatches: int, recompute: str, distributed_optimizer: bool) -> MemoryEstimate:
    precision = train.precision
    sb = state_bytes(precision)
    backend = attention_backend(model)
    stages = stage_params(model, parallel, backend)
    # megatron's distributed optimizer shards its state over DP x CP
    shards = dp * parallel.context if distributed_optimizer else 1
    best: Optional[MemoryEstimate] = None
    for st in stages:
        acts = activation_bytes(model, parallel, train.seq_length, train.micro_batch_size,
                                num_microbatches, recompute, st.stage, precision, backend)
        opt = sb.optimizer * st.params / shards
        weights = sb.weights * st.params
        grads = sb.grads * st.params
        rest = weights + grads + opt + acts["total"]
        est = MemoryEstimate(
            stage=st.stage, params=st.params, weights=weights, grads=grads, optimizer=opt,
            activations=acts["total"], logits=acts["logits"],
            in_flight=acts["in_flight"],
            overhead=OVERHEAD_FIXED + OVERHEAD_FRACTION * rest,
            recompute=recompute, distributed_optimizer=distributed_optimizer,
            attention=backend,
        )
        if best is None or est.total > best.total:
            best = est
    assert best is not None
    return best


def estimate_memory(model: ModelConfig, parallel: ParallelConfig, train: TrainConfig, dp: int,
                    num_microbatches: int) -> MemoryEstimate:
    """The configured layout's estimate, with the totals of the alternatives attached
    (each recompute mode; with and without the distributed optimizer)."""
    est = _estimate(model, parallel, train, dp, num_microbatches, parallel.recompute,
                    parallel.distributed_optimizer)
    for mode in ("none", "selective", "full"):
        est.alternatives[f"recompute {mode}"] = _estimate(
            model, parallel, train, dp, num_microbatches, mode, parallel.distributed_optimizer
        ).total
    for dist in (True, False):
        est.alternatives[f"distributed optimizer {'on' if dist else 'off'}"] = _estimate(
            model, parallel, train, dp, num_microbatches, parallel.recompute, dist
        ).total
    return est
