"""From kvtrain's typed model config to megatron's ``TransformerConfig`` and ``GPTModel``.

``transformer_config`` is the one explicit translation of config keys into
megatron; ``build_gpt`` builds the model chunk of one pipeline (virtual) stage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core import parallel_state
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from kvtrain.config.schema import ModelConfig, ParallelConfig

from .cross_entropy import GPTModel
from .init_streams import own_streams, seeded_layer_spec
from . import rope
from .kv_shift import KVShiftOptions
from .specs import Backend, block_spec, fused_softmax_available, layer_spec, resolve_backend


@dataclass(frozen=True)
class Numerics:
    """Parameter/compute dtypes of a run (resolved from ``train.precision``)."""

    params_dtype: torch.dtype = torch.float32
    bf16: bool = False
    fp16: bool = False

    @classmethod
    def from_precision(cls, precision: str) -> "Numerics":
        if precision == "auto":
            precision = "bf16" if torch.cuda.is_available() else "fp32"
        if precision == "bf16":
            return cls(params_dtype=torch.bfloat16, bf16=True)
        if precision == "fp16":
            return cls(params_dtype=torch.float16, fp16=True)
        return cls()

    @property
    def precision(self) -> str:
        """The resolved ``train.precision``: bf16, fp16 or fp32."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


def kv_shift_options(model: ModelConfig, seed: int,
                     kernel: Optional[str] = None) -> KVShiftOptions:
    """The layer options of ``model.kv_shift``; ``kernel`` (resolved by the trainer,
    ``shift_kernels.choose_kernel``) overrides its ``kernel``."""
    ks = model.kv_shift
    heads = ()
    if ks.heads is not None:
        heads = tuple((t, tuple(getattr(ks.heads, t))) for t in ks.shift
                      if getattr(ks.heads, t) is not None)
    return KVShiftOptions(shift=tuple(ks.shift), window=ks.window, mode=ks.mode, seed=seed,
                          heads=heads, fixed=ks.fixed, kernel=kernel or ks.kernel)


def mla_settings(model: ModelConfig) -> dict:
    """``MLATransformerConfig`` fields of ``model.mla``: the ranks and head dims, and
    plain RoPE (base ``model.rotary_base``, no YaRN scaling: the App. H/J setting).

    ``rope_type="rope"`` with scaling factor 1 makes megatron's softmax scale the
    plain ``1/sqrt(qk_head_dim + qk_pos_emb_head_dim)`` (its YaRN mscale is 1
    for a factor <= 1). ``kv_channels`` is the value head width: megatron's local
    core attention sizes its output from it.
    """
    mla = model.mla
    return dict(q_lora_rank=mla.q_lora_rank, kv_lora_rank=mla.kv_lora_rank,
                qk_head_dim=mla.qk_head_dim, qk_pos_emb_head_dim=mla.qk_pos_emb_head_dim,
                v_head_dim=mla.v_head_dim, kv_channels=mla.v_head_dim, rope_type="rope",
                rotary_base=model.rotary_base, rotary_scaling_factor=1.0)


