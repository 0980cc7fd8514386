"""Checkpoints held against deletion while another process reads them.

``kvtrain eval``, ``export`` and ``generate`` may load a checkpoint of a run
that is still training, whose ``checkpoint.keep_last`` deletes old
checkpoints at every save: a load that lost its files half-way failed with a
traceback from deep inside torch's checkpoint reader. Now a reader holds a
shared ``flock`` of ``<checkpoints>/.<iter_N>.readers`` while it loads, and the
trainer deletes a checkpoint only under an exclusive lock of that file, taken
without waiting: a checkpoint being read is kept, and deleted at a later save.
A reader that finds its checkpoint gone once it holds the lock looks again.

Only a trainer's checkpoint folder (it holds the trainer's ``.kvtrain.lock``)
gets these lock files: a checkpoint copied elsewhere has no trainer pruning
beside it. Where the reader may not write into the folder (another user's
run), it reads unprotected, as before. ``flock`` on a shared filesystem is as
coherent as the filesystem makes it (see ``runlock``).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path
from typing import Callable, Iterator

from .runlock import LOCK_FILE

log = logging.getLogger(__name__)
SUFFIX = ".readers"


def lock_file(checkpoint: Path) -> Path:
    """``<checkpoints>/.<iter_N>.readers``: beside the checkpoint, not in it (its
    files are listed and checksummed)."""
    return checkpoint.with_name(f".{checkpoint.name}{SUFFIX}")


@contextlib.contextmanager
def reading(checkpoint: Path) -> Iterator[bool]:
    """Holds ``checkpoint`` against deletion for the block; yields whether it is
    still there (False: it was deleted meanwhile; find the checkpoint again)."""
    if not (checkpoint.parent / LOCK_FILE).exists():  # no trainer saves (or prunes) there
        yield checkpoint.is_dir()
        return
    try:
        fd = os.open(lock_file(checkpoint), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a folder this user may not write into: read as before
        yield checkpoint.is_dir()
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a deletion is under way
        yield checkpoint.is_dir()  # the deletion renames it away under the lock
    finally:
        os.close(fd)


def remove_unless_read(checkpoint: Path, remove: Callable[[Path], None]) -> bool:
    """``remove(checkpoint)`` and its lock file, unless a reader holds it (False)."""
    path = lock_file(checkpoint)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # a reader may open it at once
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.warning("keeping %s for now (keep_last): another process reads it "
                        "(kvtrain eval, export or generate); a later save removes it", checkpoint)
            return False
        remove(checkpoint)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


__all__ = ["lock_file", "reading", "remove_unless_read"]
