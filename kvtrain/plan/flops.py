"""FLOPs per step and wall time at a given MFU, and the GPUs the plan knows.

The FLOP count is the trainer's own (``kvtrain.train.flops``, which the MFU in
metrics.jsonl uses; that module imports neither torch nor megatron at import
time, so planning stays light). Per token, training (forward + backward =
3 × forward, a multiply-add = 2 FLOPs):

* ``6N`` over the matrix parameters: QKV ``h·(h+2gd)``, output projection
  ``h·h``, SwiGLU ``3·h·f`` per layer, and the output layer ``h·V``;
* causal attention ``3·L·2·2·h·(s+1)/2`` (QK^T and A·V; a query sees
  ``(s+1)/2`` keys on average, which is what flash attention computes; the
  same with ``data.reset_attention_mask``, whose kernels compute less);
* KV shifting ``3·L·(2w+1)·width`` per shifted tensor (``w+1`` multiplies and
  ``w`` adds per element; width ``g·d`` for K and V, ``h`` for Q).

Wall time: ``step FLOPs / (GPUs × peak × MFU)``, the peak of the run's matmuls
(``GPU.peak``: bf16 tensor cores; for fp32 TF32's on ``te``, FP32 cores' else). MFU counts model FLOPs only,
so what recompute re-runs (hardware FLOPs, reported too: every layer's forward
with ``recompute: full``, core attention's with ``selective``) is part of what
lowers the MFU you should assume, not an extra term.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtrain.config.schema import ModelConfig
from kvtrain.train.flops import FlopsBreakdown, forward_flops_per_sequence



@dataclass(frozen=True)
class GPU:
    name: str
    memory_gib: float
    peak_tflops: float  # dense bf16 (fp16 the same)
    tf32_tflops: float  # dense TF32 tensor cores
    fp32_tflops: float  # FP32 cores

    def peak(self, precision: str, backend: str) -> tuple[float, str]:
        """Peak TFLOP/s the matmuls of a ``precision`` run on ``backend`` reach, and
        its name: fp32 runs TE's GEMMs as TF32 (``CUBLAS_COMPUTE_32F_FAST_TF32``) and
        PyTorch's with TF32 off (its default; kvtrain leaves it), on FP32 cores."""
        if precision != "fp32":  # auto is bf16 on a GPU
            return self.peak_tflops, "fp16" if precision == "fp16" else "bf16"
        if backend == "te":
            return self.tf32_tflops, "tf32"
        return self.fp32_tflops, "fp32"


# SXM cards; dense peaks without sparsity.
GPUS = {
    "a100": GPU("A100-80G", 80.0, 312.0, 156.0, 19.5),
    "a800": GPU("A800-80G", 80.0, 312.0, 156.0, 19.5),  # A100, reduced NVLink (the paper's 19B)
    "h800": GPU("H800-80G", 80.0, 989.0, 494.5, 67.0),  # H100 SXM compute, reduced NVLink
    "h100": GPU("H100-80G", 80.0, 989.0, 494.5, 67.0),
    # H100 SXM compute with 141 GB of HBM3e, of which PyTorch is given ~139 GiB (the
    # H200 that benchmarks/device measures on)
    "h200": GPU("H200-141G", 139.0, 989.0, 494.5, 67.0),
    # HGX B200 at 1,000 W (not GB200's 1,200 W): 180 GB of HBM3e, of which PyTorch
    # is given ~178 GiB (nvidia-smi: 183,359 MiB)
    "b200": GPU("B200-180G", 178.0, 2250.0, 1100.0, 75.0),
}


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one optimizer step, all GPUs together."""

    per_sequence: FlopsBreakdown  # forward, per sequence
    sequences: int
    recompute: str

    @property
    def model(self) -> float:
        """Model FLOPs (forward + backward), what MFU is measured against."""
        return self.sequences * self.per_sequence.training

    @property
    def hardware(self) -> float:
        """Model FLOPs plus the forward that recompute re-runs: every layer's with
        ``full``; core attention's with ``selective`` (megatron's ``core_attn``
        module; the projections and the KV shift around it are not recomputed)."""
        extra = 0.0
        if self.recompute == "full":
            extra = self.sequences * (self.per_sequence.forward - self.per_sequence.logits)
        elif self.recompute == "selective":
            extra = self.sequences * self.per_sequence.attention
        return self.model + extra

    def part(self, name: str) -> float:
        """Training FLOPs of one part (``attention``, ``kv_shift``, ...) per step."""
        return 3.0 * self.sequences * getattr(self.per_sequence, name)


def step_flops(model: ModelConfig, seq_length: int, global_batch_size: int,
               tensor_parallel: int = 1, recompute: str = "none") -> StepFlops:
    vocab = model.padded_vocab_size(tensor_parallel)
    per_seq = forward_flops_per_sequence(model, seq_length, vocab)
    return StepFlops(per_sequence=per_seq, sequences=global_batch_size, recompute=recompute)


def step_seconds(flops: StepFlops, gpus: int, peak_tflops: float, mfu: float) -> float:
    """Seconds per step at ``mfu`` of ``gpus`` devices of ``peak_tflops`` each."""
    return flops.model / (gpus * peak_tflops * 1e12 * mfu)


def human_duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 2 * 3600:
        return f"{seconds / 60:.1f} min"
    if seconds < 3 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"
