"""Small file utilities shared by the data tools and the trainer: temporary
names next to their target, atomic replace-by-rename with fsync, durable
directory entries. Standard library only (``kvtrain`` imports this module; it
imports nothing of ``kvtrain``)."""

from __future__ import annotations

import contextlib
import os
import select
import sys
from typing import IO, Iterator


def tmp_name(final: str) -> str:
    """Temporary name next to ``final``: same folder so the rename is atomic;
    the pid says which process owns it, so stale ones can be told apart."""
    return f"{final}.tmp.{os.getpid()}"


def remove_stale_temps(final: str) -> list[str]:
    """Delete ``final.tmp.PID`` files whose process is gone (a killed run)."""
    removed = []
    folder = os.path.dirname(final) or "."
    stem = os.path.basename(final) + ".tmp."
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return removed
    for name in names:
        if not name.startswith(stem):
            continue
        pid = name[len(stem):]
        if pid.isdigit() and _pid_alive(int(pid)) and int(pid) != os.getpid():
            continue  # another live process owns it; leave it alone
        try:
            os.unlink(os.path.join(folder, name))
            removed.append(os.path.join(folder, name))
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(folder: str) -> None:
    """Make renames in ``folder`` durable (POSIX needs the directory synced)."""
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", **kwargs) -> Iterator[IO]:
    """Opens a temporary file next to ``path`` for writing; on success it is
    fsync'd and renamed over ``path`` (and the folder synced), on an exception
    it is removed: ``path`` is either its old self or the whole new file."""
    path = os.fspath(path)
    tmp = tmp_name(path)
    try:
        with open(tmp, mode, **kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(path))


def file_in_the_way(path: str | os.PathLike) -> str | None:
    """The part of ``path`` that is a file where a folder would have to be (or
    ``path`` itself when it is a file), else None: an output folder that
    cannot be made, named before anything is written."""
    part = os.path.abspath(os.fspath(path))
    while not os.path.lexists(part) and os.path.dirname(part) != part:
        part = os.path.dirname(part)
    return part if os.path.lexists(part) and not os.path.isdir(part) else None


def not_a_folder(path: str | os.PathLike) -> str | None:
    """Why the folder ``path`` cannot be used, in words: ``"PATH is a file, not a
    folder"`` or ``"PATH: PART is a file, not a folder"`` (None: it can)."""
    blocker = file_in_the_way(path)
    if blocker is None:
        return None
    where = "" if blocker == os.path.abspath(os.fspath(path)) else f": {blocker}"
    return f"{os.fspath(path)}{where} is a file, not a folder"


def check_prefix(prefix: str, option: str, example: str, added: str = "") -> None:
    """Refuse an output prefix that names a folder (``out/``, ``.``): the names
    made from it (``out/`` + ``_text_document``, ``out`` + ``.model`` once
    normalized) would land as hidden files in it or beside it; and one that ends in
    what the tool adds (``added``: ``tok.model`` made ``tok.model.model``)."""
    if os.path.basename(prefix) in ("", ".", ".."):
        raise ValueError(f"{option} {prefix} names a folder, not a file name prefix: "
                         f"give a name in it, e.g. {os.path.join(prefix, example)}")
    if added and prefix.endswith(added) and len(os.path.basename(prefix)) > len(added):
        raise ValueError(f"{option} {prefix}: give the prefix without {added}, which the "
                         f"tool adds ({prefix[:-len(added)]} writes {prefix})")


def check_not_there(paths: list[str], option: str, keep: str = "") -> None:
    """Refuse (ValueError, one line) outputs that exist, unless the caller was given
    ``--force``: a rerun silently replaced a tokenizer or a corpus that shards and
    runs were made with. Names the first in full and the next two by name; a folder
    in the way is left to the write's own error. ``keep``: another way on, first."""
    there = [p for p in paths if os.path.lexists(p) and not os.path.isdir(p)]
    if not there:
        return
    names = [there[0]] + [os.path.basename(p) for p in there[1:3]]
    if len(there) > 3:
        names.append(f"{len(there) - 3} more")
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    one = len(there) == 1
    raise ValueError(f"{listed} exist{'s' if one else ''} ({keep}--force replaces "
                     f"{'it' if one else 'them'}, or give another {option})")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_open(path, "wb") as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def os_error_text(e: OSError) -> str:
    """``PATH: reason`` of an OSError (a rename names its target)."""
    path = e.filename2 if e.filename2 is not None else e.filename
    if path is None:
        return e.strerror or str(e)
    if isinstance(e, (FileExistsError, NotADirectoryError)):
        # a folder made, or a file opened, through a path part that is a file
        if (part := file_in_the_way(path)) is not None:
            return f"{part} is a file, not a folder"
    return f"{path}: {e.strerror or e}"


PIPE_CLOSED = 141  # a pipeline's reader gone: the exit of coreutils' tools (128 + SIGPIPE)


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reader has closed it (``... | head`` done):
    a ``BrokenPipeError`` from there is the pipeline's end, not a fault. The
    stream is pointed at /dev/null then, so the interpreter's last flush at exit
    does not report it again. Another broken pipe (a dead worker's) is not."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        gone = any(events & select.POLLERR for _, events in poll.poll(0))
    except (AttributeError, OSError, ValueError):  # no stdout, or not a file descriptor
        return False
    if gone:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    return gone
