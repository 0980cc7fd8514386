"""Reports and records written whole, and a full disk said in one line.

What the analysis and the runners write (a comparison's report, a runner's
``spec.json`` that its next run reads, the plots), and a run's ``config.yaml``,
goes to a file beside its place and is renamed over it once whole (``data_tools.fileio.atomic_open``):
a full disk or a quota leaves the file that was there, not a cut one, and is
reported as ``kvtrain: output error: writing PATH failed: REASON; ...``, not as
an ``OSError`` traceback.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator

from data_tools.fileio import atomic_open
from kvtrain.config import ConfigError


class OutputError(ConfigError):
    """A report or record could not be written (a full disk, a quota)."""

    kind = "output error"


@contextmanager
def written_whole(path: str | Path, mode: str = "w", **kwargs) -> Iterator[IO]:
    """A file to write ``path`` through, renamed over it once written (text: UTF-8)."""
    if "b" not in mode:  # as data_tools.fileio.atomic_write_text writes text
        kwargs.setdefault("encoding", "utf-8")
        kwargs.setdefault("newline", "\n")
    try:
        with atomic_open(path, mode, **kwargs) as f:
            yield f
    except OSError as e:
        raise OutputError(f"writing {path} failed: {e.strerror or e}; what was there before "
                          "is kept") from None


def write_whole(path: str | Path, text: str) -> None:
    """``text`` into ``path``, whole (``written_whole``)."""
    with written_whole(path) as f:
        f.write(text)


__all__ = ["OutputError", "write_whole", "written_whole"]
