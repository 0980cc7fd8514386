"""Megatron IndexedDataset files (``PREFIX.bin`` + ``PREFIX.idx``): writer and reader.

Byte layout (what ``megatron.core.datasets.indexed_dataset`` reads and its
``IndexedDatasetBuilder`` writes; all integers little endian)::

    .idx   b"MMIDIDX\\x00\\x00"                 9 bytes magic
           uint64  version = 1
           uint8   dtype code (uint8=1 int8=2 int16=3 int32=4 int64=5
                   float64=6 float32=7 uint16=8) of the tokens in .bin
           uint64  S = number of sequences
           uint64  D = number of document boundaries (documents + 1)
           int32[S]  sequence lengths, in tokens
           int64[S]  sequence pointers: byte offset of each sequence in .bin
           int64[D]  document indices: 0, then the sequence index that ends
                     each document (exclusive), nondecreasing, last == S
           (int8[S]  sequence modes, only in multimodal datasets)
    .bin   the tokens of all sequences back to back, in the dtype above

We write our own writer instead of calling megatron's builder because the
builder keeps every length in Python lists (unbounded memory), imports torch,
and writes straight to the final names. This writer streams the index arrays
to spool files and builds the .idx at the end, so memory stays bounded; the
tests check the result is byte-identical to the builder's.

Nothing here imports torch or megatron: ``kvtrain data`` stays light.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from data_tools.fileio import fsync_dir, tmp_name

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
HEADER_SIZE = len(INDEX_MAGIC) + 8 + 1 + 8 + 8  # 34 bytes before the arrays

DTYPE_CODES: dict[type, int] = {
    np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4,
    np.int64: 5, np.float64: 6, np.float32: 7, np.uint16: 8,
}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}

# Spool and copy granularity: big enough for throughput, small enough that
# building the index of a billion documents never holds more than this.
_BLOCK_ITEMS = 1 << 20


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits, else int32.

    Same threshold as megatron's ``DType.optimal_dtype`` (used by Megatron-LM's
    preprocess_data.py; data_tools/README.md says where its shards differ from ours).
    """
    return np.uint16 if vocab_size < 65500 else np.int32


def bin_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return os.fspath(prefix) + ".idx"


def meta_path(prefix: str | os.PathLike) -> str:
    """The shard's record: what made it (preprocess, merge), beside its .bin/.idx."""
    return f"{os.fspath(prefix)}.meta.json"


def read_meta(prefix: str | os.PathLike) -> dict | None:
    """The shard's ``.meta.json`` as a dict, or None (none, unreadable, not an object)."""
    try:
        with open(meta_path(prefix)) as f:
            meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    except (OSError, ValueError):
        return None


