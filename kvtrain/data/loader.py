"""Micro-batch iterators that resume exactly: the sample order is a pure
function of the number of samples consumed so far.

Step ``k`` draws the global samples ``[k*G, (k+1)*G)`` (G = global batch
size) of the dataset's own (shuffled) order; micro batch ``m`` of data-parallel
rank ``r`` is ``[base + m*B*D + r*B, ... + B)`` with B the micro batch size and
D the data-parallel size. That is megatron's ``MegatronPretrainingSampler``
order, so every (TP, PP, DP) layout trains on the same sequences in the same
optimizer steps and a resumed run continues with exactly the next batch.

Making an iterator draws nothing from torch's global RNG: each ``DataLoader``
has a ``torch.Generator`` of its own (``iter()`` draws the workers' base seed
from the loader's generator, else from the global one). A resumed run makes
its iterator after the checkpoint restored the global RNG, an uninterrupted
run before step 1, and a validation makes new ones at every evaluation: a draw
from the global RNG would shift every later dropout mask.
"""

from __future__ import annotations

import atexit
import functools
import signal
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader

from kvtrain.config import ConfigError


class PretrainingBatchSampler:
    """Yields this rank's micro batches of indices, from ``consumed_samples`` on."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int):
        if consumed_samples > total_samples:
            raise ValueError(f"consumed samples {consumed_samples} exceed the dataset "
                             f"({total_samples})")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.rank = dp_rank
        self.dp = dp_size

    def __len__(self) -> int:
        return (self.total - self.consumed) // (self.mbs * self.dp)

    def __iter__(self) -> Iterator[list[int]]:
        stride = self.mbs * self.dp
        start = self.consumed
        while start + stride <= self.total:
            first = start + self.rank * self.mbs
            yield list(range(first, first + self.mbs))
            start += stride


def _worker_init(_worker_id: int) -> None:
    # SIGTERM/SIGUSR1 ask the *trainer* to stop at a step boundary (SLURM sends
    # them to every process of the job), as does Ctrl-C (SIGINT, to the terminal's
    # whole process group): a loader worker that died of it would make the trainer
    # fail instead of saving. Workers end with their parent.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    torch.set_num_threads(1)


def _own_generator(seed: int, dp_rank: int) -> torch.Generator:
    """The loader's generator: its only draw is the workers' base seed (the
    samples' order is fixed by the sampler), the same at every start."""
    return torch.Generator().manual_seed(seed * 65537 + dp_rank)


def micro_batches(dataset, consumed_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int, num_workers: int = 0,
                  seed: int = 0) -> Iterator[dict[str, torch.Tensor]]:
    """An iterator of this rank's micro batches (dicts of ``[b, s]`` tensors:
    tokens, labels, loss_mask, position_ids, and attention_mask ``[b, 1, s, s]``
    when the dataset makes one); ``seed``: the run's, for the loader's generator."""
    sampler = PretrainingBatchSampler(len(dataset), consumed_samples, micro_batch_size,
                                      dp_rank, dp_size)
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        worker_init_fn=_worker_init if num_workers > 0 else None,
        pin_memory=False,
        persistent_workers=False,
        prefetch_factor=2 if num_workers > 0 else None,
        generator=_own_generator(seed, dp_rank),
    )
    iterator = iter(loader)
    if num_workers > 0:
        _stopped_at_exit().add(iterator)
    return iterator


@functools.cache
def _stopped_at_exit() -> "weakref.WeakSet":
    """The iterators whose loader workers the process's exit stops first. Python's
    exit ends child processes with SIGTERM, then waits for them: the workers ignore
    it (``_worker_init``), so a process whose iterator was still alive at its exit
    (a step that raised: its traceback holds the loop's frame) hung there forever,
    its traceback printed. Registered after multiprocessing's own exit handler (the
    first iterator started workers), so it runs before it."""
    live: weakref.WeakSet = weakref.WeakSet()
    atexit.register(_stop_workers, live)
    return live


def _stop_workers(live: "weakref.WeakSet") -> None:
    for iterator in list(live):
        shutdown = getattr(iterator, "_shutdown_workers", None)  # torch's own, as on del
        if shutdown is not None:
            shutdown()  # asks each worker to end, waits for it (5 s)
        for worker in getattr(iterator, "_workers", ()):
            if worker.is_alive():  # one stuck in a sample ignores torch's SIGTERM too
                worker.kill()


class LoaderWorkerDied(ConfigError):
    """A data loader worker process died (the kernel's out-of-memory killer): one
    line, not torch's traceback from inside megatron's schedule."""

    kind = "data error"


@contextmanager
def loader_deaths_named(num_workers: int) -> Iterator[None]:
    """torch's error for a loader worker that died, as one line. torch raises it from
    its SIGCHLD handler, wherever the trainer is at that moment (usually inside
    megatron's schedule), so it is caught around the whole training loop."""
    try:
        yield
    except RuntimeError as e:
        what = str(e).strip()
        if not what.startswith("DataLoader worker"):
            raise
        oom = " (SIGKILL: what the kernel's out-of-memory killer sends, see dmesg)" \
            if "Killed" in what else ""
        raise LoaderWorkerDied(
            f"a data loader process ended: {what.rstrip('. ')}{oom}; data.num_workers is "
            f"{num_workers}. The run stops here; a start resumes from the last checkpoint"
        ) from None


def fixed_batches(dataset, num_samples: int, micro_batch_size: int, dp_rank: int,
                  dp_size: int, seed: int = 0) -> Optional[Iterator[dict[str, torch.Tensor]]]:
    """The first ``num_samples`` samples, split like training batches (validation:
    every evaluation sees the same sequences, so val losses compare over time)."""
    if dataset is None:
        return None
    sampler = PretrainingBatchSampler(min(num_samples, len(dataset)), 0, micro_batch_size,
                                      dp_rank, dp_size)
    return iter(DataLoader(dataset, batch_sampler=sampler, num_workers=0,
                           generator=_own_generator(seed, dp_rank)))
