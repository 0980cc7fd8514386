"""Summaries of a loss by position in the context (``kvtrain perplexity
--by-position``'s records), without torch: the in-context learning score and the
log-spaced bins ``kvtrain perplexity`` prints and ``kvtrain compare`` plots."""

from __future__ import annotations

from typing import Optional

# Olsson et al. (2022), "In-context Learning and Induction Heads": loss at the 500th
# token minus loss at the 50th; here as 0-based positions (500 and 50 tokens of context)
ICL_LATE, ICL_EARLY = 499, 49


def icl_score(means: list) -> Optional[float]:
    """Loss with 500 tokens of context minus loss with 50 (None where the sequences
    are shorter or no token was scored there): negative when context helps."""
    if len(means) <= ICL_LATE or means[ICL_LATE] is None or means[ICL_EARLY] is None:
        return None
    return means[ICL_LATE] - means[ICL_EARLY]


def binned(means: list, counts: list[int]) -> list[tuple[int, int, Optional[float]]]:
    """``(first, last, mean)`` over context lengths 1, 2-3, 4-7, ... (token-weighted)."""
    out, first = [], 1
    while first <= len(means):
        last = min(2 * first - 1, len(means))
        tokens = sum(counts[first - 1:last])
        total = sum(m * c for m, c in zip(means[first - 1:last], counts[first - 1:last])
                    if m is not None)
        out.append((first, last, total / tokens if tokens else None))
        first *= 2
    return out


__all__ = ["ICL_EARLY", "ICL_LATE", "binned", "icl_score"]
