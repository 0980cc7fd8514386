"""``kvtrain data merge``: join IndexedDatasets (e.g. preprocess shards) into one.

The result equals, byte for byte, what megatron's
``IndexedDatasetBuilder.add_index`` would produce, and what preprocess would
have written for the concatenated inputs: documents are encoded
independently, so joining their token streams and indexes in order is exact.

Streams: token bytes are copied in blocks and index arrays appended block by
block, so memory stays small for any size. The output is written under
temporary names and renamed in when complete, like preprocess.

Shards of different token dtypes (uint16 and int32, from tokenizers of
different sizes) are widened to the larger. Shards whose ``.meta.json``
name different tokenizers (sha256) or EOD ids are refused: their ids mean
different pieces. Shards without a meta (megatron's own) are not checked.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys

import numpy as np

from data_tools.fileio import atomic_write_bytes, check_not_there, check_prefix
from data_tools.indexed import (IndexedReader, IndexedWriter, bin_path, idx_path, meta_path,
                               read_meta, resolve_prefixes)
from data_tools.progress import Counts

_BLOCK = 1 << 22  # index entries or tokens per block


def output_name(output_prefix: str) -> str:
    """``OUT`` -> ``OUT_text_document`` (as preprocess names a single shard);
    a name already ending in ``_text_document`` is used as is."""
    if output_prefix.endswith("_text_document"):
        return output_prefix
    return output_prefix + "_text_document"


def merge(sources: list[str], output_prefix: str, log=None) -> dict:
    """Merge the datasets ``sources`` (prefixes) in order into ``output_prefix``
    (the exact dataset prefix to write). Returns the written meta dict."""
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    out = os.path.abspath(output_prefix)
    if not sources:
        raise ValueError("nothing to merge")
    if out in {os.path.abspath(s) for s in sources}:
        raise ValueError(f"{output_prefix}: the output is also an input")
    readers = [IndexedReader(s) for s in sources]
    for r in readers:
        if r.multimodal:
            raise ValueError(f"{r.prefix}: multimodal datasets (sequence modes) are not supported")
        problems = r.check()
        if problems:
            raise ValueError(f"{r.prefix}: damaged: {'; '.join(problems)}")
    metas = [read_meta(r.prefix) for r in readers]
    made_with = _same_tokenizer(readers, metas)
    dtype = np.result_type(*[r.dtype for r in readers]).type
    counts = Counts()
    counts_known = True
    parts = []
    with IndexedWriter(out, dtype) as writer:
        for r, meta in zip(readers, metas):
            offset = writer.sequences
            if r.dtype == dtype:
                writer.append_bin_file(r.bin_file, r.bin_bytes)
            else:
                for start in range(0, r.num_tokens, _BLOCK):
                    writer.write_tokens(np.asarray(r._tokens[start:start + _BLOCK]))
            # Index entries: lengths as they are, document ends shifted by the
            # sequences already written (the builder's add_index does the same).
            S, ends = r.sequence_count, r.document_indices[1:]
            for start in range(0, max(S, len(ends)), _BLOCK):
                writer.add_index_entries(r.sequence_lengths[start:start + _BLOCK],
                                         ends[start:start + _BLOCK] + offset)
            if meta and "counts" in meta:
                counts.merge(Counts.from_dict(meta["counts"]))
            else:
                counts_known = False
            parts.append({"prefix": os.path.abspath(r.prefix), "documents": r.num_documents,
                          "sequences": r.sequence_count, "tokens": r.num_tokens})
        # An old meta (--force) goes first: until the new one lands, none describes
        # these files (merge and the trainer check the tokenizer it records).
        with contextlib.suppress(FileNotFoundError):
            os.unlink(meta_path(out))
        bin_bytes, idx_bytes = writer.commit()
    result = {"merged_from": parts, "bin_bytes": bin_bytes, "idx_bytes": idx_bytes,
              "dtype": np.dtype(dtype).name, "documents": sum(p["documents"] for p in parts),
              "tokens": sum(p["tokens"] for p in parts)}
    if counts_known:
        result["counts"] = counts.to_dict()
    result.update(made_with)  # so a merge of merges is checked too
    atomic_write_bytes(meta_path(out), (json.dumps(result, indent=1) + "\n").encode())
    log(f"merge: wrote {out}.bin/.idx: {len(parts)} datasets, {result['documents']:,} "
        f"documents, {result['tokens']:,} tokens ({result['dtype']})")
    return result



_MADE_WITH = (("tokenizer_sha256", "tokenizer (sha256)"), ("eod", "EOD id"))


def _same_tokenizer(readers: list, metas: list) -> dict:
    """Refuses sources whose metas disagree on the tokenizer or EOD id; returns
    the values all of them record (a preprocess shard in its fingerprint, a
    merge result at the top level), for the merged meta."""
    first: dict = {}  # key -> (prefix, value) of the first source recording it
    known = {key: True for key, _ in _MADE_WITH}
    for r, meta in zip(readers, metas):
        meta = meta or {}
        fp = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else meta
        for key, what in _MADE_WITH:
            if key not in fp:
                known[key] = False
                continue
            where, value = first.setdefault(key, (r.prefix, fp[key]))
            if value != fp[key]:
                raise ValueError(f"{r.prefix}: made with another {what} than {where} "
                                 f"({fp[key]} vs {value}); merge shards of one tokenizer")
    return {key: first[key][1] for key, _ in _MADE_WITH if known[key] and key in first}


def run(args) -> int:
    """CLI entry (see data_tools.cli)."""
    try:
        check_prefix(args.output_prefix, "--output-prefix", "corpus")
        out = output_name(args.output_prefix)
        sources = []
        for spec in args.inputs:
            found = resolve_prefixes(spec, prefer_shards=True)
            if glob.has_magic(spec):  # a glob can match an earlier merge result: skip it
                found = [p for p in found if os.path.abspath(p) != os.path.abspath(out)]
            sources += found  # the output named as an input is refused (merge)
        if not sources:  # every input a glob matching only the output
            raise ValueError(f"nothing to merge: {', '.join(args.inputs)} "
                             f"match{'es' if len(args.inputs) == 1 else ''} only the output {out}")
        target = os.path.abspath(out)
        if not args.force and target not in map(os.path.abspath, sources):
            # (the output named as an input is merge's own refusal, --force or not)
            check_not_there([bin_path(target), idx_path(target), meta_path(target)],
                            "--output-prefix")
        merge(sources, out)
    except ValueError as e:  # an OSError (a .bin missing) is PATH: reason, in data_tools.cli
        print(f"kvtrain data merge: error: {e}", file=sys.stderr)
        return 1
    return 0
