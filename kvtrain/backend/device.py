"""Where a process trains: the GPU, or the CPU - never the CPU by accident.

The CPU backend (``cpu.py``) exists for tests and demos. A GPU job whose CUDA
is broken (a driver/toolkit mismatch, a CPU-only torch wheel in the image)
sees no GPU in torch; without a check it would quietly train a 19B config on
CPUs. So when the launcher gave the process GPUs and torch sees none, the run
stops in one line saying what was found. The evidence is read by a pure
function of the environment and a path lister, :func:`gpus_given`, and the
decision by :func:`select_device`; :func:`probe_device` feeds them the real
process state.

``train.device`` (see the config) is the user's say: ``auto`` (the rule
above), ``cuda`` (a GPU is required) or ``cpu`` (CPU training on purpose,
also on a GPU node).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Callable, Iterable, Mapping, Optional

from kvtrain.config import ConfigError

# Variables that list the GPU ids a job or step was given (any value but _NO_GPUS's).
_GPU_LIST_VARS = ("SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "GPU_DEVICE_ORDINAL")
# Variables that give a GPU count, optionally typed ("a100:4", "gpu:2").
_GPU_COUNT_VARS = ("SLURM_GPUS", "SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE",
                   "SLURM_GPUS_PER_TASK", "SLURM_STEP_GPUS_PER_NODE")
# Values of CUDA_VISIBLE_DEVICES (and of the lists above) that give no GPU (SLURM
# writes NoDevFiles when the job has no GPU gres).
_NO_GPUS = ("", "-1", "none", "NoDevFiles")
NVIDIA_DEVICE_FILES = "/dev/nvidia[0-9]*"


def _counts_gpus(value: str) -> bool:
    """True when a SLURM GPU count such as ``4``, ``a100:4`` or ``1,a100:2`` is > 0."""
    numbers = [int(n) for n in re.findall(r"(?:^|[:,])(\d+)(?=,|$)", value.strip())]
    return any(n > 0 for n in numbers)


def gpus_given(environ: Mapping[str, str],
               list_paths: Callable[[str], Iterable[str]]) -> list[str]:
    """What says this process was meant to have GPUs: ``NAME=value`` for each
    telling variable and each NVIDIA device file (``list_paths(NVIDIA_DEVICE_FILES)``)."""
    found = []
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in _NO_GPUS:
        found.append(f"CUDA_VISIBLE_DEVICES={visible}")
    for name in _GPU_LIST_VARS:  # SLURM sets GPU_DEVICE_ORDINAL=NoDevFiles too
        value = environ.get(name, "").strip()
        if value.lower() not in (v.lower() for v in _NO_GPUS):
            found.append(f"{name}={value}")
    for name in _GPU_COUNT_VARS:
        value = environ.get(name, "")
        if _counts_gpus(value):
            found.append(f"{name}={value}")
    found += sorted(list_paths(NVIDIA_DEVICE_FILES))
    return found


def _torch_build(torch_cuda: Optional[str]) -> str:
    if torch_cuda is None:
        return "this torch is a CPU-only build"
    return f"this torch is built for CUDA {torch_cuda}: check the driver and the image"


def select_device(requested: str, environ: Mapping[str, str],
                  list_paths: Callable[[str], Iterable[str]], cuda_available: bool,
                  torch_cuda: Optional[str]) -> str:
    """``cuda`` or ``cpu`` for ``train.device: requested``; ConfigError (one line) when
    the launcher gave GPUs torch cannot see, or the request cannot be honoured.
    ``torch_cuda`` is ``torch.version.cuda`` (None for a CPU build)."""
    if requested == "cpu":
        if cuda_available:
            raise ConfigError("train.device: cpu, but torch sees a GPU: hide the GPUs "
                              "(CUDA_VISIBLE_DEVICES=) to train on the CPU")
        return "cpu"
    if cuda_available:
        return "cuda"
    if requested == "cuda":
        raise ConfigError(f"train.device: cuda, but torch sees no GPU ({_torch_build(torch_cuda)})")
    evidence = gpus_given(environ, list_paths)
    if evidence:
        raise ConfigError(
            f"the launcher gave this process GPUs ({', '.join(evidence)}) but torch sees no GPU "
            f"({_torch_build(torch_cuda)}); refusing to train on the CPU instead "
            "(set train.device: cpu to do that on purpose)"
        )
    return "cpu"


def probe_device(requested: str = "auto") -> str:
    """:func:`select_device` on this process's environment, device files and torch."""
    import torch

    return select_device(requested, os.environ, glob.glob, torch.cuda.is_available(),
                         torch.version.cuda)


__all__ = ["gpus_given", "probe_device", "select_device"]
