"""``kvtrain data preprocess``: documents -> Megatron ``_text_document`` shards.

Pipeline (one process per core)::

    main thread            worker processes          main thread
    read + split files -> parse, validate, encode -> append .bin, spool index
        (readers)            (encoder)                 (indexed.IndexedWriter)

``workers.EncoderPool`` keeps results in input order, so the output is the
same for any ``--workers`` (0 runs everything inline), with ``4 * workers``
chunks in flight, which bounds memory whatever the corpus size (about
``chunk size * 4 * workers`` plus their tokens). A worker that dies (the
out-of-memory killer) ends the run in one line, and the shards completed
before it are kept for ``--resume``.

Shards: one per input file by default (one in all with ``--text-mode file``),
or ``--shards N`` contiguous groups of inputs balanced by size. A single shard
is ``PREFIX_text_document``; several are ``PREFIX_00000_text_document``, ...
(``kvtrain data merge`` joins them).

Interruption: a shard is written to temporary files and renamed in when
complete; then ``SHARD.meta.json`` is written, recording the fingerprint of
its inputs (path, size, mtime, format, compression), tokenizer (sha256) and
options. ``--resume`` keeps the shards whose meta matches and redoes the
rest, so a killed run resumed gives the same bytes as an uninterrupted one.

Reruns: the CLI refuses a prefix holding shards this run would replace or
remove, unless ``--resume`` or ``--force`` (``check_outputs_new``). After a
successful run, the shards an earlier run into the same prefix wrote and this
plan does not (fewer inputs, another ``--shards``) are removed, so ``merge
PREFIX`` cannot pick them up with the new ones.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import re
import signal
import sys
from dataclasses import dataclass

import numpy as np

from data_tools import readers
from data_tools.encoder import Encoded, ShardEnd
from data_tools.fileio import (atomic_write_bytes, check_not_there, check_prefix,
                              remove_stale_temps)
from data_tools.indexed import (IndexedWriter, bin_path, idx_path, meta_path, read_meta,
                               token_dtype)
from data_tools.lifeline import Terminated, signals_held, stops_raise
from data_tools.progress import Counts, Progress, summary
from data_tools.tokenizer import SentencePieceTokenizer
from data_tools.workers import WorkersFailed, encode_in_order

META_VERSION = 2  # 2: inputs record their format and compression


class StrictError(Exception):
    """``--strict`` met a bad record; the message names file:line."""


class NoDocumentsError(ValueError):
    """The inputs hold no document at all: an empty shard would only fail later,
    in the trainer; nothing is written."""


def no_documents_message(inputs: list[readers.InputFile], counts: Counts) -> str:
    names = ", ".join(i.path for i in inputs[:3])
    if len(inputs) > 3:
        names += f" and {len(inputs) - 3} more"
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.skipped.items()))
    skipped = f"{counts.skipped_total} records skipped ({reasons})" if reasons else "no records"
    return f"no documents in {names}: {skipped}; no shard written"


@dataclass
class Shard:
    index: int
    prefix: str                    # .../NAME_text_document
    inputs: list[readers.InputFile]

    @property
    def meta_path(self) -> str:
        return self.prefix + ".meta.json"


MAX_SHARDS = 100_000  # PREFIX_00000 ... PREFIX_99999


def default_workers() -> int:
    if hasattr(os, "process_cpu_count"):
        return os.process_cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def plan_shards(inputs: list[readers.InputFile], output_prefix: str, shards: int | None,
                text_mode: str = "line") -> list[Shard]:
    """Group inputs into shards: contiguous, in input order, balanced by size."""
    asked = shards
    if shards is None:
        shards = 1 if text_mode == "file" else len(inputs)
    n = max(1, min(shards, len(inputs)))
    if n > MAX_SHARDS:  # shard 100000 would be named with six digits, which
        # merge, inspect and the trainer (resolve_prefixes) do not read: left out silently
        raise ValueError(
            (f"{n} shards (one per input file)" if asked is None else f"--shards {asked}")
            + f": their names hold five digits (PREFIX_NNNNN_text_document), {MAX_SHARDS} at "
            f"most; give --shards N to group the inputs (the trainer blends at most 32766)")
    # Boundaries where the running size crosses k/n of the total, nudged so
    # that every shard gets at least one file.
    cum = list(itertools.accumulate((max(i.size, 1) for i in inputs), initial=0))
    bounds = [0]
    for k in range(1, n):
        cut = bisect.bisect_left(cum, cum[-1] * k / n)
        bounds.append(min(max(cut, bounds[-1] + 1), len(inputs) - (n - k)))
    bounds.append(len(inputs))
    groups = [inputs[bounds[k]:bounds[k + 1]] for k in range(n)]
    if n == 1:
        return [Shard(0, f"{output_prefix}_text_document", groups[0])]
    return [Shard(i, f"{output_prefix}_{i:05d}_text_document", grp) for i, grp in enumerate(groups)]


def fingerprint(shard: Shard, tokenizer_sha: str, options: dict) -> dict:
    return {
        "version": META_VERSION,
        # format and compression too: the same file read as another --format
        # gives other documents
        "inputs": [{"path": os.path.abspath(i.path), "size": i.size,
                    "mtime_ns": os.stat(i.path).st_mtime_ns, "format": i.format,
                    "compression": i.compression} for i in shard.inputs],
        "tokenizer_sha256": tokenizer_sha,
        **options,
    }


def is_complete(shard: Shard, fp: dict) -> bool:
    """Complete = meta written after the rename, same fingerprint, sizes match."""
    try:
        with open(shard.meta_path) as f:
            meta = json.load(f)
        return (meta.get("fingerprint") == fp
                and os.path.getsize(bin_path(shard.prefix)) == meta["bin_bytes"]
                and os.path.getsize(idx_path(shard.prefix)) == meta["idx_bytes"])
    except (OSError, ValueError, KeyError):
        return False


def _work_items(shards: list[Shard], json_key: str, text_mode: str, chunk_bytes: int):
    for shard in shards:
        if text_mode == "file":
            yield from readers.iter_file_docs(shard.inputs, shard.index, chunk_bytes)
        else:
            for inp in shard.inputs:
                yield from readers.iter_chunks(inp, shard.index, json_key, chunk_bytes)
        yield ShardEnd(shard.index)


class _ShardSink:
    """Receives the encoded chunks in order and writes them to their shards:
    opens a shard's writer at its first result, commits it and writes its
    meta at its ShardEnd, discards it on abort. A shard without documents is
    held back until ``finish``: when no shard has any, nothing is committed
    and what the output prefix held before is left as it was."""

    def __init__(self, plan: list[Shard], fps: dict, dtype: type, tok: SentencePieceTokenizer,
                 output_name: str):
        self.shards = {s.index: s for s in plan}
        self.output_name = output_name  # the meta says which prefix's shard it is
        self.fps, self.dtype, self.tok = fps, dtype, tok
        self.writer: IndexedWriter | None = None
        self.counts = Counts()  # of the shard being written
        self.held: list[tuple[Shard, IndexedWriter, Counts]] = []  # empty, not committed

    def _open(self, shard: Shard) -> IndexedWriter:
        for name in (bin_path(shard.prefix), idx_path(shard.prefix),
                     shard.prefix + ".lengths", shard.prefix + ".docs"):
            remove_stale_temps(name)
        self.counts = Counts()
        return IndexedWriter(shard.prefix, self.dtype)

    def add(self, res: Encoded) -> None:
        if self.writer is None:
            with signals_held():  # its temporaries are known to abort() once made
                self.writer = self._open(self.shards[res.shard])
        self.writer.add_documents(res.tokens, res.lengths)
        self.counts.add(len(res.lengths), int(res.tokens.size), res.text_bytes, res.disk_bytes,
                        res.counts)

    def end(self, index: int) -> None:
        shard = self.shards[index]
        # A stop waits for the commit: cut in two, it left the shard's temporaries
        # (or a .bin renamed in whose .idx was not).
        with signals_held():
            if self.writer is None:  # a shard whose inputs hold no line at all
                self.writer = self._open(shard)
            writer, self.writer = self.writer, None
            if self.counts.documents:
                self._commit(shard, writer, self.counts)
            else:
                self.held.append((shard, writer, self.counts))

    def _commit(self, shard: Shard, writer: IndexedWriter, counts: Counts) -> None:
        # Invalidate first: from here until the new meta lands, this shard
        # does not count as complete, whatever is on disk.
        try:
            os.unlink(shard.meta_path)
        except FileNotFoundError:
            pass
        bin_bytes, idx_bytes = writer.commit()
        meta = {"fingerprint": self.fps[shard.index], "counts": counts.to_dict(),
                "bin_bytes": bin_bytes, "idx_bytes": idx_bytes,
                "tokenizer": os.path.abspath(self.tok.model_path),
                "vocab_size": self.tok.vocab_size, "output_prefix": self.output_name}
        atomic_write_bytes(shard.meta_path, (json.dumps(meta, indent=1) + "\n").encode())

    def finish(self, keep_empty: bool) -> None:
        """Commits the held empty shards (other shards have documents), or discards them."""
        with signals_held():
            while self.held:
                shard, writer, counts = self.held[0]
                if keep_empty:
                    self._commit(shard, writer, counts)
                else:
                    writer.abort()
                self.held.pop(0)

    def abort(self) -> None:
        with signals_held():  # a second Ctrl-C does not leave the cleanup half done
            if self.writer is not None:
                self.writer.abort()
                self.writer = None
            self.finish(keep_empty=False)


def _earlier_shards(plan: list[Shard], output_prefix: str) -> list[str]:
    """Shards of this output prefix on disk that ``plan`` does not write.

    Named exactly like this prefix's shards, and not someone else's: not a
    merge result (``merge --output-prefix P P`` writes ``P_text_document``), nor
    the single shard of prefix ``P_00001`` (its meta names that prefix)."""
    folder, name = os.path.split(output_prefix)
    pattern = re.compile(re.escape(name) + r"((_[0-9]{5})?_text_document)\.(bin|idx|meta\.json)")
    ours = {s.prefix for s in plan}
    matches = (pattern.fullmatch(entry) for entry in os.listdir(folder))
    found = {os.path.join(folder, name + m.group(1)) for m in matches if m}
    stale = []
    for prefix in sorted(found - ours):
        if not os.path.exists(prefix + ".meta.json"):
            stale.append(prefix)  # a run killed before the meta, or megatron's own
            continue
        meta = read_meta(prefix) or {"output_prefix": None}  # unreadable: keep it
        if "merged_from" not in meta and meta.get("output_prefix", name) == name:
            stale.append(prefix)
    return stale



def _remove_earlier_shards(plan: list[Shard], output_prefix: str, log) -> None:
    stale = _earlier_shards(plan, output_prefix)
    for prefix in stale:
        # The meta first: a shard half-removed is never taken as complete.
        for path in (prefix + ".meta.json", idx_path(prefix), bin_path(prefix)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
    if stale:
        log(f"preprocess: removed {len(stale)} shard(s) of an earlier run that this one does "
            f"not write: {', '.join(os.path.basename(p) for p in stale)}")


def check_outputs_new(inputs: list[readers.InputFile], output_prefix: str, shards: int | None,
                      text_mode: str) -> None:
    """Refuse (ValueError) a run that would replace or remove shards on disk: its
    plan's, and an earlier plan's of this prefix (removed after the run)."""
    prefix = os.path.abspath(output_prefix)
    plan = plan_shards(inputs, prefix, shards, text_mode)
    shard_prefixes = [s.prefix for s in plan]
    if os.path.isdir(os.path.dirname(prefix)):
        shard_prefixes += _earlier_shards(plan, prefix)
    check_not_there([f(p) for p in shard_prefixes for f in (bin_path, idx_path, meta_path)],
                    "--output-prefix", keep="--resume keeps the complete ones, ")


def _kept_counts(plan: list, todo: list) -> Counts:
    """The counts of the shards a resume keeps (read from their meta files)."""
    total, todo_ids = Counts(), {s.index for s in todo}
    for s in plan:
        if s.index not in todo_ids:
            with open(s.meta_path) as f:
                total.merge(Counts.from_dict(json.load(f)["counts"]))
    return total


def check_options(workers: int | None, shards: int | None, report_bad: int) -> None:
    """ValueError (one line, named as the CLI's options) for values the pipeline
    would take silently as something else, or that would take the machine down."""
    if shards is not None and shards < 1:  # 0 silently meant the default
        raise ValueError(f"--shards must be at least 1, got {shards}")
    if workers is not None and workers < 0:  # -1 silently meant 0 (inline)
        raise ValueError(f"--workers must be 0 (no subprocess) or more, got {workers}")
    if workers is not None and workers > (cpus := default_workers()):
        # each worker loads the tokenizer: a typo's 100000 forks took the machine down
        raise ValueError(f"--workers must be at most the {cpus} CPUs this process may use "
                         f"(tokenizing is CPU-bound: more processes only take memory), "
                         f"got {workers}")
    if report_bad < 0:  # -1 silently meant 0
        raise ValueError(f"--report-bad must be 0 or more, got {report_bad}")


def preprocess(inputs: list[readers.InputFile], tokenizer_path: str, output_prefix: str, *,
               json_key: str = "text", text_mode: str = "line", workers: int | None = None,
               shards: int | None = None, resume: bool = False, strict: bool = False,
               report_bad: int = 5, chunk_bytes: int = readers.DEFAULT_CHUNK_BYTES,
               progress: bool = True, log=None) -> dict:
    """Run the pipeline. Returns a dict: counts (all shards, resumed ones
    included), outputs (shard prefixes), resumed, dtype, elapsed, first_bad.

    Raises StrictError (strict mode), readers.InputError (unreadable input),
    workers.WorkersFailed (a worker died or ran out of memory),
    NoDocumentsError (no input holds a document; nothing is written), ValueError
    (an option out of range: ``check_options``)."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    check_options(workers, shards, report_bad)  # also for callers of this function
    if text_mode == "file" and any(i.format != "text" for i in inputs):
        raise ValueError("--text-mode file reads text files whole; some inputs are not text")
    tok = SentencePieceTokenizer(tokenizer_path)
    dtype = token_dtype(tok.vocab_size)
    output_prefix = os.path.abspath(output_prefix)
    plan = plan_shards(inputs, output_prefix, shards, text_mode)
    options = {"json_key": json_key, "text_mode": text_mode, "dtype": np.dtype(dtype).name,
               "eod": tok.eod}
    fps = {s.index: fingerprint(s, tok.sha256, options) for s in plan}
    todo = [s for s in plan if not (resume and is_complete(s, fps[s.index]))]
    total = _kept_counts(plan, todo)
    if resume:
        log(f"preprocess: resume: {len(plan) - len(todo)} of {len(plan)} shard(s) complete, "
            f"{len(todo)} to do")
    workers = default_workers() if workers is None else workers
    keep = max(report_bad, 1 if strict else 0)  # bad-record samples each chunk reports
    sink = _ShardSink(plan, fps, dtype, tok, os.path.basename(output_prefix))
    bar = Progress(sum(i.size for s in todo for i in s.inputs), enabled=progress)
    run_counts, done_bytes, first_bad = Counts(), 0, []

    items = _work_items(todo, json_key, text_mode, chunk_bytes)
    results, pool = encode_in_order(items, workers if todo else 0, tok.model_path, dtype,
                                    json_key, keep)
    try:
        for res in results:
            if isinstance(res, ShardEnd):
                sink.end(res.shard)
                continue
            if res.samples and strict:
                loc, reason, detail = res.samples[0]
                raise StrictError(f"{loc}: {reason} ({detail})")
            for loc, reason, detail in res.samples[: max(report_bad - len(first_bad), 0)]:
                first_bad.append((loc, reason, detail))
                bar.message(f"preprocess: skipped {loc}: {reason} ({detail})")
            sink.add(res)
            run_counts.add(len(res.lengths), int(res.tokens.size), res.text_bytes,
                           res.disk_bytes, res.counts)
            done_bytes += res.disk_bytes
            bar.update(run_counts, done_bytes)
        sink.finish(keep_empty=total.documents + run_counts.documents > 0)
    except BaseException:
        sink.abort()
        if pool is not None:
            pool.terminate()
        raise
    finally:
        bar.clear()
    if pool is not None:
        pool.close()
    total.merge(run_counts)
    if total.documents == 0:
        raise NoDocumentsError(no_documents_message(inputs, total))
    _remove_earlier_shards(plan, output_prefix, log)
    return {"counts": total, "outputs": [s.prefix for s in plan],
            "resumed": len(plan) - len(todo), "dtype": np.dtype(dtype).name,
            "elapsed": bar.elapsed(), "first_bad": first_bad}


def run(args) -> int:
    """CLI entry (see data_tools.cli)."""
    try:
        if not args.chunk_mb > 0:  # 0 would read nothing and report "no records"
            raise ValueError(f"--chunk-mb must be positive, got {args.chunk_mb}")
        if not 1 <= args.chunk_mb * (1 << 20) <= 1 << 30:  # 0 bytes read nothing; a chunk
            # is one read() of that size (inf: OverflowError, 1e9: MemoryError)
            raise ValueError(f"--chunk-mb must be from one byte (1e-06) to 1024 (1 GiB), "
                             f"got {args.chunk_mb}")
        if args.resume and args.force:  # --resume won, unsaid
            raise ValueError("--resume and --force: --resume keeps the shards an earlier run "
                             "completed, --force replaces them; give one")
        check_options(args.workers, args.shards, args.report_bad)  # before reading inputs
        check_prefix(args.output_prefix, "--output-prefix", "corpus", added="_text_document")
        inputs = readers.discover(args.input, args.format)
        if args.shards and args.shards > len(inputs):  # it gave fewer without a word
            print(f"kvtrain data preprocess: warning: --shards {args.shards} with "
                  f"{len(inputs)} input file{'s' if len(inputs) > 1 else ''}: "
                  f"{len(inputs)} shard{'s' if len(inputs) > 1 else ''} (inputs are grouped "
                  "into shards, a file is not split)", file=sys.stderr)
        if not (args.resume or args.force):
            check_outputs_new(inputs, args.output_prefix, args.shards, args.text_mode)
        with stops_raise():  # a stopped job cleans up and says how to go on
            result = preprocess(
                inputs, args.tokenizer, args.output_prefix, json_key=args.json_key,
                text_mode=args.text_mode, workers=args.workers, shards=args.shards,
                resume=args.resume, strict=args.strict, report_bad=args.report_bad,
                chunk_bytes=int(args.chunk_mb * (1 << 20)), progress=not args.quiet)
    except Terminated:
        print("kvtrain data preprocess: stopped by SIGTERM; nothing was written for the "
              "shard being processed (--resume keeps the shards completed before it)",
              file=sys.stderr)
        return 128 + signal.SIGTERM
    except StrictError as e:
        print(f"kvtrain data preprocess: error (--strict): {e}; nothing was written for "
              f"the shard being processed", file=sys.stderr)
        return 1
    except WorkersFailed as e:
        print(f"kvtrain data preprocess: error: {e}; nothing was written for the shard being "
              f"processed (--resume keeps the shards completed before it)", file=sys.stderr)
        return 1
    except (readers.InputError, FileNotFoundError, ValueError) as e:
        print(f"kvtrain data preprocess: error: {e}", file=sys.stderr)
        return 1
    print(summary(result["counts"], result["elapsed"], dtype=result["dtype"],
                  outputs=result["outputs"], resumed=result["resumed"],
                  first_bad=result["first_bad"]))
    if len(result["outputs"]) > 1:
        # merge resolves a preprocess prefix to all of its shards
        print(f"  join them:  kvtrain data merge --output-prefix {args.output_prefix} "
              f"{args.output_prefix}")
    return 0
