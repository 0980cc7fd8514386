"""The trainer: megatron-core's model, schedules, DDP, distributed optimizer,
scheduler, datasets and dist checkpoints, put together for one run.

``train(cfg, run_dir)`` runs (or resumes) a run on this rank; ``kvtrain train``
(kvtrain/commands/train.py) is the command line around it. Modules:

* ``setup``        - process groups, model chunks, optimizer, data (``build_run``)
* ``loop``         - the training loop and ``train``
* ``step``         - one step: pipeline schedule, loss reduction, guarded update
* ``optimizer``    - AdamW param groups, LR schedules, the non-finite guard
* ``checkpoint``   - dist_checkpointing save/load, RNG states
* ``integrity``    - checkpoint manifests, verification, ``latest``, resume candidates
* ``resume``       - the collective resume: verify, load or fall back, set aside
* ``evaluation``   - validation loss/perplexity and KV-shift statistics
* ``metrics``      - metrics.jsonl, stdout, memory
* ``flops``        - model FLOPs and MFU
* ``profiling``    - torch.profiler traces of chosen steps and ranks (``profile``)
* ``signals``      - SIGTERM/SIGUSR1 and the time limit
* ``wandb_logger`` - one wandb run per run folder (resumable), offline reader
* ``writer_queue`` - the checkpoint writer's queue process (stdlib only)

Attributes are imported lazily: a process that only needs a light submodule
(the checkpoint writer's manager imports ``writer_queue``) does not pull in
torch and megatron through this package.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "train": "loop", "EXIT_OK": "loop", "EXIT_NONFINITE": "loop",
    "resolve_run_dir": "setup",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
