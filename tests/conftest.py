"""Shared fixtures: a one-rank megatron environment on the CPU backend."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")


def pytest_collection_modifyitems(config, items):
    """`gpu` tests are skipped without a CUDA device (and only then)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def single_rank():
    """torch.distributed (1 rank, gloo on CPU) + megatron parallel state TP=PP=1."""
    from kvtrain.backend import init_distributed

    env = init_distributed(seed=1234)
    yield env


@pytest.fixture
def mp1(single_rank):
    """Resets megatron's model-parallel state to TP=PP=1 and reseeds, per test."""
    from kvtrain.backend import init_model_parallel, set_seed

    init_model_parallel(1, 1)
    set_seed(1234)
    return single_rank
