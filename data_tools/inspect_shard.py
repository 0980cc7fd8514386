"""``kvtrain data inspect``: what is in an IndexedDataset, and is it sound.

Prints the header (version, token dtype), counts of documents, sequences and
tokens, document length statistics and a log2 histogram, the preprocess
record (``.meta.json``) when there is one, and the first documents, decoded
when a tokenizer is given (or recorded in the meta and still on disk).
Exit status 1 when the files are inconsistent.

(Not called ``inspect.py``: that would shadow the standard library module
for anything run from inside this folder.)
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from data_tools.fileio import os_error_text
from data_tools.indexed import CODE_DTYPES, IndexedReader, resolve_prefixes
from data_tools.progress import skipped_text


def histogram(lengths: np.ndarray, width: int = 40) -> list[str]:
    """Log2-bucketed histogram lines: ``[lo, hi)  count  bar``."""
    if lengths.size == 0:
        return ["  (no documents)"]
    # bucket 0 is [0, 1): megatron keeps "" as a document of no sequence
    buckets = np.where(lengths > 0, np.floor(np.log2(np.maximum(lengths, 1))) + 1, 0)
    counts = np.bincount(buckets.astype(np.int64))
    top = counts.max()
    lines = []
    for b in range(int(buckets.min()), len(counts)):
        lo, hi = (0, 1) if b == 0 else (1 << (b - 1), 1 << b)
        bar = "#" * max(1 if counts[b] else 0, round(width * counts[b] / top))
        lines.append(f"  [{lo:>7}, {hi:>7})  {counts[b]:>10,}  {bar}")
    return lines


def _loading(path: str):
    """The tokenizer at ``path``; ValueError naming it, once (the tokenizer's own
    errors start with the path), when it cannot be loaded."""
    try:
        from data_tools.tokenizer import SentencePieceTokenizer

        return SentencePieceTokenizer(path)
    except (OSError, ValueError, RuntimeError) as e:
        text = str(e)
        raise ValueError(text if text.startswith(str(path)) else f"{path}: {text}") from None


def load_tokenizer_option(path: str):
    """``--tokenizer``, given explicitly: one that cannot be loaded is an error (as
    ``kvtrain generate --tokenizer``), not a report of raw ids."""
    try:
        return _loading(path)
    except ValueError as e:
        raise ValueError(f"--tokenizer {e}") from None


def _recorded_tokenizer(meta: dict | None, warn):
    """The tokenizer the meta names, if still on disk; one that no longer loads is
    a warning: the report is the shard's, and nobody asked for this one."""
    if not (meta and os.path.isfile(meta.get("tokenizer", ""))):
        return None
    try:
        return _loading(meta["tokenizer"])
    except ValueError as e:
        warn(f"cannot load tokenizer {e}")
        return None


def _read_meta(path: str, warn) -> dict | None:
    """preprocess's record of the shard; damaged, it is a warning: the data is the shard."""
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        warn(f"{path}: not read (not JSON: {e})" if isinstance(e, ValueError)
             else f"{path}: not read ({e.strerror})")
        return None
    if not isinstance(meta, dict):
        warn(f"{path}: not read (not a JSON object)")
        return None
    return meta