class IndexedWriter:
    """Streams one IndexedDataset to temporary files; ``commit`` renames it in.

    Until ``commit`` returns, the final ``PREFIX.bin``/``.idx`` names are not
    touched, so a killed process never leaves a half-written dataset there.
    Use as a context manager: an exception aborts and removes the temp files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: type) -> None:
        self.prefix = os.fspath(prefix)
        self.dtype = np.dtype(dtype).type
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"unsupported token dtype {dtype}")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = tmp_name(bin_path(self.prefix))
        self._idx_tmp = tmp_name(idx_path(self.prefix))
        self._len_tmp = tmp_name(self.prefix + ".lengths")
        self._doc_tmp = tmp_name(self.prefix + ".docs")
        # Large buffers: the writes come in chunk-sized numpy arrays anyway.
        self._bin = open(self._bin_tmp, "wb", buffering=1 << 20)
        self._lens = open(self._len_tmp, "wb", buffering=1 << 20)
        self._docs = open(self._doc_tmp, "wb", buffering=1 << 20)
        self.sequences = 0
        self.documents = 0
        self.tokens = 0
        self._closed = False

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents of one sequence each; ``tokens`` is their concatenation."""
        lengths = np.asarray(lengths, dtype=np.int32)
        ends = np.arange(self.sequences + 1, self.sequences + 1 + len(lengths), dtype=np.int64)
        self.add_sequences(tokens, lengths, ends)

    def add_sequences(self, tokens: np.ndarray, lengths: np.ndarray, doc_ends: np.ndarray) -> None:
        """General form: ``doc_ends`` are absolute sequence indices that end documents."""
        self.write_tokens(tokens)
        self.add_index_entries(lengths, doc_ends)

    def write_tokens(self, tokens: np.ndarray) -> None:
        """Append raw tokens; pair with ``add_index_entries`` describing them."""
        tokens = np.asarray(tokens)
        if tokens.dtype != self.dtype:
            tokens = tokens.astype(self.dtype)
        tokens.tofile(self._bin)

    def append_bin_file(self, path: str, nbytes: int | None = None) -> None:
        """Copy raw token bytes (same dtype) from another .bin; the caller adds
        the matching index entries with ``add_index_entries``."""
        with open(path, "rb") as src:
            _copy_file(src, self._bin, nbytes)

    def add_index_entries(self, lengths: np.ndarray, doc_ends: np.ndarray) -> None:
        lengths = np.asarray(lengths, dtype=np.int32)
        lengths.tofile(self._lens)
        np.asarray(doc_ends, dtype=np.int64).tofile(self._docs)
        self.sequences += len(lengths)
        self.documents += len(doc_ends)
        self.tokens += int(lengths.sum(dtype=np.int64))

    def commit(self) -> tuple[int, int]:
        """Write the .idx, fsync both files, rename them to the final names.

        Returns (bin bytes, idx bytes). The .bin is renamed first: the .idx is
        what readers open first, so a reader never sees an .idx whose .bin is
        missing."""
        for f in (self._bin, self._lens, self._docs):
            f.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        self._lens.close()
        self._docs.close()
        self._write_index()
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        fsync_dir(os.path.dirname(self.prefix))
        for spool in (self._len_tmp, self._doc_tmp):
            os.unlink(spool)
        self._closed = True
        return os.path.getsize(bin_path(self.prefix)), os.path.getsize(idx_path(self.prefix))

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        for f in (self._bin, self._lens, self._docs):
            try:
                f.close()
            except OSError:
                pass
        for name in (self._bin_tmp, self._idx_tmp, self._len_tmp, self._doc_tmp):
            try:
                os.unlink(name)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "IndexedWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None or not self._closed:
            self.abort()

    def _write_index(self) -> None:
        itemsize = np.dtype(self.dtype).itemsize
        with open(self._idx_tmp, "wb", buffering=1 << 20) as out:
            out.write(INDEX_MAGIC)
            out.write(struct.pack("<Q", INDEX_VERSION))
            out.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            out.write(struct.pack("<Q", self.sequences))
            out.write(struct.pack("<Q", self.documents + 1))
            with open(self._len_tmp, "rb") as src:
                _copy_file(src, out, None)
            # Pointers are the running byte offset; computed block by block so
            # the whole length array is never in memory.
            offset = np.int64(0)
            for block in _iter_blocks(self._len_tmp, np.int32):
                sizes = block.astype(np.int64) * itemsize
                ends = np.cumsum(sizes) + offset
                (ends - sizes).tofile(out)
                offset = ends[-1]
            np.zeros(1, dtype=np.int64).tofile(out)
            with open(self._doc_tmp, "rb") as src:
                _copy_file(src, out, None)
            out.flush()
            os.fsync(out.fileno())


def _iter_blocks(path: str, dtype: type):
    with open(path, "rb") as f:
        while True:
            block = np.fromfile(f, dtype=dtype, count=_BLOCK_ITEMS)
            if block.size == 0:
                return
            yield block


def _copy_file(src, dst, nbytes: int | None) -> None:
    remaining = nbytes
    while remaining is None or remaining > 0:
        want = 8 << 20 if remaining is None else min(8 << 20, remaining)
        data = src.read(want)
        if not data:
            break
        dst.write(data)
        if remaining is not None:
            remaining -= len(data)
    if remaining:
        raise IOError(f"{getattr(src, 'name', src)}: {remaining} bytes short")


