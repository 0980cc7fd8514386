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


def _fails(rank: int, world_size: int) -> int:
    raise ValueError(f"rank {rank} of {world_size} fails")


def test_a_port_taken_before_rank_0_listens_is_a_new_start(monkeypatch):
    """The group's port is found free in the caller and bound by rank 0's store a
    start later (seconds, where the ranks are spawned): a process that took it in
    between failed the run with EADDRINUSE in rank 0's init (the rare failure of
    ``-k cuda_visible``). Such a start is made again on another port; a failure of
    ``fn`` is not."""
    import pytest

    from kvtrain import backend

    from .scripts import a_taken_port_first

    with a_taken_port_first(monkeypatch, backend):
        first, second = testing.run_distributed(_parent, 2, timeout=120)
    assert first == second != os.getpid()
    with pytest.raises(RuntimeError, match="rank [01] of 2 fails"):
        testing.run_distributed(_fails, 2, timeout=120)
