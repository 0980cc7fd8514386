"""Counters, the progress line and the final summary of ``preprocess``.

The progress line goes to stderr: redrawn in place (``\\r``) a few times a
second on a terminal, one plain line every ``log_interval`` seconds otherwise
(logs of batch jobs). Rates are averages since the start, which for a long
streaming job are steadier and more useful than instantaneous ones. Written
here rather than with tqdm or rich because neither serves the log-file case:
tqdm keeps rewriting one ``\\r`` line into the file, rich's live display
prints nothing until it stops.
"""

from __future__ import annotations

import shutil
import sys
import time
from dataclasses import dataclass, field

from data_tools.readers import REASONS
from data_tools.units import human


@dataclass
class Counts:
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0
    disk_bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def add(self, documents: int, tokens: int, text_bytes: int, disk_bytes: int,
            skipped: dict[str, int]) -> None:
        self.documents += documents
        self.tokens += tokens
        self.text_bytes += text_bytes
        self.disk_bytes += disk_bytes
        for reason, n in skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n

    def merge(self, other: "Counts") -> None:
        self.add(other.documents, other.tokens, other.text_bytes, other.disk_bytes, other.skipped)

    @property
    def skipped_total(self) -> int:
        return sum(self.skipped.values())

    def to_dict(self) -> dict:
        return {"documents": self.documents, "tokens": self.tokens,
                "text_bytes": self.text_bytes, "disk_bytes": self.disk_bytes,
                "skipped": dict(sorted(self.skipped.items()))}

    @classmethod
    def from_dict(cls, d: dict) -> "Counts":
        return cls(d.get("documents", 0), d.get("tokens", 0), d.get("text_bytes", 0),
                   d.get("disk_bytes", 0), dict(d.get("skipped", {})))


def skipped_text(skipped: dict[str, int]) -> str:
    if not skipped:
        return "none"
    order = {r: i for i, r in enumerate(REASONS)}
    items = sorted(skipped.items(), key=lambda kv: order.get(kv[0], len(order)))
    return ", ".join(f"{reason} {n:,}" for reason, n in items)


class Progress:
    def __init__(self, total_disk_bytes: int, *, enabled: bool = True, stream=None,
                 interval: float = 0.25, log_interval: float = 30.0) -> None:
        self.total = total_disk_bytes
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.interval = interval if self.tty else log_interval
        self.start = time.monotonic()
        self._last = self.start
        self._drawn = False

    def line(self, c: Counts, done_disk_bytes: int) -> str:
        dt = max(time.monotonic() - self.start, 1e-9)
        pct = f"{100 * done_disk_bytes / self.total:5.1f}% " if self.total else ""
        return (f"{pct}{human(c.documents)} docs {human(c.tokens)} tokens | "
                f"{human(c.documents / dt)} docs/s {human(c.tokens / dt)} tok/s "
                f"{c.text_bytes / dt / 1e6:.1f} MB/s | skipped {c.skipped_total:,} | "
                f"{_clock(dt)}")

    def update(self, c: Counts, done_disk_bytes: int, force: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not force and now - self._last < self.interval:
            return
        self._last = now
        text = self.line(c, done_disk_bytes)
        if self.tty:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + text[:width].ljust(width))
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        """Print a line (warning, notice) without garbling the progress line."""
        self.clear()
        print(text, file=self.stream, flush=True)

    def clear(self) -> None:
        if self._drawn:
            width = shutil.get_terminal_size((100, 20)).columns - 1
            self.stream.write("\r" + " " * width + "\r")
            self.stream.flush()
            self._drawn = False

    def elapsed(self) -> float:
        return time.monotonic() - self.start


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def summary(total: Counts, elapsed: float, *, dtype: str, outputs: list[str],
            resumed: int = 0, first_bad: list[tuple[str, str, str]] = ()) -> str:
    """The report printed when preprocess finishes."""
    dt = max(elapsed, 1e-9)
    lines = [
        f"preprocess: done in {elapsed:.1f}s",
        f"  documents  {total.documents:,} written, {total.skipped_total:,} skipped "
        f"({skipped_text(total.skipped)})",
        f"  tokens     {total.tokens:,} ({dtype}, EOD included), "
        f"{human(total.tokens / dt)} tokens/s",
        f"  input      {total.disk_bytes / 1e6:.1f} MB on disk, {total.text_bytes / 1e6:.1f} MB "
        f"text, {total.text_bytes / dt / 1e6:.1f} MB/s, {human(total.documents / dt)} docs/s",
    ]
    if resumed:
        lines.append(f"  resumed    {resumed} shard(s) were already complete and kept")
    if first_bad:
        lines.append("  first skipped records:")
        lines += [f"    {loc}: {reason} ({detail})" for loc, reason, detail in first_bad]
    if len(outputs) == 1:
        lines.append(f"  output     {outputs[0]}.bin/.idx")
    else:
        lines.append(f"  output     {len(outputs)} shards: {outputs[0]} ... {outputs[-1]}")
    return "\n".join(lines)
