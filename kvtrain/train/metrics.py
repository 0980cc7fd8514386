"""What a run reports: ``metrics.jsonl``, one line on stdout, and wandb.

Every record is one JSON object with ``kind`` (train | valid | kv_shift |
event) and ``iteration``; train records carry ``lm_loss``, ``lr``,
``grad_norm``, consumed samples/tokens, step time, tokens/s, TFLOP/s per
device, MFU and peak memory. The same numbers go to wandb under
``train/``, ``valid/`` and ``kv_shift/`` names (a named validation set's record,
``set: NAME``, under ``valid/NAME/``). Only global rank 0 writes.

On a resume the records past the checkpoint's iteration (steps a crashed run
did after its last save) are dropped from ``metrics.jsonl``: the file then
reads as one consistent history, the one the resumed run continues. When the
resume passed over something (a damaged checkpoint, a history set aside), or
when a start found no checkpoint in a folder with records (checkpoints deleted,
``checkpoint.dir`` changed), the dropped records may be a history of their own:
the file is first copied to ``metrics.jsonl.before-<iteration>-<UTC time>``.
Trained iterations that no record kept stands for (a disk that stayed full to
the end of the run before) are named once, in an event record
(``kvtrain.records``).

A full disk (or a quota) does not end the run: the records it refuses are held
and written once the file takes them again (``MetricsLogger``); it keeps whole lines.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import sys
import time
from collections import deque
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from data_tools.fileio import atomic_write_text
from data_tools.units import human
from kvtrain.config import ConfigError
from kvtrain.output import OutputError
from kvtrain.records import METRICS_FILE, read_records, spans_text, unrecorded

from .wandb_logger import WandbLogger

def peak_memory_gib() -> tuple[float, str]:
    """Peak device memory (CUDA allocator) or, on CPU, the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30, "cuda_allocated"
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return rss_kib / 2**20, "cpu_rss"


def truncate_after(path: Path, iteration: int,
                   backup: Optional[Path] = None) -> tuple[int, int, Optional[Path]]:
    """Drops records with ``iteration`` > ``iteration`` (atomically), and damaged
    lines: a line torn by a kill mid-write, or one that is no record (not UTF-8,
    not a JSON object, no whole iteration). Returns (records dropped, damaged
    lines, where the original was kept). ``backup``: where the original goes
    first, if anything is dropped; with damaged lines other than a torn last one
    it is kept anyway (they were not the trainer's)."""
    if not path.exists():
        return 0, 0, None
    lines = path.read_bytes().split(b"\n")
    if lines and not lines[-1]:
        lines.pop()  # the file's final newline
    keep, dropped, damaged = [], 0, []
    for n, raw in enumerate(lines):
        try:
            line = raw.decode("utf-8")
            number = json.loads(line).get("iteration", 0)
            if not isinstance(number, int) or isinstance(number, bool):
                raise ValueError
        except (ValueError, AttributeError):
            damaged.append(n)
            continue
        if number > iteration:
            dropped += 1
        else:
            keep.append(line)
    torn_last_only = damaged == [len(lines) - 1]
    if damaged and not torn_last_only and backup is None:
        backup = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%dT%H%M%SZ')}")
    if not (dropped or damaged):
        return 0, 0, None
    if backup is not None:
        try:
            shutil.copy2(path, backup)
        except OSError:  # a full disk: no copy cut short left beside the file
            backup.unlink(missing_ok=True)
            raise
    atomic_write_text(path, "".join(line + "\n" for line in keep))
    return dropped, len(damaged), backup


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if abs(value) >= 1e5:
            return human(value)
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4f}"
    return str(value)


