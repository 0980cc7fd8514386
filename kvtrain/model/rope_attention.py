"""megatron's ``SelfAttention`` whose QKV split and RoPE are one autograd node where
kvtrain's Triton RoPE is chosen (``model.rope_kernel: triton``; ``auto`` on the
``torch`` backend on a GPU).

megatron's attention splits the QKV projection's output into Q, K and V (views),
then rotates Q and K one after the other; its backward rotates their gradients
back and concatenates the three into the projection's gradient: two kernels and
a concatenation, each a pass over memory. :func:`kvtrain.model.qkv_rope.qkv_rope`
does it in one pass each way, reading the projection's output and writing the
rotated Q and K (V stays a view); the KV-shift layer (``KVShiftSelfAttention``)
passes its coefficients, and the same pass shifts K before rotating it and
writes the shifted V over the query's dead columns (what attention keeps is then
vanilla's, with no raw copy: the raw K and V are the projection's own columns).

How: the layer's ``forward`` takes the rotary angles out of megatron's call
(``rotary_pos_emb=None``: megatron applies no RoPE) and leaves them for
``get_query_key_value_tensors``, megatron's hook for the split, for this call
only. Where the node does not apply, megatron's path runs as it is: a decoding
step (an inference context), context parallelism, THD packed sequences, Q/K
norms, angles other than the full head width in fp32, YaRN's ``mscale``,
interleaved rotation, gated attention, layers without RoPE (``no_rope_freq``),
runs that chose megatron's RoPE (``apply_rope_fusion`` off), and core attention
other than the ``torch`` backend's (SDPA keeps V as it is given, a view of the
QKV output: what ``kvtrain plan`` counts).

The node does not go through megatron's fused-RoPE slot, so it runs whatever the
slot holds: with Transformer Engine installed, TE's kernel stays there and
rotates only where megatron's path runs (decoding).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config as yarn_mscale,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.identity_op import IdentityOp

from .attention import TorchAttention
from .context_parallel import cp_group
from .documents import DocumentParams
from .qkv_rope import qkv_rope


class _RoPECall:
    """The angles of this forward call's fused RoPE (None: megatron's path), and
    whether the layer can take the node at all (worked out on its first call: its
    config and modules do not change), in a plain object: a module attribute set
    costs ``nn.Module.__setattr__``, a module attribute read ``__getattr__``."""

    __slots__ = ("freqs", "layer_fuses", "kept", "value_kept")

    def __init__(self) -> None:
        self.freqs: Optional[Tensor] = None
        self.layer_fuses: Optional[bool] = None
        # whether core attention keeps V (a view of the QKV output) for its backward,
        # without and with documents; this call's
        self.kept = (False, False)
        self.value_kept = False


def is_identity(module: Optional[torch.nn.Module]) -> bool:
    """No module, or megatron's ``IdentityOp`` (a spec slot left empty)."""
    return module is None or isinstance(module, IdentityOp)


class FusedRoPESelfAttention(SelfAttention):
    """``SelfAttention`` splitting its QKV output and rotating Q and K in one node
    (:func:`qkv_rope`) where it applies; megatron's own path elsewhere."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._rope_call = _RoPECall()

    def forward(self, hidden_states, attention_mask, *args, **kwargs):
        freqs = self._fusable_angles(args, kwargs)
        if freqs is None:
            return super().forward(hidden_states, attention_mask, *args, **kwargs)
        self._rope_call.freqs = freqs
        try:
            return super().forward(hidden_states, attention_mask,
                                   **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._rope_call.freqs = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                    output_gate: bool = False, split_qkv: bool = True):
        freqs = self._rope_call.freqs
        if freqs is None or not split_qkv or key_value_states is not None or output_gate:
            return super().get_query_key_value_tensors(
                hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv)
        mixed, split = super().get_query_key_value_tensors(hidden_states, split_qkv=False)
        return self._fused_query_key_value(mixed, freqs, split[0])

    def _fused_query_key_value(self, mixed: Tensor, freqs: Tensor,
                               query_width: int) -> tuple[Tensor, Tensor, Tensor]:
        """Rotated Q ``[s, b, np, hn]``, rotated K and V ``[s, b, ng, hn]`` from megatron's
        QKV layout ``mixed [s, b, ng, (np/ng + 2) * hn]`` (the KV shift adds its own)."""
        return qkv_rope(mixed, freqs, query_width,
                        attention_keeps_value=self._rope_call.value_kept)

    def _fuses_here(self) -> bool:
        """Whether this layer's split can take RoPE (the KV shift adds its conditions)."""
        return True

    def _layer_fuses(self) -> bool:
        """What does not change from call to call: the config, the modules, context
        parallelism. ``apply_rope_fusion`` on the ``torch`` backend (``TorchAttention``)
        is kvtrain's Triton RoPE (``rope.choose_rope``), whatever megatron's slot holds.
        megatron's path keeps RoPE where its own forward decides it per layer or call
        (``no_rope_freq``, gated attention, its fused single-QKV RoPE)."""
        config = self.config
        return (config.apply_rope_fusion
                and isinstance(self.core_attention, TorchAttention)
                and not (config.rotary_interleaved or config.flash_decode or config.test_mode
                         or config.attention_output_gate or config.fused_single_qkv_rope)
                and getattr(config, "mrope_section", None) is None
                and getattr(config, "no_rope_freq", None) is None
                and yarn_mscale(config) == 1.0
                and is_identity(self.q_layernorm) and is_identity(self.k_layernorm)
                and cp_group() is None  # (set up before the model is built)
                and self._fuses_here())

    def _fusable_angles(self, args: tuple, kwargs: dict) -> Optional[Tensor]:
        """The angles ``[s, 1, 1, hn]`` this call's Q and K take inside the QKV node, or
        None where megatron's path runs (the module doc lists where)."""
        call = self._rope_call
        if call.layer_fuses is None:
            call.layer_fuses = self._layer_fuses()
            if call.layer_fuses:
                call.kept = tuple(self.core_attention.keeps_value(docs) for docs in (False, True))
        if (args or not call.layer_fuses or kwargs.get("inference_context") is not None
                or kwargs.get("inference_params") is not None
                or kwargs.get("key_value_states") is not None):
            return None
        packed = kwargs.get("packed_seq_params")
        if packed is not None and not isinstance(packed, DocumentParams):
            return None  # THD: megatron's RoPE by document
        emb = kwargs.get("rotary_pos_emb")
        if isinstance(emb, tuple):
            emb = emb[0] if emb[0] is emb[1] else None
        if (emb is None or emb.dtype != torch.float32 or emb.dim() != 4
                or emb.shape[-1] != self.hidden_size_per_attention_head):
            return None
        call.value_kept = call.kept[packed is not None]
        return emb


__all__ = ["FusedRoPESelfAttention", "is_identity"]
