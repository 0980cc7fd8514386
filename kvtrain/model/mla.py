"""Multi-latent attention (DeepSeek-V2's MLA) on kvtrain's backends: megatron's
``MLASelfAttention`` with kvtrain's norms, core attentions and packed documents.

MLA projects the hidden state to a K/V latent of ``kv_lora_rank`` dims (RMS-normed)
plus one ``qk_pos_emb_head_dim`` RoPE key shared by all heads, and up-projects the
latent to each head's key part without RoPE (``qk_head_dim``) and its value
(``v_head_dim``). The query (full rank, or through a ``q_lora_rank`` latent) has a
no-RoPE and a RoPE part per head. Attention sees keys and queries of
``qk_head_dim + qk_pos_emb_head_dim`` dims and values of ``v_head_dim``.

:func:`mla_layer_spec` is the layer spec of ``model.mla`` on each backend:

* ``torch`` / ``local``: megatron's local MLA spec with kvtrain's SP-capable
  ``RMSNorm`` for the layer norms *and* the latent norms (the local spec would
  give megatron's ``WrappedTorchNorm``, which refuses SP, or no latent norm at
  all), and ``TorchAttention`` / ``LocalDotProductAttention`` as core attention.
  Its checkpoint keys are mapped to the TE spec's names (the latent norms are
  fused into the up-projections there), so checkpoints move between backends;
* ``te``: megatron's TE MLA spec with the latent norms fused (``qk_layernorm``).

The attention module is :class:`MLAttention` on every backend, and the KV-shift
variant (``kv_shift.KVShiftMLASelfAttention``) derives from it.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer import multi_latent_attention as megatron_mla
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from .documents import DocumentParams
from .norm import RMSNorm

# local spec module prefixes -> the TE spec's (norms fused into the next linear)
TE_CHECKPOINT_KEYS = {
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def _without_te() -> None:
    """megatron's MLA module sets ``HAVE_TE`` when megatron's TE extension module
    imports, which it also does without Transformer Engine, with mock objects in
    place of the TE classes; ``MultiLatentAttention.__init__`` then fails on
    ``isinstance(linear_proj, TELinear)``. Without TE, the flag is False."""
    if not isinstance(megatron_mla.TELinear, type):
        megatron_mla.HAVE_TE = False


_without_te()


class _SumGradOverTP(torch.autograd.Function):
    """Identity; backward: the gradient summed over the TP ``group``. Not megatron's
    ``copy_to_tensor_model_parallel_region``: its all-reduce of a non-contiguous
    gradient (here a slice of the concatenation's) sums a contiguous copy and
    returns the gradient unsummed."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        total = grad.clone(memory_format=torch.contiguous_format)  # not autograd's buffer
        torch.distributed.all_reduce(total, group=ctx.group)
        return total, None


class MLAttention(MLASelfAttention):
    """megatron's ``MLASelfAttention`` that also takes kvtrain's :class:`DocumentParams`.

    megatron's MLA treats any ``packed_seq_params`` as THD packing (it squeezes the
    batch dimension and reads ``cu_seqlens``). The trainer's documents on the
    ``torch``/``local`` backends are ``sbhd`` batches with document ids, which
    only the core attention (its mask) and the KV shift read: the projections
    and RoPE run as for one document per row.

    The K/V down projection (column-parallel on ``torch``/``local``) hands megatron
    its whole output, ``[s, b, kv_lora_rank + qk_pos_emb_head_dim]`` (``s / TP``
    rows with SP), as a replicated linear's would be (:meth:`_whole_latent`).
    megatron gathers a split output itself, but then the RoPE key, one for all
    heads and used by this rank's heads only, takes only their gradient: the down
    projection's RoPE rows and every weight before the layer would get wrong
    gradients (1e-3 to 1e-2 of their size at TP=2), the loss staying right.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if (isinstance(self.linear_kv_down_proj, ColumnParallelLinear)
                and self.tp_group is not None and self.tp_group.size() > 1):
            self.linear_kv_down_proj.register_forward_hook(self._whole_latent)

    def _whole_latent(self, module, args, output):
        """The down projection's output gathered over TP, as megatron takes a replicated
        linear's: with SP, this rank's rows (megatron all-gathers the RoPE key, whose
        backward sums the ranks' gradients); without, every row, the RoPE key's
        gradient summed over TP (:class:`_SumGradOverTP`)."""
        latent, bias = output
        whole = gather_from_tensor_model_parallel_region(latent, group=self.tp_group)
        if self.config.sequence_parallel:
            return scatter_to_sequence_parallel_region(whole, group=self.tp_group), bias
        rank = self.config.kv_lora_rank
        rope_key = _SumGradOverTP.apply(whole[..., rank:], self.tp_group)
        return torch.cat([whole[..., :rank], rope_key], dim=-1), bias

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    position_ids=None, packed_seq_params=None,
                                    inference_context=None, *, inference_params=None):
        if isinstance(packed_seq_params, DocumentParams):
            packed_seq_params = None
        return super().get_query_key_value_tensors(
            hidden_states, key_value_states, position_ids, packed_seq_params,
            inference_context=inference_context, inference_params=inference_params)


def mla_layer_spec(name: str, core_attention: type) -> ModuleSpec:
    """The MLA GPT layer spec on backend ``name`` (``te`` | ``torch`` | ``local``);
    ``core_attention`` is the backend's core attention (unused for ``te``)."""
    if name == "te":
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        spec = get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True,
                                                          qk_layernorm=True)
        spec.submodules.self_attention.module = MLAttention
        return spec
    spec = copy.deepcopy(get_gpt_layer_local_spec(multi_latent_attention=True,
                                                  normalization="RMSNorm"))
    layer = spec.submodules
    layer.input_layernorm = RMSNorm
    layer.pre_mlp_layernorm = RMSNorm
    layer.sharded_state_dict_keys_map = dict(TE_CHECKPOINT_KEYS)
    attn = layer.self_attention
    attn.module = MLAttention
    attn.submodules.core_attention = core_attention
    attn.submodules.q_layernorm = RMSNorm  # built only with a q_lora_rank
    attn.submodules.kv_layernorm = RMSNorm
    return spec


def is_mla_spec(spec: ModuleSpec) -> bool:
    """Whether the layer spec ``spec`` has multi-latent self-attention."""
    module = spec.submodules.self_attention.module
    return isinstance(module, type) and issubclass(module, MLASelfAttention)


__all__ = ["MLAttention", "TE_CHECKPOINT_KEYS", "is_mla_spec", "mla_layer_spec"]
