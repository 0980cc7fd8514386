"""The ``auto | triton | torch`` choice kvtrain's fused kernels share
(``model.rope_kernel``, ``model.cross_entropy_kernel``, ``model.swiglu_kernel``):
an explicit request is taken, or refused in one line naming the key, here; and
the ``auto`` rule of the loss and SwiGLU (RoPE's, which also weighs where the
kernel runs, is its own ``choose``)."""

from __future__ import annotations

from typing import Optional

KERNELS = ("auto", "triton", "torch")


def explicit_choice(key: str, requested: str, cuda: bool,
                    triton_here: bool) -> Optional[tuple[str, str]]:
    """(name, why) for ``key: requested`` where it names a kernel (``torch``, or
    ``triton`` on a GPU with Triton installed), None for ``auto``; ConfigError for a
    value that is none of them or a ``triton`` that cannot run here."""
    from kvtrain.config import ConfigError

    if requested not in KERNELS:
        raise ConfigError(f"{key} must be auto, triton or torch, got {requested!r}")
    said = f"{key}: {requested}"
    if requested == "torch":
        return "torch", said
    if requested == "triton":
        if not cuda:
            raise ConfigError(f"{said} needs a GPU (use auto or torch on the CPU)")
        if not triton_here:
            raise ConfigError(f"{said}, but Triton is not installed (use torch)")
        return "triton", said
    return None


def auto_choice(cuda: bool, backend: str, triton_here: bool, local_keeps: str,
                also_torch: Optional[str] = None) -> tuple[str, str]:
    """(name, why) of ``auto``: the Triton kernel on a GPU, torch's ops on the CPU,
    on the ``local`` backend (the reference keeps ``local_keeps``), where
    ``also_torch`` says why (e.g. a dtype the kernel does not take) and without
    Triton."""
    if not cuda:
        return "torch", "auto: no GPU"
    if backend == "local":  # the reference
        return "torch", f"auto: the local backend keeps {local_keeps}"
    if also_torch:
        return "torch", f"auto: {also_torch}"
    if not triton_here:
        return "torch", "auto: Triton is not installed"
    return "triton", "auto: GPU"


__all__ = ["KERNELS", "auto_choice", "explicit_choice"]
