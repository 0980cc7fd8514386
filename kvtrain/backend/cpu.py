"""Run megatron-core's real code paths on the CPU (over gloo) when CUDA is absent.

megatron-core assumes a GPU in a few dozen places that are not about
computation: it allocates buffers on ``torch.cuda.current_device()``, moves
tensors with ``.cuda()``, synchronises streams and events, forks the CUDA RNG
for tensor-parallel regions, and asserts on ``Tensor.type()`` names. Redirecting
those calls (and nothing else) lets GPTModel, the tensor/sequence/pipeline
parallel layers, the pipeline schedules, DDP, the distributed optimizer and
dist_checkpointing run unchanged on a CPU machine. Tests and ``make demo`` use
this; on a machine with CUDA, :func:`enable_cpu_backend` does nothing, and a
process that was given GPUs torch cannot see is refused (``device.py``).

What is patched, and why:

* ``torch.cuda.current_device`` -> 0, ``device_count`` -> 1, ``set_device`` ->
  no-op: megatron calls them to pick the device for buffers.
* torch's tensor factories (``torch.empty/zeros/ones/full/arange/tensor/...``,
  ``Tensor.new_*``) and ``Tensor.to`` get CUDA ``device`` arguments (``"cuda"``,
  ``"cuda:N"``, an int, a CUDA ``torch.device``) rewritten to the CPU.
* ``Tensor.cuda`` / ``Module.cuda`` return the CPU tensor/module; ``pin_memory``
  becomes a no-op (it needs CUDA).
* ``torch.cuda.synchronize`` is a no-op (CPU execution is synchronous; the
  pipeline schedules call it). ``torch.cuda.Stream/Event/current_stream/
  default_stream/stream/set_stream`` refuse in one line (:class:`GpuOnlyCall`):
  only megatron's GPU-only paths use them, and kvtrain takes none on the CPU.
* ``torch.cuda.{get,set}_rng_state/manual_seed/manual_seed_all`` and megatron's
  ``tensor_parallel.random._get_cuda_rng_state/_set_cuda_rng_state`` map to the
  CPU generator, so megatron's RNG tracker forks a real generator state for
  tensor-parallel regions (dropout, TP-sharded init) exactly as on a GPU (its
  warning that the CPU generator moved inside such a region is filtered out).
* ``torch.cuda.memory_*`` / ``max_memory_allocated`` return 0, ``empty_cache``
  and ``nvtx`` calls are no-ops.
* ``Tensor.type()`` with no argument reports ``torch.cuda.<X>Tensor``: the
  optimizer and grad clipping assert on those names.
* Collectives need no patch: gloo has ``reduce_scatter_tensor`` natively since
  torch 2.2 (pyproject asks for >= 2.4), also inside ``_coalescing_manager``,
  where the distributed optimizer issues its gradient reduce-scatter.

Call :func:`enable_cpu_backend` once, before megatron builds anything; it is
idempotent. ``kvtrain.backend.init_distributed`` calls it for you.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types

import torch

from kvtrain.config import ConfigError

from .device import probe_device

_ENABLED = False


def cpu_backend_enabled() -> bool:
    """Whether the CPU redirection is active in this process."""
    return _ENABLED


def _is_cuda_device(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # megatron passes torch.cuda.current_device() (an int)
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


_FACTORIES = (
    "empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "rand", "randn",
    "randint", "randperm", "empty_strided", "linspace", "eye", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "frombuffer",
)
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _cpu_kwargs(kwargs: dict) -> dict:
    if _is_cuda_device(kwargs.get("device")):
        kwargs["device"] = "cpu"
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def _wrap_factory(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **_cpu_kwargs(kwargs))

    return wrapper


def _wrap_to(fn):
    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        # Tensor.to(device, ...) / Tensor.to(int): the device may be positional.
        if args and _is_cuda_device(args[0]):
            args = ("cpu", *args[1:])
        return fn(self, *args, **_cpu_kwargs(kwargs))

    return to


def _patch_factories() -> None:
    """Rewrites CUDA ``device=`` arguments to the CPU in torch's factories.

    Wrapping the functions (rather than a TorchFunctionMode) also covers code
    run by the autograd engine in backward, where modes are not active, and
    adds no per-op cost to the rest of the model.
    """
    # `with torch.device("meta"):` recognises factories by identity in a cached
    # set: fill that cache with the original functions before wrapping them.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in _FACTORIES:
        if hasattr(torch, name):
            setattr(torch, name, _wrap_factory(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        setattr(torch.Tensor, name, _wrap_factory(getattr(torch.Tensor, name)))
    torch.Tensor.to = _wrap_to(torch.Tensor.to)


class GpuOnlyCall(ConfigError):
    """A CUDA stream or event asked for on the CPU backend."""

    kind = "CPU backend"


def _gpu_only(name: str):
    """A stand-in for ``torch.cuda.<name>`` that refuses in one line when called.

    No path kvtrain runs on the CPU creates a stream or an event (the whole suite was
    run with these recording their callers: none did). megatron's paths that do, none
    of which a kvtrain config selects, are refused rather than run untested on inert
    stand-ins whose ordering would mean nothing on the CPU. ``Stream``, ``Event`` and
    ``ExternalStream`` stay classes: libraries name them in annotations evaluated at
    import (transformers: ``torch.cuda.Stream | None``) and in ``isinstance``."""

    def refuse(*args, **kwargs):
        raise GpuOnlyCall(
            f"torch.cuda.{name} was called, which only GPU paths use (megatron's overlapped "
            f"communication on a side stream, activation offloading, CUDA-graph and dynamic "
            f"inference): kvtrain's CPU backend runs none of them")

    if name[0].isupper():
        return type(name, (), {"__init__": refuse, "__module__": __name__})
    return refuse


def _patch_cuda_module() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0
    cuda.device_count = lambda: 1
    cuda.set_device = lambda *a, **k: None
    cuda.synchronize = lambda *a, **k: None
    cuda.empty_cache = lambda: None
    for name in ("Stream", "ExternalStream", "Event", "current_stream", "default_stream",
                 "set_stream", "stream"):
        setattr(cuda, name, _gpu_only(name))
    cuda.memory_allocated = lambda *a, **k: 0
    cuda.max_memory_allocated = lambda *a, **k: 0
    cuda.memory_reserved = lambda *a, **k: 0
    cuda.max_memory_reserved = lambda *a, **k: 0
    cuda.reset_peak_memory_stats = lambda *a, **k: None
    cuda.memory_stats = lambda *a, **k: {}
    # The "CUDA" generator is the CPU one: megatron's tracker forks its state.
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # torch.manual_seed itself calls cuda.manual_seed_all: seed the generator
    # object directly to avoid recursing.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))
    cuda.random.get_rng_state = cuda.get_rng_state
    cuda.random.set_rng_state = cuda.set_rng_state
    nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
        mark=lambda *a, **k: None,
    )
    cuda.nvtx = nvtx


def _patch_tensor_methods() -> None:
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self
    torch.Tensor.pin_memory = lambda self, *a, **k: self
    original_type = torch.Tensor.type

    @functools.wraps(original_type)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        if dtype is None and not kwargs:
            name = original_type(self)
            # megatron asserts e.g. param.type() == 'torch.cuda.FloatTensor'
            if name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch."):]
            return name
        if isinstance(dtype, str) and dtype.startswith("torch.cuda."):
            dtype = "torch." + dtype[len("torch.cuda."):]
        return original_type(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_


def _not_the_cpu_rng_warning(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith("CPU RNG state changed within GPU RNG context")


def _patch_megatron_rng() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # The tracker's fork() warns when the CPU generator moved inside it; here the
    # forked "CUDA" stream is the CPU generator, so every dropout in a TP region
    # (once per layer and micro batch) would warn of what is intended.
    logging.getLogger(mrandom.__name__).addFilter(_not_the_cpu_rng_warning)


def enable_cpu_backend(force: bool = False, device: str = "auto") -> bool:
    """Redirects megatron's CUDA-only calls to the CPU. Returns True if active.

    A no-op (returns False) when torch sees a GPU, unless ``force``; safe to call
    more than once. Unless ``force``, ``device`` (``train.device``) is checked
    first (``device.select_device``): a process the launcher gave GPUs that torch
    cannot see raises ConfigError instead of falling back to the CPU.
    ``KVTRAIN_CPU_BACKEND=0`` leaves megatron unpatched (to see its own errors on a
    CPU machine); the GPU check still runs.
    """
    global _ENABLED
    if _ENABLED:
        return True
    if not force and probe_device(device) == "cuda":
        return False
    if os.environ.get("KVTRAIN_CPU_BACKEND") == "0":
        return False
    _patch_cuda_module()
    _patch_tensor_methods()
    _patch_megatron_rng()
    _patch_factories()
    _ENABLED = True
    return True
