"""Options of the toy tasks: the ``data.induction`` and ``data.ngram`` sections
of a run config (``kvtrain.config.schema.DataConfig``). The sample generators
(``kvtrain.tasks.sequences``) extend these classes with the model's sequence
length, so every option is declared here only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

TASK_TYPES = ("induction", "ngram", "hop")
"""The ``data.type`` values that are toy tasks."""

MASKS = {
    "induction": ("induction_first", "induction_all"),
    "ngram": ("ngram_first", "ngram_all"),
    "hop": ("hop_all", "hop_all"),
}
"""Per task: the masks reported as ``accuracy`` (primary: the paper's first
prediction position / 3-grams not yet seen in the sequence / every k-hop
position) and ``accuracy_all``."""


def accuracy_masks(data) -> tuple[str, ...]:
    """The masks scored for ``data`` (a DataConfig, or its ``type``; none for text
    data): the hop task also scores each hop count on its own (``hop_K``)."""
    kind = data if isinstance(data, str) else data.type
    masks = MASKS.get(kind, ())
    if kind == "hop" and not isinstance(data, str):
        masks = ("hop_all",) + tuple(f"hop_{k}" for k in data.hop.hop_counts)
    return masks


@dataclass
class InductionDataConfig:
    """Options of ``data.type: induction``: the induction data of the paper's
    Appendix K (paper defaults: length 512, ids 11..7999 of an 8000
    vocabulary, pool = length)."""

    length: Optional[int] = None
    """Tokens generated per sequence before 0-padding (App. K ``length``);
    null: train.seq_length + 1 (no padding)."""
    mid_val: int = 10
    """Token ids are drawn from mid_val+1 .. max_val-1 (App. K ``mid_val``)."""
    max_val: int = 8000
    """Exclusive upper bound of the ids (<= model.vocab_size)."""
    pool_size: Optional[int] = None
    """Distinct ids per sequence (null: data.induction.length, or train.seq_length where
    that is null, as in Appendix K)."""
    variant: Literal["appk", "strict"] = "appk"
    """appk: Appendix K's script (copies after each repeat, fresh draws
    otherwise); strict: §3.2's rule at every position (periodic after the
    first repeat)."""

    @property
    def vocab_size(self) -> int:
        """Smallest vocabulary that holds every id of the task."""
        return self.max_val


@dataclass
class HopDataConfig:
    """Options of ``data.type: hop``: the k-hop induction heads task of Appendix E.1
    (Sanford et al. 2024's; their defaults: 4 symbols, hops 0..16, length 100)."""

    alphabet: int = 4
    """Distinct symbols of the random string (never the same one twice in a row)."""
    min_hops: int = 0
    """Fewest hops a sequence asks for (0: the symbol itself)."""
    max_hops: int = 16
    """Most hops a sequence asks for; each sequence draws its k uniformly."""

    @property
    def hop_counts(self) -> range:
        return range(self.min_hops, self.max_hops + 1)

    @property
    def vocab_size(self) -> int:
        """0 (unused), a token per hop count, the symbols, "no such position", blank."""
        return 1 + len(self.hop_counts) + self.alphabet + 2


@dataclass
class NgramDataConfig:
    """Options of ``data.type: ngram``: the 3-gram task of Appendix E.3."""

    num_pairs: int = 200
    """(x1, x2) pairs, each with a fixed x3 (paper: about 200)."""
    num_symbols: int = 32
    """Distinct ids used for x1, x2, x3 (mid_val+1 .. mid_val+num_symbols)."""
    mid_val: int = 10
    """Ids at or below mid_val are not used (0 pads)."""
    table_seed: int = 0
    """Seed of the pair table (the task; the same for training and validation)."""

    @property
    def vocab_size(self) -> int:
        """Smallest vocabulary that holds every id of the task."""
        return self.mid_val + self.num_symbols + 1
