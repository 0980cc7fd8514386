"""The samples of the paper's toy tasks: induction data (Appendix K) and the
3-gram control (Appendix E.3). The datasets the trainer reads are built on
them in ``kvtrain.data.induction``.

Every sample is a pure function of ``(task, seed, index)``, so any sample can
be regenerated after a restart (resume-safe, no state), and the evaluation set
is simply the first ``n`` indices under a separate ``eval_seed``. A sample is
the dict megatron's ``GPTDataset`` yields, plus the scoring masks:

* ``tokens`` ``[s]`` int64, ``labels`` ``[s]`` int64 (the next token),
  ``loss_mask`` ``[s]`` float32 (0 where the label is padding),
  ``position_ids`` ``[s]`` int64;
* induction: ``induction_first`` / ``induction_all`` ``[s]`` bool - the input
  positions whose *next* token (``labels[p]``) is determined by an earlier
  occurrence of ``tokens[p]``; the paper scores the first such position of a
  sequence (Figure 1a/1b), "all" scores every one;
* 3-gram: ``ngram_first`` / ``ngram_all`` ``[s]`` bool - the positions holding
  an x2 whose label is the pair's x3; "first" keeps only pairs not seen earlier
  in the same sequence (pure memory, no in-context copy possible), "all" every
  x3.

``predict_mask`` is an alias of the task's primary mask
(``induction_first`` / ``ngram_first``).

Appendix K, as printed (the ``<``/``>`` lost in one extraction are restored from
the arXiv text)::

    def generate_array(length=512, min_val=1, mid_val=10, max_val=8000):
        lis = list(range(mid_val+1, max_val)); random.shuffle(lis); lis = lis[:length]
        array, predict_positions, di = [], [], {}
        while len(array) < length:
            x = random.choice(lis)
            if (len(array) == 0) or (x != array[-1]):
                if x not in di:
                    if len(array) > 0:
                        di[array[-1]] = x
                    di[x] = -1
                    array.append(x)
                else:
                    predict_positions.append(len(array))
                    array.append(x)
                    array.append(di[x])
        if len(predict_positions) == 0: return generate_array(...)   # "regenerated"
        return array + [0]*(512-len(array)), predict_positions[0:1]

i.e. tokens are drawn (with replacement, never the same token twice in a row)
from a per-sequence pool of ``length`` distinct ids in ``(mid_val, max_val)``;
a token seen before is followed by a copy of the token that followed it, and
the position of that repeated token is a prediction position (the paper
scores the first one; 0 pads). ``min_val`` is unused by the script (ids
``1..mid_val`` stay free).

Two places where the script, read literally, disagrees with the rule the paper
states in §3.2 ("when the jth token is the same as the ith token, then the
(j+1)th token is the same as the (i+1)th token"), and what this module does:

1. The script records a successor only when the next token is a *fresh* draw:
   a token followed by a repeated token keeps ``di = -1`` (or a stale
   successor), so a later repeat of it emits ``-1`` (not a token id) or a
   successor that contradicts its latest occurrence. Here the successor map is
   updated on every append, so a repeated token is always followed by the
   token that followed its **latest** earlier occurrence (the induction-head
   rule of §2.1: "find the latest same previous instance of the current token
   ... and the token that came after it"). At the first prediction position -
   the one the paper scores - the two agree exactly (every earlier token is
   distinct there).
2. §3.2's rule taken for *every* pair of equal tokens is stronger than the
   script: the copied token y at j+1 equals the one at i+1, so j+2 must copy
   i+2, and so on - the sequence becomes periodic after its first repeat. The
   script does not do that (after the copy it draws fresh tokens again). The
   default ``variant="appk"`` follows the script (the rule holds at every
   prediction position); ``variant="strict"`` follows §3.2 literally (after the
   first repeat the sequence continues periodically, and every position from
   there on is a prediction position).

Other knobs (for CPU-sized runs): ``length`` (the script ties the pool size to
it; ``pool_size`` can decouple them - the position of the first repeat, hence
the difficulty of the scored prediction, depends only on the pool size,
about ``sqrt(pi * pool / 2)``), and the sequence length ``seq_length`` of the
model. The raw sequence has ``seq_length + 1`` tokens (tokens = raw[:-1],
labels = raw[1:], as in megatron), so the last position also has a label.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import numpy as np

from .config import InductionDataConfig, NgramDataConfig

PAD = 0

# Domain separation of the random streams: (task, seed, index) -> sample.
_TASK_STREAM = {"induction": 0x1D, "ngram": 0x3E, "ngram_table": 0x3F, "hop": 0x4B}


def sample_rng(task: str, seed: int, index: int) -> np.random.Generator:
    """The generator of sample ``index`` under ``seed`` (independent of any
    other sample, so samples can be generated in any order or regenerated)."""
    return np.random.default_rng(np.random.SeedSequence([_TASK_STREAM[task], int(seed), int(index)]))


class _Draws:
    """Integers in [0, n) drawn from ``rng`` in chunks (per-call numpy is slow)."""

    def __init__(self, rng: np.random.Generator, n: int, chunk: int):
        self.rng, self.n, self.chunk = rng, n, max(16, chunk)
        self.buf: list[int] = []
        self.pos = 0

    def __call__(self) -> int:
        if self.pos == len(self.buf):
            self.buf = self.rng.integers(0, self.n, size=self.chunk).tolist()
            self.pos = 0
        self.pos += 1
        return self.buf[self.pos - 1]


# ----------------------------------------------------------------------------- induction (App. K)
def appk_sequence(rng: np.random.Generator, length: int = 512, mid_val: int = 10,
                  max_val: int = 8000, pool_size: Optional[int] = None,
                  variant: Literal["appk", "strict"] = "appk") -> tuple[list[int], list[int]]:
    """One raw induction sequence of exactly ``length`` tokens (no padding) and
    its prediction positions (every ``p`` with ``p + 1 < length`` whose next
    token is a copy), following Appendix K (see the module docstring).

    ``pool_size`` (default ``length``, as in the script) distinct ids are drawn
    from ``mid_val+1 .. max_val-1``; tokens are drawn from that pool with
    replacement, never the previous token again. A fresh token is appended; a
    token seen before is appended followed by the token that followed its
    latest occurrence (``variant="appk"``), or, with ``variant="strict"``, the
    sequence continues as a copy of itself from that earlier occurrence
    (periodic). Sequences without a prediction position are regenerated (the
    script's rule) from the same generator.
    """
    pool_size = length if pool_size is None else pool_size
    if pool_size < 2 or max_val - mid_val - 1 < pool_size:
        raise ValueError(f"need 2 <= pool_size ({pool_size}) <= max_val - mid_val - 1 "
                         f"({max_val - mid_val - 1})")
    # the first repeat comes at position 2 at the earliest and needs its label after
    # it: a shorter sequence never holds one, and regenerating would loop forever
    if length < 4:
        raise ValueError(f"length must be >= 4, got {length}")
    while True:
        pool = (rng.permutation(max_val - mid_val - 1)[:pool_size] + mid_val + 1).tolist()
        draw = _Draws(rng, pool_size, chunk=length)
        array: list[int] = []
        predict: list[int] = []
        succ: dict[int, int] = {}  # token -> the token after its latest occurrence
        last_pos: dict[int, int] = {}
        while len(array) < length:
            x = pool[draw()]
            if array and x == array[-1]:
                continue
            if x not in last_pos:  # fresh
                _append(array, succ, last_pos, x)
                continue
            # x was seen before: its next token is determined by an earlier occurrence.
            if variant == "strict":
                period = len(array) - last_pos[x]
                predict.extend(range(len(array), length - 1))
                while len(array) < length:
                    array.append(array[-period])
                break
            y = succ[x]  # x != array[-1], so x's latest occurrence has a successor
            predict.append(len(array))
            _append(array, succ, last_pos, x)
            _append(array, succ, last_pos, y)
        del array[length:]  # a copy at the last slot may overshoot by one
        predict = [p for p in predict if p + 1 < length]
        if predict:
            return array, predict


def _append(array: list[int], succ: dict[int, int], last_pos: dict[int, int], x: int) -> None:
    if array:
        succ[array[-1]] = x
    last_pos[x] = len(array)
    array.append(x)


@dataclass
class InductionTask(InductionDataConfig):
    """Induction data of Appendix K: the ``data.induction`` options plus the
    model's sequence length."""

    seq_length: int = 512
    """Model sequence length s (a sample has s tokens and s labels)."""

    @property
    def raw_length(self) -> int:
        return self.seq_length + 1 if self.length is None else min(self.length, self.seq_length + 1)

    def generate(self, rng: np.random.Generator) -> tuple[list[int], list[int]]:
        pool = self.pool_size if self.pool_size is not None else (self.length or self.seq_length)
        return appk_sequence(rng, self.raw_length, self.mid_val, self.max_val, pool, self.variant)

    def sample(self, seed: int, index: int) -> dict[str, np.ndarray]:
        raw, predict = self.generate(sample_rng("induction", seed, index))
        out = _frame(raw, self.seq_length)
        first = np.zeros(self.seq_length, dtype=bool)
        every = np.zeros(self.seq_length, dtype=bool)
        first[predict[0]] = True
        every[predict] = True
        out["induction_first"] = first
        out["induction_all"] = every
        out["predict_mask"] = first
        return out


# ----------------------------------------------------------------------------- 3-gram (App. E.3)
def ngram_table(num_pairs: int, num_symbols: int, mid_val: int, seed: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The fixed 3-gram "language" of Appendix E.3: ``num_pairs`` distinct
    (x1, x2) pairs, each with a random x3. Ids are ``mid_val+1 .. mid_val+num_symbols``.

    Returns ``pairs [num_pairs, 2]`` and ``x3 [num_pairs]`` (int64). With a small
    alphabet every symbol occurs in several pairs, so x3 depends on both x1 and
    x2 (a true 3-gram, not a bigram of x2).
    """
    if num_pairs > num_symbols * num_symbols:
        raise ValueError(f"num_pairs ({num_pairs}) > num_symbols^2 ({num_symbols ** 2})")
    rng = sample_rng("ngram_table", seed, 0)
    flat = rng.choice(num_symbols * num_symbols, size=num_pairs, replace=False)
    pairs = np.stack([flat // num_symbols, flat % num_symbols], axis=1) + mid_val + 1
    x3 = rng.integers(0, num_symbols, size=num_pairs) + mid_val + 1
    return pairs.astype(np.int64), x3.astype(np.int64)


@dataclass
class NgramTask(NgramDataConfig):
    """The 3-gram task of Appendix E.3: "we randomly generated approximately 200
    pairs of x1 and x2, and then we randomly generated x3 for each pair. The
    model needs to accurately predict x3 when seeing x1 and x2." A sequence is
    a run of triples (x1, x2, x3) drawn uniformly from the table; x3 positions
    are scored. The table (``table_seed``) is shared by training and evaluation."""

    seq_length: int = 512
    """Model sequence length s."""

    def table(self) -> tuple[np.ndarray, np.ndarray]:
        return _cached_table(self.num_pairs, self.num_symbols, self.mid_val, self.table_seed)

    def sample(self, seed: int, index: int) -> dict[str, np.ndarray]:
        pairs, x3 = self.table()
        rng = sample_rng("ngram", seed, index)
        n_raw = self.seq_length + 1
        rows = rng.integers(0, len(pairs), size=-(-n_raw // 3))
        raw = np.concatenate([pairs[rows], x3[rows, None]], axis=1).reshape(-1)[:n_raw]
        out = _frame(raw.tolist(), self.seq_length)
        every = np.zeros(self.seq_length, dtype=bool)
        first = np.zeros(self.seq_length, dtype=bool)
        seen: set[int] = set()
        for t, row in enumerate(rows.tolist()):
            p = 3 * t + 1  # position of x2; its label is x3
            if p >= self.seq_length:
                break
            every[p] = True
            first[p] = row not in seen
            seen.add(row)
        out["ngram_all"] = every
        out["ngram_first"] = first
        out["predict_mask"] = first
        return out


_TABLES: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}


def _cached_table(num_pairs: int, num_symbols: int, mid_val: int, seed: int):
    key = (num_pairs, num_symbols, mid_val, seed)
    if key not in _TABLES:
        _TABLES[key] = ngram_table(num_pairs, num_symbols, mid_val, seed)
    return _TABLES[key]


# ----------------------------------------------------------------------------- framing
def _frame(raw: list[int], seq_length: int) -> dict[str, np.ndarray]:
    """GPTDataset-style tensors from a raw token list (padded with 0 to s+1)."""
    full = np.full(seq_length + 1, PAD, dtype=np.int64)
    n = min(len(raw), seq_length + 1)
    full[:n] = raw[:n]
    loss_mask = np.zeros(seq_length, dtype=np.float32)
    loss_mask[: max(n - 1, 0)] = 1.0  # labels raw[1:n] are real tokens
    return {
        "tokens": full[:-1].copy(),
        "labels": full[1:].copy(),
        "loss_mask": loss_mask,
        "position_ids": np.arange(seq_length, dtype=np.int64),
    }


Task = InductionTask | NgramTask  # and hops.HopTask, which imports this module


def build_task(kind: str, seq_length: int, **options) -> "Task":
    """``kind`` = induction | ngram | hop, with that task's options (its dataclass fields)."""
    from .hops import HopTask

    tasks = {"induction": InductionTask, "ngram": NgramTask, "hop": HopTask}
    if kind not in tasks:
        raise ValueError(f"unknown synthetic task {kind!r}; one of {', '.join(tasks)}")
    return tasks[kind](seq_length=seq_length, **options)


def task_from_config(cfg) -> "Task":
    """The task of a run config with ``data.type: induction | ngram | hop`` (options
    from ``data.induction`` / ``data.ngram`` / ``data.hop``; sequence length
    ``train.seq_length``)."""
    import dataclasses

    d = cfg.data
    options = dataclasses.asdict(getattr(d, d.type))
    return build_task(d.type, cfg.train.seq_length, **options)


def _check_counts(d) -> None:
    """The toy task's counts and seed in range, each named (numpy's own words were
    'high <= 0' or 'negative dimensions are not allowed', naming only the section)."""
    options = getattr(d, d.type)
    least = {"ngram": {"num_pairs": 1, "num_symbols": 1, "mid_val": 0, "table_seed": 0},
             "hop": {"alphabet": 2, "min_hops": 0, "max_hops": 0},
             "induction": {"length": 1, "mid_val": 0, "pool_size": 1}}[d.type]
    for key, low in least.items():
        value = getattr(options, key)
        if value is not None and value < low:
            raise ValueError(f"data.{d.type}.{key} must be >= {low}, got {value}")
    if d.type == "ngram" and d.ngram.table_seed >= 2**32:
        raise ValueError(f"data.ngram.table_seed must be below 2**32, got {d.ngram.table_seed}")


def validate_config(cfg) -> None:
    """Cross-field checks of a run config with ``data.type: induction | ngram | hop``.
    Raises ``ValueError`` with one line naming the keys (``RunConfig.validate``
    reports it as a config error; this package imports no config module)."""
    d = cfg.data
    if d.reset_attention_mask or d.eod_mask_loss:
        raise ValueError(f"data.type {d.type} has one sequence per sample: "
                         "data.reset_attention_mask/eod_mask_loss must be false")
    _check_counts(d)
    # the shortest window that holds a scored position (induction: x y x and the label;
    # ngram: x1 x2 and the label x3), named by its key: induction's own check named
    # data.induction.length, which the user may not have set, and ngram scored nothing
    # (every validation's accuracy NaN)
    least = {"induction": 3, "ngram": 2}.get(d.type)
    if least is not None and cfg.train.seq_length < least:
        raise ValueError(f"train.seq_length ({cfg.train.seq_length}) must be >= {least} for "
                         f"data.type {d.type}: a shorter sequence holds no scored position")
    # a longer length was cut to the window, silently, and kept as the pool's size
    window = cfg.train.seq_length + 1
    if d.type == "induction" and d.induction.length is not None and d.induction.length > window:
        raise ValueError(f"data.induction.length ({d.induction.length}) exceeds train.seq_length "
                         f"+ 1 ({window}), the tokens a sample holds: raise train.seq_length, "
                         "or set data.induction.pool_size for a larger pool in this window")
    task = task_from_config(cfg)
    if task.vocab_size > cfg.model.vocab_size:
        key = {"induction": "data.induction.max_val",
               "ngram": "data.ngram.mid_val + data.ngram.num_symbols + 1",
               "hop": "the hop task's tokens (data.hop: 1 + hop counts + alphabet + 2)"}[d.type]
        raise ValueError(f"{key} ({task.vocab_size}) exceeds model.vocab_size "
                         f"({cfg.model.vocab_size})")
    try:
        if d.type == "hop":
            task.check()
        task.sample(0, 0)
    except ValueError as e:
        raise ValueError(f"data.{d.type}: {e}") from None
    seed = d.seed if d.seed is not None else cfg.train.seed
    if d.eval_seed is not None and d.eval_seed == seed:
        raise ValueError(f"data.eval_seed ({d.eval_seed}) must differ from the training data "
                         f"seed ({seed})")