def read_header(head: bytes, idx_file: str) -> tuple[int, int, int]:
    """(dtype code, sequences S, document indices D) of an .idx header; ValueError
    naming ``idx_file`` when the header is short or not one we can read."""
    if len(head) < HEADER_SIZE:
        raise ValueError(f"{idx_file}: {len(head)} bytes, shorter than the "
                         f"{HEADER_SIZE}-byte index header (truncated)")
    if head[:9] != INDEX_MAGIC:
        raise ValueError(f"{idx_file}: not a Megatron index (bad magic)")
    (version,) = struct.unpack_from("<Q", head, 9)
    if version != INDEX_VERSION:
        raise ValueError(f"{idx_file}: unsupported index version {version}")
    (code,) = struct.unpack_from("<B", head, 17)
    if code not in CODE_DTYPES:
        raise ValueError(f"{idx_file}: unknown dtype code {code}")
    sequences, documents = struct.unpack_from("<QQ", head, 18)
    return code, sequences, documents


def _multimodal(idx_bytes: int, S: int, D: int, idx_file: str) -> bool:
    """Whether sequence modes follow the arrays (the header does not say; the size
    does); ValueError when the size fits neither layout (a truncated index)."""
    expected = HEADER_SIZE + 4 * S + 8 * S + 8 * D
    if idx_bytes == expected + S and S > 0:
        return True
    if idx_bytes == expected:
        return False
    raise ValueError(f"{idx_file}: {idx_bytes} bytes, expected {expected} "
                     f"for {S} sequences and {D} document indices (truncated or damaged)")


def _read_at(f, offset: int, fmt: str) -> int:
    f.seek(offset)
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def check_shard(prefix: str | os.PathLike) -> str | None:
    """What is wrong with the dataset ``prefix`` (None when sound), in one line
    naming the file: a missing file, a bad header (magic, version, dtype code),
    an .idx whose size does not match the counts its header declares, a last
    document index that is not the sequence count, or a .bin whose size is not
    what the index describes. O(1) reads: the header and three array entries."""
    idx, bin_ = idx_path(prefix), bin_path(prefix)
    for path in (idx, bin_):
        if not os.path.isfile(path):
            return f"{path} does not exist"
    try:
        with open(idx, "rb") as f:
            code, S, D = read_header(f.read(HEADER_SIZE), idx)
            _multimodal(os.fstat(f.fileno()).st_size, S, D, idx)
            last_doc = _read_at(f, HEADER_SIZE + 12 * S + 8 * (D - 1), "<q") if D else None
            end = 0
            if S:  # the byte where the last sequence ends in .bin
                end = (_read_at(f, HEADER_SIZE + 4 * S + 8 * (S - 1), "<q")
                       + _read_at(f, HEADER_SIZE + 4 * (S - 1), "<i")
                       * np.dtype(CODE_DTYPES[code]).itemsize)
        if last_doc is None:  # not even the leading 0
            return f"{idx}: no document indices (the first must be 0)"
        if last_doc != S:
            return f"{idx}: last document index {last_doc} is not the sequence count {S}"
        size = os.path.getsize(bin_)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"{e.filename or idx}: {e.strerror}"
    if size != end:
        why = "truncated" if size < end else "longer than its index"
        return f"{bin_} has {size} bytes, its index {idx} describes {end} ({why})"
    return None


