"""megatron's vocab-parallel cross-entropy against kvtrain's fused one
(``model.cross_entropy_kernel``), forward and backward, on one GPU.

    python benchmarks/cross_entropy.py [--tokens 8192] [--vocab 36000] [--dtype bf16]
                                       [--rounds 20] [--json PATH]

Defaults: the paper's 1.5B run (vocabulary 36000, padded to 36096; one micro batch
of 4 x 2048 tokens). Each round times one forward and backward of each loss on
fresh logits (the order flips every round) and records the memory the loss
allocated above its logits at its peak. Prints the medians and their ratios
(megatron / fused); ``--json`` writes them. A GPU only: the fused loss is a
Triton kernel (the CPU's tests run it in Triton's interpreter).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_rounds import (  # noqa: E402
    alternate, parser, refused_without_gpu, timed, write_json)

LOSSES = ("megatron", "fused")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def loss_fn(name: str):
    if name == "fused":
        from kvtrain.model.cross_entropy import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy
    from megatron.core import tensor_parallel

    return tensor_parallel.vocab_parallel_cross_entropy


def one_round(name: str, base: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """ms of one forward and backward of ``name``'s loss on a copy of ``base``, and the
    bytes it allocated above the logits at its peak."""
    fn = loss_fn(name)
    logits = base.clone().requires_grad_()
    return timed(lambda: torch.autograd.grad(fn(logits, labels).sum(), logits))


def measure(tokens: int, vocab: int, dtype: str, rounds: int) -> dict:
    from kvtrain.backend import init_distributed

    init_distributed(seed=0)  # megatron's loss reads its TP group (1 rank)
    padded = -(-vocab // 128) * 128  # megatron's padding (TP 1)
    gen = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(tokens, 1, padded, device="cuda", generator=gen).mul_(3).to(DTYPES[dtype])
    labels = torch.randint(0, vocab, (tokens, 1), device="cuda", generator=gen)
    ms, peak = alternate(LOSSES, lambda name: one_round(name, base, labels), rounds)
    return {"tokens": tokens, "vocab": vocab, "padded_vocab": padded, "dtype": dtype,
            "rounds": rounds, "device": torch.cuda.get_device_name(),
            "logits_bytes": base.numel() * base.element_size(),
            "ms": ms, "peak_bytes_above_logits": peak,
            "time_ratio": ms["megatron"] / ms["fused"],
            "memory_ratio": peak["megatron"] / max(peak["fused"], 1)}


def main(argv: Optional[list[str]] = None) -> int:
    options = parser(__doc__, DTYPES)
    options.add_argument("--vocab", type=int, default=36000)
    args = options.parse_args(argv)
    if refused_without_gpu(
            "benchmarks/cross_entropy.py needs a GPU: the fused loss is a Triton kernel "
            "(tests/model/test_cross_entropy.py runs it in Triton's interpreter)"):
        return 2
    r = measure(args.tokens, args.vocab, args.dtype, args.rounds)
    gib = 1 << 30
    print(f"cross-entropy of {r['tokens']} tokens x {r['padded_vocab']} ({r['dtype']}, "
          f"logits {r['logits_bytes'] / gib:.2f} GiB), {r['device']}, median of {r['rounds']}")
    for name in LOSSES:
        print(f"  {name:9s} forward+backward {r['ms'][name]:7.3f} ms, "
              f"peak above the logits {r['peak_bytes_above_logits'][name] / gib:.2f} GiB")
    print(f"  megatron / fused: time {r['time_ratio']:.2f}x, memory {r['memory_ratio']:.2f}x")
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
