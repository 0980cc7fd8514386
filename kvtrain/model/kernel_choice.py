"""The ``auto | triton | torch`` choice kvtrain's fused kernels share
(``model.rope_kernel``, ``model.cross_entropy_kernel``, ``model.swiglu_kernel``):
an explicit request is taken, or refused in one line naming the key, here; what
``auto`` takes is each kernel's own rule (its ``choose_*``)."""

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


__all__ = ["KERNELS", "explicit_choice"]
