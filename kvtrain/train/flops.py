"""Model FLOPs of one training step, counted for the real architecture.

Per token and layer, forward pass (a multiply-add is 2 FLOPs):

* QKV projection with GQA: ``2·h·(h + 2·g·d)`` (queries h wide, keys and
  values g KV heads of d dims each), output projection ``2·h·h``;
* attention: ``QK^T`` and ``A·V`` each ``2·s·h`` over the keys a query sees;
  with the causal mask a query sees on average ``(s+1)/2`` keys, which is what
  a causal kernel (flash attention) computes. Separated documents
  (``data.reset_attention_mask``) are counted the same (the Megatron/PaLM
  convention: model FLOPs do not depend on the data), though the kernels skip
  the keys of other documents: their MFU is the full causal count's;
* SwiGLU MLP: three matrices, ``3·2·h·f``;
* MLA (``model.mla``): the projections are its query, K/V down and up
  projections and the output ``n·d_v·h``; QK^T contracts over ``n·(d_nope+d_pe)``
  and A·V over ``n·d_v`` (``ModelConfig.attention_shape``);
* KV shift: every shifted element of K and V (and Q for the ablation) is a
  weighted sum over ``w+1`` tokens: ``w+1`` multiplies and ``w`` adds, i.e.
  ``(2w+1)·g·d`` per shifted tensor (``h`` elements for Q). Tiny next to the
  matmuls, but counted, so vanilla and KV-shift runs report comparable MFU.

Plus the output layer ``2·h·V`` (padded vocabulary). Norms, RoPE, softmax and
residual adds are not counted (the usual MFU convention). Training is forward
plus backward, and the backward pass of every term above costs twice its
forward (gradients w.r.t. inputs and w.r.t. weights), so a step is
``3 × forward``. Activation recomputation re-runs work but is not "model"
FLOPs, so it is left out of MFU on purpose.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrain.config.schema import ModelConfig


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per sequence, by part (for tests and reports)."""

    qkv_and_output_proj: float
    attention: float
    mlp: float
    kv_shift: float
    logits: float

    @property
    def forward(self) -> float:
        return self.qkv_and_output_proj + self.attention + self.mlp + self.kv_shift + self.logits

    @property
    def training(self) -> float:
        return 3.0 * self.forward


def forward_flops_per_sequence(model: ModelConfig, seq_length: int,
                               padded_vocab: int) -> FlopsBreakdown:
    """Forward-pass FLOPs of one sequence of ``seq_length`` tokens."""
    h = model.hidden_size
    f = model.ffn_size
    s = seq_length
    layers = model.num_layers
    attn = model.attention_shape()  # standard or MLA widths
    proj = 2 * (attn.projections + attn.output)  # per token
    attended = (s + 1) / 2  # mean keys per query under the causal mask
    attention = 2 * attended * (attn.qk_width + attn.v_width)  # QK^T and A·V, per token
    mlp = 3 * 2 * h * f
    shift = 0.0
    if model.attention == "kv_shift":
        w = model.kv_shift.window
        per_element = 2 * w + 1
        for tensor in model.kv_shift.shift:
            shift += per_element * attn.shift_width[tensor]
    logits = 2 * h * padded_vocab
    return FlopsBreakdown(
        qkv_and_output_proj=layers * proj * s,
        attention=layers * attention * s,
        mlp=layers * mlp * s,
        kv_shift=layers * shift * s,
        logits=logits * s,
    )


def training_flops_per_step(model: ModelConfig, seq_length: int, global_batch_size: int,
                            padded_vocab: int) -> float:
    """Model FLOPs of one optimizer step (forward + backward, all ranks together)."""
    return global_batch_size * forward_flops_per_sequence(model, seq_length, padded_vocab).training


# Dense bf16 peak TFLOP/s (no sparsity) by device-name fragment, for MFU when
# train.peak_tflops_per_device is not set; fp16's is the same on these cards. Order
# matters: first match wins. No guess for fp32: its matmuls run on TF32 tensor cores
# (TE's GEMMs) or on FP32 cores (PyTorch's default, TF32 off), 8-16x apart, so
# an fp32 run names its peak or reports no MFU.
PEAK_BF16_TFLOPS = (
    ("H200 NVL", 835.0), ("H200", 989.0),
    ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("H800 PCIe", 756.0), ("H800", 989.0), ("GH200", 989.0),
    ("B200", 2250.0), ("B100", 1750.0),
    ("A100", 312.0), ("A800", 312.0), ("A30", 165.0), ("A10", 125.0),
    ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
    ("V100", 125.0),  # fp16 tensor cores (no bf16)
)


def mfu_peak(configured: float | None, precision: str) -> tuple[float | None, str]:
    """The peak TFLOP/s MFU is measured against, and where it comes from (or why
    there is none: recorded with the backend, so a null MFU is explained).
    ``configured``: ``train.peak_tflops_per_device``; ``precision``: resolved."""
    import torch

    if configured:
        return configured, f"{configured:g} TFLOP/s per device (train.peak_tflops_per_device)"
    ask = "set train.peak_tflops_per_device for MFU"
    if not torch.cuda.is_available():
        return None, f"none: no GPU ({ask})"
    if precision == "fp32":
        return None, (f"none: fp32 matmuls run on TF32 tensor cores (TE) or FP32 cores "
                      f"(PyTorch), 8-16x apart ({ask})")
    name = torch.cuda.get_device_name()
    peak = peak_tflops_of(name, precision)
    if peak is None:
        return None, f"none: no known peak for {name} ({ask})"
    return peak, f"{peak:g} TFLOP/s per device ({name}'s dense {precision} peak)"


def peak_tflops_of(device_name: str, precision: str = "bf16") -> float | None:
    """Dense 16-bit peak TFLOP/s of a GPU by its name (torch.cuda.get_device_name);
    None for ``precision`` fp32 (see ``PEAK_BF16_TFLOPS``)."""
    if precision == "fp32":
        return None
    for fragment, tflops in PEAK_BF16_TFLOPS:
        if fragment in device_name:
            return tflops
    return None