def transformer_config(
    model: ModelConfig,
    parallel: Optional[ParallelConfig] = None,
    numerics: Numerics = Numerics(),
    use_cpu_initialization: Optional[bool] = None,
    perform_initialization: bool = True,
    rope_fusion: bool = False,
) -> TransformerConfig:
    """The ``TransformerConfig`` of a Llama-style decoder (RMSNorm, SwiGLU, no biases).

    ``rope_fusion`` (``rope.choose_rope`` took ``triton`` or ``transformer_engine``):
    megatron applies RoPE with the kernel in its fused-RoPE slot, TE's, or kvtrain's
    where TE left it empty (``kvtrain.model.rope``); else with its torch ops."""
    parallel = parallel or ParallelConfig()
    if rope_fusion:
        rope.install()
    on_gpu = torch.cuda.is_available()
    if use_cpu_initialization is None:
        use_cpu_initialization = not on_gpu
    recompute = {
        "none": {},
        "selective": dict(recompute_granularity="selective"),
        "full": dict(recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=1),
    }[parallel.recompute]
    settings = dict(
        # shape
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        ffn_hidden_size=model.ffn_size,
        kv_channels=model.hidden_size // model.num_attention_heads,
        # Llama style
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_epsilon,
        gated_linear_unit=True,
        activation_func=F.silu,
        # the MLP runs the activation module of its spec (kvtrain's SwiGLU, in every
        # backend's spec: kvtrain.model.swiglu); megatron's flag predates other modules
        use_te_activation_func=True,
        add_bias_linear=False,
        add_qkv_bias=False,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        # parallelism
        tensor_model_parallel_size=parallel.tensor,
        pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline,
        context_parallel_size=parallel.context,
        cp_comm_type=parallel.cp_comm_type,  # te's CP attention; torch all-gathers K/V
        sequence_parallel=parallel.sequence_parallel,
        # numerics
        params_dtype=numerics.params_dtype,
        pipeline_dtype=numerics.params_dtype,
        bf16=numerics.bf16,
        fp16=numerics.fp16,
        # fused kernels exist only on GPU, some only with apex's build (seen
        # failing on an H200 without apex: masked_softmax_fusion)
        bias_activation_fusion=False,
        bias_dropout_fusion=on_gpu,
        masked_softmax_fusion=fused_softmax_available(),
        apply_rope_fusion=rope_fusion,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=use_cpu_initialization,
        perform_initialization=perform_initialization,
        **recompute,
    )
    if model.mla is not None:
        return MLATransformerConfig(**{**settings, **mla_settings(model)})
    return TransformerConfig(**settings)


def build_gpt(
    model: ModelConfig,
    config: TransformerConfig,
    seed: int = 1234,
    pre_process: Optional[bool] = None,
    post_process: Optional[bool] = None,
    vp_stage: Optional[int] = None,
    backend: Backend = "auto",
    parallel_output: bool = True,
    shift_kernel: Optional[str] = None,
    cross_entropy: str = "torch",
    swiglu: str = "torch",
) -> GPTModel:
    """The GPTModel chunk of this rank's pipeline stage (``vp_stage`` for interleaving).

    ``shift_kernel`` is the KV shift's resolved kernel (None: ``model.kv_shift.kernel``);
    ``cross_entropy`` the loss's (``cross_entropy.choose_cross_entropy``: ``torch`` is
    megatron's, ``triton`` kvtrain's fused one); ``swiglu`` the MLP activation's
    (``swiglu.choose_swiglu``: ``torch`` ops or kvtrain's ``triton`` kernel).

    ``seed`` sets the initial weights: the KV-shift coefficients (the same values
    whatever the TP/PP layout) and every other weight, drawn from streams of
    (seed, position in the model) so that they do not depend on the pipeline
    layout (``init_streams``); the caller's random streams are left as they were.
    """
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=False, vp_stage=vp_stage
        ) if parallel_state.model_parallel_is_initialized() else True
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=False, vp_stage=vp_stage
        ) if parallel_state.model_parallel_is_initialized() else True
    backend = resolve_backend(backend)
    options = kv_shift_options(model, seed, shift_kernel)
    spec = seeded_layer_spec(layer_spec(model.attention, options, backend,
                                        mla=model.mla is not None, swiglu=swiglu), seed)
    with own_streams(seed, "model"):  # the weights do not depend on the PP layout
        return GPTModel(
            config=config,
            transformer_layer_spec=block_spec(spec, config, vp_stage=vp_stage),
            vocab_size=model.padded_vocab_size(config.tensor_model_parallel_size),
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=parallel_output,
            share_embeddings_and_output_weights=not model.untie_embeddings,
            position_embedding_type=model.position_embedding,
            rotary_base=model.rotary_base,
            vp_stage=vp_stage,
            cross_entropy=cross_entropy,
        )


def count_parameters(module: torch.nn.Module) -> dict[str, int]:
    """Parameters of ``module`` (this rank's shard): total, embedding, non-embedding."""
    total = emb = 0
    for name, p in module.named_parameters():
        n = p.numel()
        total += n
        if "embedding" in name or "output_layer" in name:
            emb += n
    return {"total": total, "embedding": emb, "non_embedding": total - emb}
