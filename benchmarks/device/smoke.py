"""Do kvtrain's Triton kernels compile and run on this GPU? One line per kernel.

    python benchmarks/device/smoke.py        (exit 0; prints the --set options that
                                              turn off a kernel that failed)

``checks.sh`` runs it first on a lent GPU: a kernel that fails to compile there
would otherwise fail every timed run of the call. Each kernel runs forward and
backward once on a small bf16 input; a failure is printed with its first line,
and the matching ``--set model...=torch`` is printed on the last line for the
timed runs to take (and for the note to say so).
"""

from __future__ import annotations

import sys
import traceback

import torch


def _shift() -> None:
    from kvtrain.model.shift_kernels import fused_shift_qkv

    mixed = torch.randn(64, 2, 4, 3 * 64, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
    coef = torch.rand(4, 2, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = fused_shift_qkv(mixed, coef, coef.detach().clone().requires_grad_(), None,
                              query_width=64, impl="triton")
    (q.float().sum() + k.float().sum() + v.float().sum()).backward()


def _rope() -> None:
    from kvtrain.model.rope import fused_rope

    t = torch.randn(64, 2, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    freqs = torch.rand(64, 1, 1, 64, device="cuda")
    fused_rope(t, freqs).float().sum().backward()


KERNELS = {"model.kv_shift.kernel": _shift, "model.rope_kernel": _rope}


def main() -> int:
    off = []
    for key, run in KERNELS.items():
        try:
            run()
            torch.cuda.synchronize()
            print(f"smoke: {key}: triton ok")
        except Exception as e:  # noqa: BLE001 - any failure turns the kernel off
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"smoke: {key}: triton FAILED: {type(e).__name__}: {first}")
            traceback.print_exc(limit=3)
            off.append(f"--set {key}=torch")
    print(" ".join(["smoke-off:", *off]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
