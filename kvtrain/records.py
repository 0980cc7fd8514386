"""A run's ``metrics.jsonl`` as data: reading its records, and which trained
iterations no train record stands for. Shared by the trainer, which writes the
file, and by ``kvtrain compare`` and the experiments, which read it; imports no
torch.

A train record at iteration ``i`` with ``steps_in_window`` ``k`` stands for
the iterations ``i-k+1 .. i``; a whole history's train records stand for
``1 .. N`` (or ``K+1 .. N``, begun from another run's checkpoint K). An
iteration none stands for was trained but its record is not in
the file: a disk that stayed full to the end of a run (the trainer names the
records it never wrote, in a log that may be on that same disk), or a file
edited by hand. The start that resumes after such a gap names it once, in an
event record with ``missing_iterations: [[first, last], ...]``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

METRICS_FILE = "metrics.jsonl"

Spans = list[tuple[int, int]]  # [(first, last)] iterations, both included


def read_records(path: Path) -> tuple[list[dict], int]:
    """The JSON objects of ``metrics.jsonl`` and how many lines were not one
    (a line cut by a crash, say)."""
    records, bad = [], 0
    for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if isinstance(rec, dict):
            records.append(rec)
        else:
            bad += 1
    return records, bad


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _named(record: dict) -> Spans:
    """The spans an event record names as missing (``missing_iterations``)."""
    spans = record.get("missing_iterations") if record.get("kind") == "event" else None
    if not isinstance(spans, list):
        return []
    return [(s[0], s[1]) for s in spans
            if isinstance(s, list) and len(s) == 2 and all(map(_whole, s))]


def unrecorded(records: list[dict], through: Optional[int] = None,
               named_too: bool = False) -> Spans:
    """The iterations that no train record stands for, as spans: from the file's
    first record on (where its history began: iteration 0, or the checkpoint of
    another run an explicit ``checkpoint.resume`` started from) up to ``through``
    (by default the last one a record stands for). Spans an event already names
    count as recorded, unless ``named_too`` (a curve's gaps). Nothing when a train
    record does not say its window (an older kvtrain's), or the file is empty."""
    began = records[0].get("iteration") if records else None
    if not _whole(began):
        return []
    stood: Spans = []
    for record in records:
        if record.get("kind") == "train":
            last, steps = record.get("iteration"), record.get("steps_in_window")
            if not (_whole(last) and _whole(steps)) or steps < 0:
                return []
            if steps:
                stood.append((last - steps + 1, last))
        elif not named_too:
            stood += _named(record)
    if through is None:
        through = max((last for _, last in stood), default=0)
    gaps, first_unseen = [], began + 1
    for first, last in sorted(stood):
        if first > first_unseen and first_unseen <= through:
            gaps.append((first_unseen, min(first - 1, through)))
        first_unseen = max(first_unseen, last + 1)
    if first_unseen <= through:
        gaps.append((first_unseen, through))
    return gaps


def spans_text(spans: Spans) -> str:
    """``[(41, 60), (75, 75)]`` -> ``"41-60 and 75"``."""
    parts = [f"{a}" if a == b else f"{a}-{b}" for a, b in spans]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


__all__ = ["METRICS_FILE", "Spans", "read_records", "spans_text", "unrecorded"]
