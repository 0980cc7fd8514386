"""The toy tasks as map-style datasets for the trainer (``data.type: induction |
ngram``): a training set and a fixed evaluation set of the samples of
``kvtrain.tasks.sequences`` (Appendix K / E.3)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kvtrain.tasks.sequences import Task, task_from_config


@dataclass
class SyntheticDataset:
    """Map-style dataset: ``ds[i]`` is ``task.sample(seed, i)`` as torch tensors.

    ``num_samples`` is only the nominal length (for samplers); any index is
    valid. A training set uses ``seed``, the fixed evaluation set ``eval_seed``
    (see :func:`train_and_eval`).
    """

    task: Task
    num_samples: int
    seed: int = 0
    cache: bool = False
    """Keep generated samples (for a small, reused evaluation set)."""
    _cache: dict = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        import torch

        if self.cache and index in self._cache:
            return self._cache[index]
        sample = {k: torch.from_numpy(v) for k, v in self.task.sample(self.seed, int(index)).items()}
        if self.cache:
            self._cache[index] = sample
        return sample

    def batch(self, indices) -> dict:
        """Stacked samples ``indices`` (a ``[b, s]`` tensor per key)."""
        import torch

        items = [self[i] for i in indices]
        return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def train_and_eval(task: Task, num_train: int, num_eval: int, seed: int = 0,
                   eval_seed: Optional[int] = None) -> tuple[SyntheticDataset, SyntheticDataset]:
    """The training set (``seed``) and the fixed evaluation set (``eval_seed``,
    default ``seed + 1_000_003``; cached, as it is reused at every evaluation)."""
    eval_seed = seed + 1_000_003 if eval_seed is None else eval_seed
    if eval_seed == seed:
        raise ValueError("the evaluation seed must differ from the training seed")
    return (SyntheticDataset(task, num_train, seed),
            SyntheticDataset(task, num_eval, eval_seed, cache=True))


def synthetic_datasets(cfg, train_samples: int, valid_samples: int):
    """(train, valid) datasets of a ``data.type: induction | ngram | hop`` run: training
    samples from the data seed (``data.seed``, else ``train.seed``), validation
    = the fixed evaluation set (``data.eval_seed``, else seed + 1000003);
    valid is None when nothing is evaluated."""
    d = cfg.data
    seed = d.seed if d.seed is not None else cfg.train.seed
    train, valid = train_and_eval(task_from_config(cfg), train_samples, max(valid_samples, 1),
                                  seed, d.eval_seed)
    return train, (valid if valid_samples > 0 else None)
