"""The k-hop induction heads task (Appendix E.1, Figure 8; Sanford, Hsu and
Telgarsky 2024, "Transformers, parallel computation, and logarithmic depth").

A string ``x`` of symbols (an alphabet of ``A``, never the same symbol twice in a
row) and a hop count ``k``. One hop from position ``i`` is the induction head's
step: find the latest earlier occurrence of ``x[i]`` and move to the position
after it, ``hop(i) = max{j < i : x[j] = x[i]} + 1`` (none: the position does not
exist). ``hop_k(x)[i]`` is the symbol at ``hop^k(i)`` (``k = 0``: ``x[i]``
itself), or "no such position" once a hop finds none. Sanford et al. prove that a
transformer needs (and can do with) depth of order log k; the paper finds KV
shifting still accurate at 16 hops where vanilla degrades past 8 (L = 5).

A sample of length s (the model's sequence length), as Sanford et al.'s code lays
it out: the input is the token of k, then ``x[0 .. s-2]``; the label at input
position ``p >= 1`` is ``hop_k(x)[p-1]``, at the same position (a labelling of
the string read so far, not its next token; ``hop_k(x)[i]`` depends on
``x[0 .. i]`` only, so a causal model can compute it), and a blank at position 0.
Every position is trained on; ``hop_all`` scores positions 1 .. s-1 (the blank
is given away) and ``hop_K`` the same positions of the sequences with k = K, so
the error rate of each hop count is ``1 - val_acc_hop_K``.

Token ids: 0 unused; 1 .. H the hop counts min_hops .. max_hops; then the A
symbols, "no such position" and the blank (``HopDataConfig.vocab_size``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import HopDataConfig
from .sequences import sample_rng


def hop_positions(x: np.ndarray) -> np.ndarray:
    """``[n]``: one hop from each position, ``max{j < i : x[j] = x[i]} + 1``, -1 where
    ``x[i]`` did not occur before."""
    out = np.full(len(x), -1, dtype=np.int64)
    last: dict[int, int] = {}
    for i, symbol in enumerate(x.tolist()):
        if symbol in last:
            out[i] = last[symbol] + 1
        last[symbol] = i
    return out


def hop_k(x: np.ndarray, k: int) -> np.ndarray:
    """``[n]``: the position ``k`` hops from each position (-1: none), k >= 0."""
    step = hop_positions(x)
    where = np.arange(len(x), dtype=np.int64)
    for _ in range(k):
        where = np.where(where >= 0, step[np.maximum(where, 0)], -1)
    return where


def symbol_string(rng: np.random.Generator, n: int, alphabet: int) -> np.ndarray:
    """``[n]`` symbols 0 .. alphabet-1, never the same one twice in a row."""
    first = rng.integers(0, alphabet)
    steps = rng.integers(1, alphabet, size=n - 1)  # a shift of 1 .. A-1: another symbol
    return np.concatenate([[first], first + np.cumsum(steps)]) % alphabet


@dataclass
class HopTask(HopDataConfig):
    """The k-hop task: the ``data.hop`` options plus the model's sequence length."""

    seq_length: int = 100
    """Model sequence length s: a sample holds the token of k and s-1 symbols."""

    @property
    def symbol0(self) -> int:
        return 1 + len(self.hop_counts)

    @property
    def missing(self) -> int:
        return self.symbol0 + self.alphabet  # "no such position"

    @property
    def blank(self) -> int:
        return self.missing + 1

    def check(self) -> None:
        if self.alphabet < 2:
            raise ValueError(f"alphabet must be >= 2, got {self.alphabet}")
        if not 0 <= self.min_hops <= self.max_hops:
            raise ValueError(f"need 0 <= min_hops ({self.min_hops}) <= max_hops "
                             f"({self.max_hops})")
        if self.seq_length < 2:
            raise ValueError(f"needs train.seq_length >= 2, got {self.seq_length}")

    def sample(self, seed: int, index: int) -> dict[str, np.ndarray]:
        rng = sample_rng("hop", seed, index)
        s = self.seq_length
        k = int(rng.integers(self.min_hops, self.max_hops + 1))
        x = symbol_string(rng, s - 1, self.alphabet)  # [s-1]
        where = hop_k(x, k)  # [s-1]
        answer = np.where(where >= 0, self.symbol0 + x[np.maximum(where, 0)], self.missing)
        tokens = np.concatenate([[1 + k - self.min_hops], self.symbol0 + x]).astype(np.int64)
        labels = np.concatenate([[self.blank], answer]).astype(np.int64)
        scored = np.ones(s, dtype=bool)
        scored[0] = False  # the blank: given away
        out = {"tokens": tokens, "labels": labels, "loss_mask": np.ones(s, dtype=np.float32),
               "position_ids": np.arange(s, dtype=np.int64), "hop_all": scored,
               "predict_mask": scored}
        none = np.zeros(s, dtype=bool)
        for count in self.hop_counts:
            out[f"hop_{count}"] = scored if count == k else none
        return out


__all__ = ["HopTask", "hop_k", "hop_positions", "symbol_string"]