def inspect(prefix: str, tokenizer=None, docs: int = 3, max_chars: int = 400,
            out=print) -> int:
    """Print the report for one dataset; returns the exit status. ``tokenizer``: a
    path (ValueError when it cannot be loaded, before any output), a loaded
    tokenizer, or None (the one the meta names, if it loads)."""
    if isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer_option(os.fspath(tokenizer))
    r = IndexedReader(prefix)
    dtype_name = np.dtype(CODE_DTYPES[r.dtype_code]).name
    out(f"dataset    {r.prefix}")
    out(f"  .idx     {r.idx_bytes:,} bytes, version {r.version}, dtype {dtype_name} "
        f"(code {r.dtype_code}){', multimodal' if r.multimodal else ''}")
    out(f"  .bin     {r.bin_bytes:,} bytes")
    out(f"documents  {r.num_documents:,}")
    out(f"sequences  {r.sequence_count:,}")
    out(f"tokens     {r.num_tokens:,}")
    problems = r.check()
    out("check      " + ("OK" if not problems else "FAILED: " + "; ".join(problems)))
    if problems:  # a damaged index's documents may point anywhere (an IndexError)
        return 1
    lengths = r.document_lengths()
    if lengths.size:
        q = np.percentile(lengths, [50, 90, 99])
        out(f"tokens per document: min {lengths.min():,}  mean {lengths.mean():,.1f}  "
            f"median {q[0]:,.0f}  p90 {q[1]:,.0f}  p99 {q[2]:,.0f}  max {lengths.max():,}")
    out("document length histogram (tokens):")
    for line in histogram(lengths):
        out(line)
    meta = _read_meta(r.prefix + ".meta.json", lambda m: out(f"warning: {m}"))
    if meta is not None:
        counts = meta.get("counts", {})
        if "fingerprint" in meta:
            n_in = len(meta["fingerprint"].get("inputs", []))
            skipped = skipped_text(counts.get("skipped", {}))
            out(f"preprocess {n_in} input file(s), skipped: {skipped}")
        if "merged_from" in meta:
            out(f"merged     from {len(meta['merged_from'])} datasets")
    tok = tokenizer if tokenizer is not None else _recorded_tokenizer(
        meta, lambda m: out(f"warning: {m}"))
    if tok is not None and r.num_tokens and not problems:
        out(f"tokenizer  {tok.model_path} (vocab {tok.vocab_size}, eod {tok.eod})")
        made_with = ((meta or {}).get("fingerprint") or {}).get("tokenizer_sha256")
        if isinstance(made_with, str) and made_with != tok.sha256:  # train refuses it
            out(f"  WARNING: {tok.model_path} is not the tokenizer the shard was made with "
                "(its meta records another sha256): the text below is another "
                "tokenizer's reading")
        ends = r.sequence_pointers[r.document_indices[1:] - 1] // r.itemsize + \
            r.sequence_lengths[r.document_indices[1:] - 1] - 1
        no_eod = int((r._tokens[ends[lengths > 0]] != tok.eod).sum())
        out(f"  documents not ending in EOD: {no_eod:,}")
        top = int(r._tokens.max())
        if top >= tok.vocab_size:
            out(f"  WARNING: token id {top} >= vocab size {tok.vocab_size}: wrong tokenizer?")
            problems.append("ids outside the vocabulary")
    for i in range(min(docs, r.num_documents)):
        ids = r.document(i)
        out(f"--- document {i}: {len(ids):,} tokens")
        if tok is not None and (len(ids) == 0 or int(ids.max()) < tok.vocab_size):
            text = tok.decode(ids[:-1] if len(ids) and ids[-1] == tok.eod else ids)
            shown = text[:max_chars].replace("\n", "\n    ")
            out("    " + shown + (" [...]" if len(text) > max_chars else "")
                + ("  <EOD>" if len(ids) and ids[-1] == tok.eod else ""))
        else:
            more = " ..." if len(ids) > 64 else ""
            out("    " + " ".join(str(int(t)) for t in ids[:64]) + more)
    return 1 if problems else 0


def run(args) -> int:
    """CLI entry (see data_tools.cli)."""
    for option, value in (("--docs", args.docs), ("--max-chars", args.max_chars)):
        if value < 0:  # -1 silently showed nothing; -5 cut each document's end off
            print(f"kvtrain data inspect: error: {option} must be 0 or more, got {value}",
                  file=sys.stderr)
            return 1
    try:
        prefixes = resolve_prefixes(args.prefix)
        # once, before any report: a bad one is one line, not one per shard
        tok = load_tokenizer_option(args.tokenizer) if args.tokenizer else None
    except (FileNotFoundError, ValueError) as e:
        print(f"kvtrain data inspect: error: {e}", file=sys.stderr)
        return 1
    status = 0
    for i, prefix in enumerate(prefixes):
        if i:
            print()
        try:
            status |= inspect(prefix, tok, args.docs, args.max_chars)
        except BrokenPipeError:  # the report's reader gone (`| head`): the command's end
            raise
        except (OSError, ValueError) as e:  # an OSError as PATH: reason, not [Errno 2] ...
            print(f"kvtrain data inspect: error: "
                  f"{os_error_text(e) if isinstance(e, OSError) else e}", file=sys.stderr)
            status = 1
    return status
