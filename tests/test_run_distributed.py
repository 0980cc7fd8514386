"""``kvtrain.testing.run_distributed``: how its ranks start.

Without CUDA they fork from a server that has imported torch, megatron and
kvtrain once. On the lent H200 those imports initialised CUDA in the server
(torch asks the device whether Triton can use it), and every rank forked from it
failed with "Cannot re-initialize CUDA in forked subprocess": with CUDA visible
the ranks are spawned, each a child of the caller.
"""

from __future__ import annotations

import os

from kvtrain import testing


def _parent(rank: int, world_size: int) -> int:
    return os.getppid()


def test_with_cuda_visible_the_ranks_are_spawned_by_the_caller(monkeypatch):
    monkeypatch.setattr(testing, "cuda_visible", lambda: True, raising=False)
    assert testing.run_distributed(_parent, 2, timeout=300) == [os.getpid()] * 2


def test_without_cuda_the_ranks_fork_from_the_import_server():
    first, second = testing.run_distributed(_parent, 2)
    assert first == second != os.getpid()


def test_asking_whether_cuda_is_visible_leaves_the_environment_as_it_was(monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "0")
    testing.cuda_visible()
    assert os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] == "0"
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK")
    testing.cuda_visible()
    assert "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