class IndexedReader:
    """Read-only view of an IndexedDataset via numpy memmaps (no torch)."""

    def __init__(self, prefix: str | os.PathLike) -> None:
        self.prefix = os.fspath(prefix)
        self.idx_file = idx_path(self.prefix)
        self.bin_file = bin_path(self.prefix)
        with open(self.idx_file, "rb") as f:
            head = f.read(HEADER_SIZE)
        self.dtype_code, S, D = read_header(head, self.idx_file)
        self.version = INDEX_VERSION
        self.dtype = CODE_DTYPES[self.dtype_code]
        self.sequence_count, self.document_count = S, D
        self.idx_bytes = os.path.getsize(self.idx_file)
        self.multimodal = _multimodal(self.idx_bytes, S, D, self.idx_file)
        mm = np.memmap(self.idx_file, mode="r", dtype=np.uint8)
        self.sequence_lengths = np.frombuffer(mm, np.int32, S, HEADER_SIZE)
        self.sequence_pointers = np.frombuffer(mm, np.int64, S, HEADER_SIZE + 4 * S)
        self.document_indices = np.frombuffer(mm, np.int64, D, HEADER_SIZE + 12 * S)
        self.bin_bytes = os.path.getsize(self.bin_file)
        self._tokens = (
            np.memmap(self.bin_file, mode="r", dtype=self.dtype) if self.bin_bytes else
            np.zeros(0, dtype=self.dtype)
        )

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize

    @property
    def num_documents(self) -> int:
        return max(self.document_count - 1, 0)

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return self.sequence_count

    def sequence(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.itemsize
        return self._tokens[start:start + int(self.sequence_lengths[i])]

    def document(self, i: int) -> np.ndarray:
        """All tokens of document ``i`` (its sequences concatenated)."""
        first, last = int(self.document_indices[i]), int(self.document_indices[i + 1])
        if first == last:
            return np.zeros(0, dtype=self.dtype)
        start = int(self.sequence_pointers[first]) // self.itemsize
        stop = int(self.sequence_pointers[last - 1]) // self.itemsize + int(
            self.sequence_lengths[last - 1])
        return self._tokens[start:stop]

    def document_lengths(self) -> np.ndarray:
        """Tokens per document, int64."""
        cum = np.concatenate([[0], np.cumsum(self.sequence_lengths, dtype=np.int64)])
        return cum[self.document_indices[1:]] - cum[self.document_indices[:-1]]

    def check(self, chunk: int = 1 << 24) -> list[str]:
        """Consistency problems (empty list when the dataset is sound). Reads the
        index in chunks of ``chunk`` entries: memory stays small for any size."""
        problems = []
        S = self.sequence_count
        total, negative, pointers = 0, False, True
        for lo in range(0, S, chunk):
            lengths = self.sequence_lengths[lo:lo + chunk].astype(np.int64)
            negative = negative or bool((lengths < 0).any())
            starts = total + np.concatenate([[0], np.cumsum(lengths)[:-1]])
            pointers = pointers and np.array_equal(starts * self.itemsize,
                                                   self.sequence_pointers[lo:lo + chunk])
            total += int(lengths.sum())
        if negative:
            problems.append("negative sequence length")
        if not pointers:
            problems.append("sequence pointers are not the running sum of the lengths")
        if self.bin_bytes != total * self.itemsize:
            problems.append(f".bin has {self.bin_bytes} bytes, the index describes "
                            f"{total * self.itemsize}")
        d = self.document_indices
        if self.document_count == 0 or d[0] != 0:
            problems.append("document indices must start at 0")
        elif d[-1] != S:
            problems.append(f"last document index {d[-1]} != sequence count {S}")
        elif any((np.diff(d[lo:lo + chunk + 1]) < 0).any()
                 for lo in range(0, self.document_count, chunk)):
            problems.append("document indices decrease")
        return problems


def resolve_prefixes(spec: str, prefer_shards: bool = False) -> list[str]:
    """Datasets named by ``spec``, sorted when several.

    Accepts a dataset prefix (``x_text_document``), one of its files
    (``x_text_document.idx``/``.bin``), a preprocess ``--output-prefix``
    (``x``, meaning ``x_text_document`` or all of ``x_NNNNN_text_document``),
    or a glob matching .idx files. When ``x`` has both, ``prefer_shards``
    picks the shards (merge) over ``x_text_document`` (inspect)."""
    import glob

    for ext in (".idx", ".bin"):
        if spec.endswith(ext) and os.path.exists(spec):
            return [spec[: -len(ext)]]
    if os.path.exists(idx_path(spec)):
        return [spec]
    single = spec + "_text_document"
    shards = sorted(glob.glob(glob.escape(spec) + "_[0-9][0-9][0-9][0-9][0-9]_text_document.idx"))
    shards = [p[: -len(".idx")] for p in shards]
    if os.path.exists(idx_path(single)) and not (prefer_shards and shards):
        return [single]
    if shards:
        return shards
    if glob.has_magic(spec):
        matched = sorted(p for p in glob.glob(spec) if p.endswith(".idx"))
        if matched:
            return [p[: -len(".idx")] for p in matched]
    raise FileNotFoundError(f"{spec}: no IndexedDataset (.idx/.bin) found there")
