"""What a complete checkpoint holds, whether it still holds it, and which
checkpoint a run resumes from. Standard library only: no torch, no megatron
(the collective parts, which every rank must decide alike, are in
``resume``).

The manifest. The marker ``kvtrain_checkpoint.json`` that completes a
checkpoint records, under ``manifest``, every file of the folder (relative
path, size, CRC-32 read in 1 MiB chunks). CRC-32 (zlib) runs at ~5 GB/s on one
core of the 2-core test machine (BLAKE2b: ~1.2 GB/s); it detects truncation,
deletion and bit rot, not tampering, which is not the threat here. Each rank
checksums the shards it wrote (``__<rank>_*.distcp``) while they are still in
its page cache, rank 0 the rest. Measured: 1 GiB from the page cache in 0.55 s
on the (loaded) 2-core test machine, i.e. ~0.5 s per GB per rank; a tiny test
save (0.9 MB) gains 1 ms on 0.6 s. A 19B checkpoint (~300 GB) over 64 ranks
is ~5 GB, a few seconds, per rank.

Verification (``checkpoint.verify``): ``full`` (default) checks every size
and checksum, ``sizes`` sizes only (O(files): catches truncation and deleted
files, not bit rot), ``none`` nothing (not ``off``: YAML reads that as false).
``full`` is the default because a load reads every byte anyway: verifying at
most doubles the read I/O of a resume, the checksums are split over the ranks
(round robin, sizes on every rank), and a checkpoint silently wrong is the one
fault a run cannot recover from later. On a slow shared filesystem ``sizes``
is the cheap choice. A marker of an
older kvtrain (no manifest) is accepted with a warning that it cannot be
verified.

Choosing the checkpoint (``plan_resume``). Under ``resume: auto`` the
candidates are the folders ``iter_NNNNNNN`` of the checkpoint folder, newest
first; ``latest`` is a hint: the checkpoint it names goes first (a user who
points ``latest`` at an older checkpoint rolls the run back, as in
Megatron-LM). A ``latest`` that is missing, empty, unreadable, not UTF-8 or
names no checkpoint folder gives one warning. The caller tries the candidates
in order and skips (with one warning each) those that fail verification or
loading; if there were candidates and none loads, the run stops with one line
listing them: a folder that holds checkpoints never restarts from scratch.
An explicit ``checkpoint.resume: PATH`` has one candidate and no fallback: the
run's first start. Its checkpoints record PATH (the marker's ``started_from``,
carried on through later resumes), so a rerun of the same command after a crash
or a requeue continues from the run's own checkpoints that descend from PATH
(newest first, PATH last), not from PATH again. What a start takes from its
checkpoint follows (``carried_on``): ``load_optimizer``/``load_rng`` false start
afresh from a checkpoint once, and the run's own checkpoints written under that
setting restore the fresh optimizer, schedule and RNG states at every restart.
``resume: none`` is refused when the folder holds checkpoints (keep_last would
delete them and the new saves replace those of the same number).

Another history is never destroyed: after resuming from iteration K, the
checkpoints at K or later that were not loaded are moved (renamed, O(1)) into
``abandoned-<UTC time>/`` next to them, with a warning; neither keep_last nor
the new history's saves touch that folder. (The metrics records the new run
drops past K are kept in a copy, see ``metrics.MetricsLogger.resume_at``.)
"""

from __future__ import annotations

import errno
import json
import os
import re
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

from data_tools.fileio import fsync_dir
from kvtrain.config import ConfigError, first_line

