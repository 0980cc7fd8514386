"""The MLP's SwiGLU on torch's ops against kvtrain's Triton kernels
(``model.swiglu_kernel``), forward and backward, on one GPU.

    python benchmarks/swiglu.py [--tokens 8192] [--ffn 5504] [--dtype bf16]
                                [--rounds 20] [--json PATH]

Defaults: the paper's 1.5B run (FFN 5504; one micro batch of 4 x 2048 tokens).
Each round times one forward and backward of each on the same fc1 output (the
order flips every round) and records the memory each allocated above its input
at its peak. Prints the medians, their ratio (torch / triton) and the memory
traffic the kernels reach (bytes moved / time: 3f per token forward, 5f
backward); ``--json`` writes them. A GPU only: the CPU's tests run the kernels in
Triton's interpreter (tests/model/test_swiglu.py).
"""

from __future__ import annotations

import os
import sys
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_rounds import (  # noqa: E402
    alternate, parser, refused_without_gpu, timed, write_json)

KERNELS = ("torch", "triton")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def one_round(kernel: str, x: torch.Tensor, grad: torch.Tensor) -> tuple[float, int]:
    """ms of one forward and backward of SwiGLU on ``kernel``, and the bytes it
    allocated above its input at its peak."""
    from kvtrain.model.swiglu import SwiGLUFunction

    leaf = x.detach().requires_grad_()
    return timed(lambda: torch.autograd.grad(SwiGLUFunction.apply(leaf, kernel == "triton"),
                                             leaf, grad))


def measure(tokens: int, ffn: int, dtype: str, rounds: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, 1, 2 * ffn, device="cuda", generator=gen).mul_(3).to(DTYPES[dtype])
    grad = torch.randn(tokens, 1, ffn, device="cuda", generator=gen).to(DTYPES[dtype])
    ms, peak = alternate(KERNELS, lambda kernel: one_round(kernel, x, grad), rounds)
    moved = 8 * tokens * ffn * x.element_size()  # 3f forward + 5f backward per token
    return {"tokens": tokens, "ffn": ffn, "dtype": dtype, "rounds": rounds,
            "device": torch.cuda.get_device_name(), "ms": ms, "peak_bytes_above_input": peak,
            "time_ratio": ms["torch"] / ms["triton"],
            "triton_gb_per_s": moved / ms["triton"] / 1e6}


def main(argv: Optional[list[str]] = None) -> int:
    options = parser(__doc__, DTYPES)
    options.add_argument("--ffn", type=int, default=5504)
    args = options.parse_args(argv)
    if refused_without_gpu(
            "benchmarks/swiglu.py needs a GPU: the kernels are Triton's "
            "(tests/model/test_swiglu.py runs them in Triton's interpreter)"):
        return 2
    r = measure(args.tokens, args.ffn, args.dtype, args.rounds)
    gib = 1 << 30
    print(f"SwiGLU of {r['tokens']} tokens x 2 x {r['ffn']} ({r['dtype']}), {r['device']}, "
          f"median of {r['rounds']}")
    for k in KERNELS:
        print(f"  {k:7s} forward+backward {r['ms'][k]:7.3f} ms, peak above the input "
              f"{r['peak_bytes_above_input'][k] / gib:.2f} GiB")
    print(f"  torch / triton: time {r['time_ratio']:.2f}x; triton moves "
          f"{r['triton_gb_per_s']:.0f} GB/s")
    write_json(args.json, r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
