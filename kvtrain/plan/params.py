"""Parameter counts of a kvtrain model, analytically, per component and per rank.

The model is megatron's GPTModel as ``kvtrain.model.builder.build_gpt`` makes
it: Llama style, no biases. With ``h`` hidden, ``a`` query heads of ``d = h/a``
dims, ``g`` KV heads, ``f`` the SwiGLU inner size, ``V`` the padded vocabulary
and ``L`` layers:

* per layer: QKV ``h·(h + 2·g·d)``, output projection ``h·h``, SwiGLU
  ``h·2f + f·h``, two RMSNorm weights ``2·h``, and for KV shifting
  ``g·n`` coefficients per shifted tensor (``n = w+1`` free/clamp, ``w`` gate);
* input embedding ``V·h``, output layer ``V·h`` (none when tied), final norm ``h``.

With ``model.mla`` the attention terms are MLA's (``ModelConfig.attention_shape``:
query, K/V down and up projections, output ``n·d_v·h``, latent norms); per
rank they are counted as the backend's spec shards them: megatron's local spec
(``torch``, ``local``) splits every matrix over TP, its TE spec (``te``, and
``auto`` as the plan assumes) keeps the down projections whole on each rank
(``TELinear`` with ``parallel_mode='duplicated'``).

``V`` is the vocabulary padded to a multiple of ``make_vocab_size_divisible_by
× TP`` (megatron's rule, as in ``ModelConfig.padded_vocab_size``), so the embedding
grows slightly with TP. Per rank, TP splits every matrix, the embedding (by
vocabulary rows) and the KV-shift coefficients (by KV head); norms are
replicated. PP gives each stage ``L/PP`` layers; the first stage also holds the
input embedding, the last the final norm and the output layer (both, with tied
embeddings, hold a copy of the embedding).

The test ``tests/launch/test_paper_configs.py`` checks these numbers against a
GPTModel built on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from data_tools import units
from kvtrain.config.layout import shift_coefficients
from kvtrain.config.schema import ModelConfig, ParallelConfig


@dataclass(frozen=True)
class LayerParams:
    """Parameters of one transformer layer, by part (unsharded)."""

    qkv: int
    proj: int
    mlp: int
    norms: int
    kv_shift: int

    @property
    def matrices(self) -> int:
        return self.qkv + self.proj + self.mlp

    @property
    def total(self) -> int:
        return self.matrices + self.norms + self.kv_shift


def layer_params(model: ModelConfig) -> LayerParams:
    h = model.hidden_size
    f = model.ffn_size
    attn = model.attention_shape()  # standard or MLA (ModelConfig.attention_shape)
    return LayerParams(
        qkv=attn.projections,
        proj=attn.output,
        mlp=h * 2 * f + f * h,
        norms=2 * h + attn.latent_norms,
        kv_shift=model.kv_heads * shift_coefficients(model),
    )


@dataclass(frozen=True)
class ParamCounts:
    """Whole-model parameter counts (unsharded, TP-padded vocabulary)."""

    layer: LayerParams
    num_layers: int
    input_embedding: int
    output_layer: int  # 0 with tied embeddings
    final_norm: int
    vocab_padded: int

    @property
    def embedding(self) -> int:
        """Input embedding plus output layer (what ``count_parameters`` calls embedding)."""
        return self.input_embedding + self.output_layer

    @property
    def non_embedding(self) -> int:
        return self.num_layers * self.layer.total + self.final_norm

    @property
    def total(self) -> int:
        return self.embedding + self.non_embedding

    @property
    def kv_shift(self) -> int:
        return self.num_layers * self.layer.kv_shift

    @property
    def matmul(self) -> int:
        """Parameters that take part in a matrix multiply per token (6N's N):
        the layers' matrices and the output layer (tied or not), not the lookup."""
        return self.num_layers * self.layer.matrices + self.input_embedding


def count_params(model: ModelConfig, tensor_parallel: int = 1) -> ParamCounts:
    """Parameters of the whole model, with the vocabulary padded for ``tensor_parallel``."""
    v = model.padded_vocab_size(tensor_parallel)
    h = model.hidden_size
    return ParamCounts(
        layer=layer_params(model),
        num_layers=model.num_layers,
        input_embedding=v * h,
        output_layer=v * h if model.untie_embeddings else 0,
        final_norm=h,
        vocab_padded=v,
    )


def attention_backend(model: ModelConfig) -> str:
    """The backend the plan assumes: ``auto`` is ``te`` on a GPU cluster."""
    return "te" if model.backend == "auto" else model.backend


def duplicated_matrices(model: ModelConfig, backend: str) -> int:
    """Weights of one layer that every TP rank holds whole: MLA's down projections
    on ``te`` (megatron's TE spec builds them as ``TELinear``, which
    ``MLASelfAttention`` makes ``duplicated``; the local spec's are column-parallel)."""
    m = model.mla
    if m is None or backend != "te":
        return 0
    return model.hidden_size * (m.kv_lora_rank + m.qk_pos_emb_head_dim + (m.q_lora_rank or 0))


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one GPU of a pipeline stage (its TP shard)."""

    stage: int
    layers: int
    params: int
    embedding: int  # the embedding/output-layer part of ``params``


def stage_params(model: ModelConfig, parallel: ParallelConfig,
                 backend: Optional[str] = None) -> list[StageParams]:
    """Per-GPU parameters of every pipeline stage (all TP ranks of a stage hold the same count)
    on ``backend`` (None: the one the plan assumes, :func:`attention_backend`).

    Exact for megatron's layout when ``num_layers`` divides by PP (the config
    requires it): each stage builds ``L/PP`` layers.
    """
    t, p = parallel.tensor, parallel.pipeline
    counts = count_params(model, t)
    lp = counts.layer
    whole = duplicated_matrices(model, backend or attention_backend(model))
    per_layer = (lp.matrices - whole) // t + whole + lp.norms + lp.kv_shift // t
    layers = model.num_layers // p
    emb_shard = counts.input_embedding // t
    stages = []
    for s in range(p):
        first, last = s == 0, s == p - 1
        emb = 0
        if first:
            emb += emb_shard
        if last:
            # The output layer; with tied embeddings megatron keeps a copy of the
            # word embeddings on the last stage too (unless it is also the first).
            if model.untie_embeddings or not first:
                emb += emb_shard
        params = layers * per_layer + emb + (counts.final_norm if last else 0)
        stages.append(StageParams(stage=s, layers=layers, params=params, embedding=emb))
    return stages


def human(n: float, unit: str = "") -> str:
    """Parameter counts and token totals: 1234567 -> '1.235 M'."""
    return units.human(n, unit, digits=3, sep=" ")
