"""Do kvtrain's Triton kernels compile, run and agree with the torch ops on this GPU?
One line per kernel.

    python benchmarks/device/smoke.py        (exit 0; prints the --set options that
                                              turn off a kernel that failed)

``checks.sh`` runs it first on a lent GPU: a kernel that fails to compile there
would otherwise fail every timed run of the call. Each kernel runs forward and
backward once on a small fp32 input against the torch ops it replaces (within
1e-4 of scale); a failure or a disagreement is printed with its first line,
and the matching ``--set model...=torch`` is printed on the last line for the
timed runs to take (and for the note to say so).

    python benchmarks/device/smoke.py --verdict SMOKE_TXT

prints the options the timed runs take from what a run of it printed: its last
line's, or, where it hung (``checks.sh`` stops it after a while) or died before
that line, one for every kernel it did not see run (a kernel that hangs here
would hang every timed run).

    TRITON_INTERPRET=1 python benchmarks/device/smoke.py --device cpu

runs the same checks in Triton's interpreter on the CPU (what ``make test`` does,
so that a check that cannot pass is found before a lent GPU's minutes are spent
on it).
"""

from __future__ import annotations

import sys
import traceback

import torch

DEVICE = "cuda"  # --device


def _agree(run, reference, inputs: list) -> None:
    """``run`` and ``reference`` on copies of ``inputs`` (fp32): outputs and input
    gradients within 1e-4 of their scale, else AssertionError. The outputs are read
    before the backward: the QKV node writes its gradient over its input, whose
    views they are (read after it, they were a RuntimeError, and the Triton RoPE
    was off for every timed run of the H200's first call in session 44)."""
    results = []
    for fn in (run, reference):
        xs = [x.detach().clone().requires_grad_() for x in inputs]
        outs = fn(*xs)
        values = [o.detach().clone() for o in outs]
        torch.autograd.backward(outs, [torch.ones_like(o) * (i + 1) for i, o in enumerate(outs)])
        results.append([*values, *(x.grad for x in xs)])
    for got, want in zip(*results):
        err = (got - want).abs().max().item()
        assert err <= 1e-4 * max(want.abs().max().item(), 1.0), f"off by {err:.3g}"


def _shift() -> None:
    from kvtrain.model.shift_kernels import fused_shift_qkv

    def shift(impl):
        return lambda m, ck, cv: fused_shift_qkv(m, ck, cv, None, query_width=64, impl=impl)

    inputs = [torch.randn(64, 2, 4, 3 * 64, device=DEVICE), torch.rand(4, 2, device=DEVICE),
              torch.rand(4, 2, device=DEVICE)]
    _agree(shift("triton"), shift("torch"), inputs)


def _rope() -> None:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from kvtrain.model.rope import fused_rope

    freqs = torch.rand(64, 1, 1, 32, device=DEVICE) * 64
    freqs = torch.cat([freqs, freqs], dim=-1)
    _agree(lambda t: (fused_rope(t, freqs),), lambda t: (_apply_rotary_pos_emb_bshd(t, freqs),),
           [torch.randn(64, 2, 4, 64, device=DEVICE)])
    _qkv_rope(freqs)


def _qkv_rope(freqs) -> None:
    """The split + shift + RoPE node (what the torch backend's layers take with the
    Triton RoPE) against the split, the shift's torch ops and megatron's RoPE."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    from kvtrain.model.qkv_rope import qkv_rope
    from kvtrain.model.shift_kernels import fused_shift_qkv

    def reference(m, ck, cv):  # [s, b, g, 2d + 2d]: two query heads per group
        q, k, v = fused_shift_qkv(m, ck, cv, None, query_width=128, impl="torch")
        q = q.reshape(*q.shape[:2], -1, 64)
        return (_apply_rotary_pos_emb_bshd(q, freqs), _apply_rotary_pos_emb_bshd(k, freqs), v)

    # m * 1: the node writes the shifted V over its input's query columns
    _agree(lambda m, ck, cv: qkv_rope(m * 1, freqs, 128, ck, cv), reference,
           [torch.randn(64, 2, 4, 4 * 64, device=DEVICE), torch.rand(4, 2, device=DEVICE),
            torch.rand(4, 2, device=DEVICE)])


def _cross_entropy() -> None:
    from kvtrain.model.cross_entropy import vocab_parallel_cross_entropy

    labels = torch.randint(0, 5000, (64, 2), device=DEVICE)

    def megatrons(x):  # the loss megatron computes, on torch ops
        return (torch.logsumexp(x, -1) - x.gather(-1, labels[..., None])[..., 0],)

    # x * 1: the fused loss writes its gradient over its logits, not over the leaf
    _agree(lambda x: (vocab_parallel_cross_entropy(x * 1, labels),), megatrons,
           [torch.randn(64, 2, 5000, device=DEVICE) * 3])


def _swiglu() -> None:
    from kvtrain.model.swiglu import SwiGLUFunction

    _agree(lambda x: (SwiGLUFunction.apply(x, True),), lambda x: (SwiGLUFunction.apply(x),),
           [torch.randn(64, 2, 2 * 1500, device=DEVICE) * 3])


KERNELS = {"model.kv_shift.kernel": _shift, "model.rope_kernel": _rope,
           "model.cross_entropy_kernel": _cross_entropy, "model.swiglu_kernel": _swiglu}


def verdict(printed: str) -> list[str]:
    """The ``--set`` options a run of this script's output asks for (``--verdict``)."""
    lines = printed.splitlines()
    for line in lines:
        if line.startswith("smoke-off:"):
            return line.split()[1:]
    ok = {line.split(":")[1].strip() for line in lines
          if line.startswith("smoke: ") and line.endswith(": triton ok")}
    return [arg for key in KERNELS if key not in ok for arg in ("--set", f"{key}=torch")]


def main(argv: list[str]) -> int:
    global DEVICE
    if argv[:1] == ["--verdict"] and len(argv) == 2:
        print(" ".join(verdict(open(argv[1], errors="replace").read())))
        return 0
    if argv[:1] == ["--device"] and len(argv) == 2:
        DEVICE = argv[1]
    elif argv:
        print("usage: smoke.py [--device DEVICE] | --verdict SMOKE_TXT", file=sys.stderr)
        return 2
    off = []
    for key, run in KERNELS.items():
        try:
            run()
            if DEVICE.startswith("cuda"):
                torch.cuda.synchronize()
            print(f"smoke: {key}: triton ok", flush=True)
        except Exception as e:  # noqa: BLE001 - any failure turns the kernel off
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            print(f"smoke: {key}: triton FAILED: {type(e).__name__}: {first}", flush=True)
            traceback.print_exc(limit=3)
            off.append(f"--set {key}=torch")
    print(" ".join(["smoke-off:", *off]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