class MetricsLogger:
    """Rank 0's sink for records; other ranks hold an inactive one.

    A record is appended whole or not at all: an append the disk refuses (full,
    a quota) is cut back to the file's size before it, so the file keeps whole
    lines. The run goes on (a checkpoint on another disk still saves; one on the
    same disk stops the run with its own line): the records the disk refused are
    held, in order, and written with the next record that finds room; those
    still held at the end are named in one line (stdout has their numbers)."""

    HELD_AT_MOST = 100_000  # records; about 50 MB, days of training at one a step

    def __init__(self, run_dir: Path, wandb: WandbLogger, active: bool):
        self.active = active
        self.path = Path(run_dir) / METRICS_FILE
        self.wandb = wandb
        self._fd: Optional[int] = None
        self._held: deque[tuple[int, bytes]] = deque()  # (iteration, line) the disk refused
        self._not_held = 0  # refused past HELD_AT_MOST: lost
        self._refused: Optional[str] = None  # why the last append failed
        if active:
            if self.path.is_dir():  # an IsADirectoryError traceback at the start
                raise ConfigError(f"{self.path} is a folder, not the run's metrics file: "
                                  "move it away")
            self._open()

    def _open(self) -> None:
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def resume_at(self, iteration: int, keep_copy: bool = False,
                  logged_through: Optional[int] = None) -> None:
        """Forget records a crashed run wrote after the checkpoint we resume from
        (``keep_copy``: in a copy of the file, kept); then name the iterations up to
        ``logged_through`` (the checkpoint's, less the steps of its log window not
        yet logged) that no train record stands for."""
        if not self.active:
            return
        self.close()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        backup = self.path.with_name(f"{self.path.name}.before-{iteration}-{stamp}")
        try:
            dropped, damaged, copy = truncate_after(self.path, iteration,
                                                    backup if keep_copy else None)
        except OSError as e:  # a full disk: the file is rewritten beside itself
            raise OutputError(f"metrics: dropping the records after iteration {iteration} "
                              f"from {self.path} failed: {e.strerror or e}; the file is as it "
                              "was (make room and start again)") from None
        kept = f"; the file before is kept as {copy.name}" if copy is not None else ""
        if dropped:
            why = ("no checkpoint continues them" if iteration == 0 else
                   "written by the interrupted run after its last checkpoint")
            print(f"metrics: dropped {dropped} records after iteration {iteration} "
                  f"({why}){kept}", flush=True)
        if damaged:
            print(f"metrics: dropped {damaged} damaged lines of {self.path} (not records: "
                  f"torn by a kill, or not the trainer's){'' if dropped else kept}", flush=True)
        self._open()
        if logged_through:
            self._name_gaps(iteration, logged_through)

    def _name_gaps(self, iteration: int, logged_through: int) -> None:
        """One warning and one event record for trained iterations the file has no
        train record of, and no earlier event names."""
        gaps = unrecorded(read_records(self.path)[0], logged_through)
        if not gaps:
            return
        text = spans_text(gaps)
        print(f"kvtrain: warning: metrics: {self.path} has no train records of iterations "
              f"{text}, which were trained (their run could not write them: its log says "
              "why); an event record names them", flush=True)
        self.write({"kind": "event", "iteration": iteration,
                    "message": f"metrics: no train records of iterations {text} (trained, "
                               "not written)",
                    "missing_iterations": [list(span) for span in gaps]}, echo=False)

    def write(self, record: dict, echo: bool = True) -> None:
        if not self.active:
            return
        # JSON has no NaN/inf: a non-finite loss or norm is written as "nan"/"inf"
        clean = {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        clean.setdefault("time", round(time.time(), 3))
        self._append(record["iteration"], (json.dumps(clean) + "\n").encode("utf-8"))
        self.wandb.log(self._wandb_view(record))
        if echo:
            print(self._line(record), flush=True)

    def _append(self, iteration: int, line: bytes) -> None:
        """Appends one record after those held, or holds it too."""
        if self._held:
            self._write_held()  # the disk may have room again
        if not self._held:
            try:
                _append_whole(self._fd, line)
                return
            except OSError as e:
                if self._refused is None:
                    print(f"kvtrain: warning: metrics: writing to {self.path} failed: "
                          f"{e.strerror or e}; the run goes on, its records are held and "
                          "written once the file takes them again", flush=True)
                self._refused = e.strerror or str(e)
        if len(self._held) < self.HELD_AT_MOST:
            self._held.append((iteration, line))
        else:
            self._not_held += 1

    def _write_held(self) -> None:
        """Appends the held records, oldest first, until the disk refuses one."""
        count, since = len(self._held), self._held[0][0]
        while self._held:
            try:
                _append_whole(self._fd, self._held[0][1])
            except OSError as e:
                self._refused = e.strerror or str(e)
                return
            self._held.popleft()
        lost = (f" ({self._not_held} more, past the {self.HELD_AT_MOST} held, are not in it)"
                if self._not_held else "")
        which = f"the {count} records held since iteration" if count > 1 else \
            "the record held of iteration"
        print(f"metrics: wrote {which} {since} to {self.path}{lost}", flush=True)
        self._refused, self._not_held = None, 0

    @staticmethod
    def _wandb_view(record: dict) -> dict:
        kind = record.get("kind", "train")
        # a named validation set's curves: valid/NAME/val_loss beside valid/val_loss
        group = f"{kind}/{record['set']}" if kind == "valid" and record.get("set") else kind
        out = {"iteration": record["iteration"]}
        for key, value in record.items():
            if key in ("kind", "iteration", "time") or isinstance(value, (str, dict, list)):
                continue
            name = key if "/" in key else f"{group}/{key}"
            out[name] = value
        return out

    @staticmethod
    def _line(record: dict) -> str:
        kind = record.get("kind", "train")
        if kind == "train":
            keys = ("lm_loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
                    "tflops_per_device", "mfu", "peak_memory_gib", "skipped_steps")
            parts = [f"iter {record['iteration']:>7d}",
                     f"samples {record.get('consumed_samples')}"]
            parts += [f"{k} {_fmt(record.get(k))}" for k in keys if k in record]
            return " | ".join(parts)
        if kind == "valid":
            accs = "".join(f" | {k} {_fmt(v)}" for k, v in record.items()
                           if k.startswith("val_acc_"))
            named = f" {record['set']}" if record.get("set") else ""
            return (f"iter {record['iteration']:>7d} | validation{named} | val_loss "
                    f"{_fmt(record['val_loss'])} | val_ppl {_fmt(record['val_ppl'])}{accs}")
        if kind == "kv_shift":
            quad = {k.rsplit("/", 1)[1]: v for k, v in record.items() if "/quadrant/" in k}
            return f"iter {record['iteration']:>7d} | kv_shift quadrants {quad}"
        return f"iter {record['iteration']:>7d} | {record.get('message', kind)}"

    def close(self) -> None:
        if self._fd is None:
            return
        if self._held:  # a last try: the disk may have room now
            self._write_held()
        if self._held:
            first, last = self._held[0][0], self._held[-1][0]
            many = len(self._held) + self._not_held
            which = (f"{many} records (iterations {first}-{last})" if many > 1 else
                     f"the record of iteration {first}")
            print(f"kvtrain: warning: metrics: {which} could not be written to {self.path}: "
                  f"{self._refused}", flush=True)
            self._held.clear()
            self._not_held = 0
        os.close(self._fd)
        self._fd = None


def _append_whole(fd: int, data: bytes) -> None:
    """Appends ``data`` to ``fd`` (O_APPEND) whole, or cuts the file back and raises."""
    size = os.fstat(fd).st_size
    done = 0
    try:
        while done < len(data):  # a short write on a nearly full disk: the next one fails
            done += os.write(fd, data[done:])
    except OSError:
        if done:
            os.ftruncate(fd, size)  # no torn line (freeing space never needs space)
        raise


class LogStream:
    """A run's stdout or stderr that a full disk (a quota) does not end the run
    through: SLURM's log is in the run folder under ``kvtrain submit``, and a
    print that fails there raised ``OSError`` out of the training loop. A write
    or flush that fails is dropped (what the stream kept buffered is written
    later), and the first write that works again says that lines may be
    missing."""

    def __init__(self, stream):
        self.stream = stream
        self.failed: Optional[str] = None  # why the last write failed; None: it did not

    def write(self, text: str) -> int:
        try:
            if self.failed is not None:
                self.stream.write(f"kvtrain: warning: lines of this log may be missing here: "
                                  f"writing it failed ({self.failed})\n")
                self.failed = None
            return self.stream.write(text)
        except OSError as e:
            self.failed = e.strerror or str(e)
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.failed = e.strerror or str(e)

    def __getattr__(self, name):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


@contextmanager
def log_kept_writing() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as ``LogStream`` while a run trains. They
    stay so after it where the disk still refuses them: the interpreter's last
    flush would fail and turn the run's exit code 0 into 1 (Python 3.11)."""
    kept = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = LogStream(sys.stdout), LogStream(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, LogStream):
                stream.flush()
        if not any(isinstance(s, LogStream) and s.failed for s in (sys.stdout, sys.stderr)):
            sys.stdout, sys.stderr = kept


def say(message: str) -> None:
    """Prints a line from global rank 0 (every process before distributed init)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(message, file=sys.stdout, flush=True)