PREFIX = "iter_"
TRACKER = "latest"
MARKER = "kvtrain_checkpoint.json"
INCOMPLETE = ".incomplete"  # suffix of a checkpoint folder while it is written
ABANDONED = "abandoned-"  # prefix of a folder of checkpoints set aside
CHUNK = 1 << 20
# 7 digits, more past iteration 9,999,999 (checkpoint.checkpoint_name pads to 7)
_NAME = re.compile(r"^iter_(\d{7,})$")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be saved or loaded; one line, no traceback."""

    kind = "checkpoint error"


def warn(message: str) -> str:
    """The one-line form of a warning (printed by rank 0, recorded as an event)."""
    return f"kvtrain: warning: {message}"


# ----------------------------------------------------------------------------- the manifest
def crc32_of(path: Path) -> str:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def list_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the marker, as sorted relative paths."""
    folder = Path(folder)
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")
                  if p.is_file() and p.name != MARKER)


def own_shards(folder: Path, rank: int) -> dict[str, str]:
    """The checksums of the torch_dist shards rank ``rank`` wrote (``__<rank>_*``)."""
    return {name: crc32_of(Path(folder) / name) for name in list_files(folder)
            if name.startswith(f"__{rank}_")}


def build_manifest(folder: Path, known: Optional[dict[str, str]] = None) -> dict:
    """The manifest of ``folder``: size and CRC-32 of every file (``known``:
    checksums computed already, by the ranks that wrote those files)."""
    known = known or {}
    files = {}
    for name in list_files(folder):
        path = Path(folder) / name
        files[name] = {"size": path.stat().st_size,
                       "crc32": known.get(name) or crc32_of(path)}
    return {"algorithm": "crc32", "files": files}


@dataclass
class Check:
    problem: Optional[str] = None  # what is wrong (the checkpoint must not be loaded)
    warning: Optional[str] = None  # loadable, with a caveat


def read_marker(path: Path) -> dict:
    """The marker of checkpoint ``path``; CheckpointError (one line) if unusable."""
    marker = Path(path) / MARKER
    try:
        info = json.loads(marker.read_bytes().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{marker} is missing (not a complete checkpoint)") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{marker} is unreadable: {first_line(e)}") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{marker} is not a kvtrain marker")
    return info


def check_checkpoint(path: Path, level: str, part: tuple[int, int] = (0, 1)) -> Check:
    """Checks ``path`` against its manifest: sizes of every file, checksums of
    the files ``part = (rank, world)`` owns (round robin) under ``full``."""
    path = Path(path)
    try:
        manifest = read_marker(path).get("manifest")
    except CheckpointError as e:
        return Check(problem=str(e))
    if level == "none":
        return Check()
    if manifest is None:
        return Check(warning=f"{path} was saved without a file manifest (an older kvtrain): "
                             "it cannot be verified")
    files = _files_of(manifest)
    if files is None:
        return Check(problem=f"{path / MARKER} holds a damaged manifest (not "
                             "{files: {name: {size, crc32}}})")
    for name, entry in files.items():
        problem = _size_problem(path / name, entry["size"])
        if problem:
            return Check(problem=problem)
    if level == "full":
        rank, world = part
        for name in sorted(files)[rank::world]:
            if crc32_of(path / name) != files[name]["crc32"]:
                return Check(problem=f"{path / name} does not match its checksum (CRC-32 "
                                     f"{files[name]['crc32']} in {MARKER})")
    return Check()


def _files_of(manifest) -> Optional[dict]:
    """The manifest's ``files`` when every entry has an integer size and a CRC-32
    string; None for a marker that is valid JSON of another shape (a bad edit, a
    bug), which makes a damaged checkpoint, not a KeyError."""
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return None
    for entry in files.values():
        if not (isinstance(entry, dict) and type(entry.get("size")) is int
                and isinstance(entry.get("crc32"), str)):
            return None
    return files


def _size_problem(path: Path, size: int) -> Optional[str]:
    try:
        actual = path.stat().st_size
    except FileNotFoundError:
        return f"{path} is missing"
    except OSError as e:
        return f"{path} is unreadable: {e.strerror}"
    if actual != size:
        return f"{path} is {actual} bytes, {MARKER} says {size}"
    return None


