"""Device and process-group setup: the CPU backend for megatron and distributed init."""

from .cpu import cpu_backend_enabled, enable_cpu_backend
from .distributed import (
    DistEnv,
    destroy_distributed,
    free_port,
    init_distributed,
    init_model_parallel,
    init_process_group,
    release_models,
    set_seed,
)

__all__ = [
    "DistEnv",
    "cpu_backend_enabled",
    "destroy_distributed",
    "enable_cpu_backend",
    "free_port",
    "init_distributed",
    "init_model_parallel",
    "init_process_group",
    "release_models",
    "set_seed",
]
