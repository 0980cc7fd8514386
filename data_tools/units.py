"""One way to print counts and rates for people: ``human(1234567) == '1.23M'``.

Used by the data tools' progress line and summaries, ``kvtrain plan`` and the
trainer's log line (standard library only; kvtrain imports it, it imports
nothing of kvtrain).
"""

from __future__ import annotations

SUFFIXES = ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k"))


def human(n: float, unit: str = "", digits: int = 2, sep: str = "") -> str:
    """``n`` with a thousand-power suffix and ``digits`` decimals: 1234567 ->
    '1.23M', ``human(6.7e9, digits=3, sep=" ")`` -> '6.700 B'; below 1000 the
    plain rounded number ('950')."""
    for scale, suffix in SUFFIXES:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f}{sep}{suffix}{unit}"
    return f"{n:.0f}{sep}{unit}".rstrip()