# ----------------------------------------------------------------------------- the candidates
def iteration_of(path: Path) -> Optional[int]:
    match = _NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def checkpoint_folders(root: Path) -> list[Path]:
    """The folders named like a checkpoint in ``root``, newest first (marked
    complete or not: a folder of that name not complete is a damaged one)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if iteration_of(p) is not None and p.is_dir()]
    return sorted(found, key=iteration_of, reverse=True)


def read_tracker(root: Path) -> tuple[Optional[Path], Optional[str]]:
    """(the checkpoint ``root/latest`` names, what is wrong with ``latest``)."""
    tracker = Path(root) / TRACKER
    try:
        name = tracker.read_bytes().decode().strip()
    except FileNotFoundError:
        return None, f"{tracker} is missing"
    except OSError as e:
        return None, f"{tracker} is unreadable ({e.strerror})"
    except UnicodeDecodeError:
        return None, f"{tracker} holds bytes that are not text"
    if not name:
        return None, f"{tracker} is empty"
    path = Path(root) / name
    if iteration_of(path) is None or not path.is_dir():
        return None, f"{tracker} names {name[:80]!r}, which is not a checkpoint folder"
    return path, None


@dataclass
class ResumePlan:
    """The checkpoints to try, in order; an explicit path has no fallback."""

    root: Path
    candidates: list[Path] = field(default_factory=list)
    explicit: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # said, but nothing passed over


def plan_resume(resume: str, root: Path) -> ResumePlan:
    """The checkpoints ``checkpoint.resume`` asks to try (see the module docstring)."""
    root, value = Path(root), resume.strip()
    tracker = root / TRACKER
    if tracker.exists() and not tracker.is_file():  # found only at the first save, before
        raise CheckpointError(f"{tracker} is not a file: a save names the checkpoint it "
                              "completed there, so none could complete; move it away")
    folders = checkpoint_folders(root)
    if value.lower() == "none":
        if folders:
            names = ", ".join(p.name for p in folders)
            raise CheckpointError(
                f"checkpoint.resume: none, but {root} holds checkpoints ({names}): keep_last "
                "would delete them and new saves replace those of the same number; resume "
                "them (checkpoint.resume: auto), or use another run folder or checkpoint.dir, "
                f"or delete {root}")
        return ResumePlan(root)
    if value.lower() == "auto":
        hint, problem = read_tracker(root)
        plan = ResumePlan(root, candidates=folders)
        if hint is not None:
            plan.candidates = [hint] + [p for p in folders if p != hint]
        elif folders:
            plan.warnings.append(warn(f"{problem}; trying the newest checkpoint folders "
                                      f"({', '.join(p.name for p in folders)})"))
        elif (root / TRACKER).exists():
            plan.warnings.append(warn(f"{problem} and {root} holds no checkpoint: "
                                      "starting from scratch"))
        return plan
    start = _explicit_checkpoint(Path(value).expanduser())
    own = [p for p in plan_resume("auto", root).candidates if _started_from(p) == start.resolve()]
    if own:  # a rerun: PATH was this history's first start
        return ResumePlan(root, candidates=own + [start], notes=[
            f"checkpoint.resume {value}: this run started from it and trained on; continuing "
            f"from its own checkpoints ({', '.join(p.name for p in own)}) descending from it"])
    return ResumePlan(root, candidates=[start], explicit=True)


def _started_from(path: Path) -> Optional[Path]:
    """The explicit ``checkpoint.resume`` checkpoint the history of ``path`` began
    from (its marker's ``started_from``), None if none or unreadable."""
    try:
        start = read_marker(path).get("started_from")
    except CheckpointError:
        return None
    return Path(start) if isinstance(start, str) else None


def _explicit_checkpoint(path: Path) -> Path:
    """The checkpoint an explicit path names (a value that names none is a config error)."""
    if (path / TRACKER).exists():
        found, problem = read_tracker(path)
        if found is None:
            raise ConfigError(f"checkpoint.resume: {problem}")
        return found
    if not path.exists():
        raise ConfigError(f"checkpoint.resume: no such checkpoint {path}")
    if path.name.endswith(INCOMPLETE) or not (path / MARKER).exists():
        raise ConfigError(f"checkpoint.resume: {path} is not a complete kvtrain checkpoint "
                          f"(no {MARKER})")
    return path


# ----------------------------------------------------------------------------- other histories
def set_aside(root: Path, folders: list[Path]) -> Optional[Path]:
    """Moves ``folders`` (checkpoints of a history that was not loaded) into one
    new ``abandoned-<UTC time>`` folder of ``root``; returns it (None: nothing)."""
    if not folders:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = Path(root) / f"{ABANDONED}{stamp}"
    n = 1
    while target.exists():  # two set-asides within a second
        n += 1
        target = Path(root) / f"{ABANDONED}{stamp}-{n}"
    target.mkdir()
    for folder in folders:
        os.replace(folder, target / folder.name)
    fsync_dir(os.fspath(root))
    return target


# ----------------------------------------------------------------------------- failed saves
def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures that torch's
    CheckpointException carries (``failures``: rank -> (exception, trace))."""
    todo, seen = [exc], set()
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]


_ERRNO_TEXT = re.compile(r"\[Errno (\d+)\] ([^\n:']+)")


class SaveFailed(Exception):
    """A save failed on some rank; ``str`` says which ranks and why, and every rank
    raises it (``kvtrain.train.save_agreement``)."""


def save_failure_reason(exc: BaseException, folder: Path) -> str:
    """Why a save failed, in a few words: the failing ranks' reasons when the ranks
    agreed on them (:class:`SaveFailed`); the operating system's error when one
    is in the exception chain (megatron re-raises it as "Worker failure:
    [Errno 28] ..." or loses it: torch.save on a full disk says "unexpected pos
    704 vs 598"), else what a small write into ``folder`` fails with now, else
    the exception's first line."""
    if isinstance(exc, SaveFailed):
        return str(exc)
    for e in _chain(exc):
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        match = _ERRNO_TEXT.search(str(e))
        if match:
            return match.group(2).strip()
    probe = _probe_write(Path(folder))
    return probe or first_line(exc)


def _probe_write(folder: Path, size: int = CHUNK) -> Optional[str]:
    """The OS error a 1 MiB write into ``folder`` fails with (None if it works)."""
    probe = folder / f".write-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            left = memoryview(b"\0" * size)
            while left:  # a short write on a nearly full disk: the next one fails
                left = left[os.write(fd, left):]
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        return e.strerror or os.strerror(e.errno or errno.EIO)
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def carried_on(path: Path, meta: dict, own: bool, load_optimizer: bool, load_rng: bool,
               optimizer_too: bool = True) -> tuple[bool, bool, Optional[str]]:
    """``checkpoint.load_optimizer``/``load_rng`` false start a fresh optimizer (with its
    LR schedule) or RNG states from a checkpoint once: a checkpoint ``path`` of the run's
    own history (``own``) written under the same setting holds the fresh ones, which a
    restart restores (it reset them at every pre-emption). Returns what to load and,
    where a setting is so carried on, the line that says it (``meta``: the checkpoint's
    common ``kvtrain`` record; ``optimizer_too`` False: the optimizer starts afresh
    anyway, as a change of train.precision needs without the distributed optimizer)."""
    saved = ((meta.get("config") or {}).get("checkpoint") or {}) if own else {}
    carried = []
    if not load_optimizer and saved.get("load_optimizer") is False and optimizer_too \
            and not meta.get("weights_only"):
        load_optimizer = True
        carried.append("load_optimizer")
    if not load_rng and saved.get("load_rng") is False:
        load_rng = True
        carried.append("load_rng")
    note = carried and (f"{path.name} was written under checkpoint.{' and '.join(carried)}: "
                        "false, so what that started afresh goes on from it (a new fresh "
                        f"start: checkpoint.resume: {path})")
    return load_optimizer, load_rng, note or None
