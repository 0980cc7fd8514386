"""Input discovery and reading: jsonl / text / parquet, plain, gzip or zstd.

Reading is split in two so the expensive part runs in worker processes:

* ``iter_chunks`` (main process) turns a file into ``Chunk``s of raw bytes:
  whole lines, about ``chunk_bytes`` each. It only decompresses and finds
  newlines, which is cheap next to tokenizing.
* ``parse_chunk`` (worker) decodes UTF-8, parses JSON, validates, and returns
  the documents plus the bad lines by reason.

Bad-input reasons (the summary and ``--strict`` use these names):
``invalid_utf8``, ``malformed_json``, ``missing_key`` (no such key, or null),
``not_a_string`` (the value is a number, list, ...), ``empty_document``
(empty or whitespace-only text, blank lines included).
"""

from __future__ import annotations

import contextlib
import glob
import gzip
import io
import json
import os
from dataclasses import dataclass, field
from typing import Iterator

REASONS = ("invalid_utf8", "malformed_json", "missing_key", "not_a_string", "empty_document")

_EXTENSIONS = {
    ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl",
    ".txt": "text", ".text": "text",
    ".parquet": "parquet",
}
_COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}
_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Skippable frames (0x184D2A50..5F, little endian) may open a zstd file:
# pzstd writes one before every frame, `zstd -d` and the decoder skip them.
_ZSTD_SKIPPABLE, _ZSTD_SKIPPABLE_MASK = 0x184D2A50, 0xFFFFFFF0
_UTF8_BOM = b"\xef\xbb\xbf"

DEFAULT_CHUNK_BYTES = 1 << 20


class InputError(Exception):
    """An input cannot be read at all (missing, unknown format, corrupt stream)."""


@dataclass(frozen=True)
class InputFile:
    path: str
    format: str          # jsonl | text | parquet
    compression: str     # none | gzip | zstd
    size: int            # bytes on disk, for progress and shard balancing


@dataclass
class Chunk:
    """A unit of work for a worker: raw lines of one file, or whole documents.

    kind ``lines``: ``payload`` is bytes holding whole lines; line numbers start
    at ``first_line``. kind ``docs``: ``payload`` is a list of str/bytes/None,
    one per document, located at ``first_line + i`` (parquet rows), or at
    ``paths[i]`` (text files read whole).
    """
    shard: int
    path: str
    format: str
    kind: str
    payload: object
    first_line: int = 1
    paths: list[str] | None = None
    disk_bytes: int = 0  # on-disk bytes of the input consumed by this chunk


@dataclass
class ParseResult:
    texts: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    # (location, reason, detail) of the first few bad records only
    samples: list[tuple[str, str, str]] = field(default_factory=list)

    def bad(self, location: str, reason: str, detail: str, keep: int) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if len(self.samples) < keep:
            self.samples.append((location, reason, detail))


# --------------------------------------------------------------------------
# discovery


def detect(path: str, fmt: str = "auto") -> InputFile:
    """Format from ``fmt`` or the extension; compression from the magic bytes,
    so a compressed file without a .gz/.zst suffix still reads (and one with
    the suffix that is not compressed is an error, not garbage)."""
    name = path.lower()
    suffix_comp = "none"
    for suffix, comp in _COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            suffix_comp, name = comp, name[: -len(suffix)]
            break
    if fmt == "auto":
        ext = os.path.splitext(name)[1]
        if ext not in _EXTENSIONS:
            raise InputError(f"{path}: cannot tell the format from the name; pass --format")
        fmt = _EXTENSIONS[ext]
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        size = os.path.getsize(path)
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    if magic.startswith(_GZIP_MAGIC):
        comp = "gzip"
    elif magic.startswith(_ZSTD_MAGIC) or (
            len(magic) == 4
            and int.from_bytes(magic, "little") & _ZSTD_SKIPPABLE_MASK == _ZSTD_SKIPPABLE):
        comp = "zstd"
    elif suffix_comp != "none" and size > 0:
        raise InputError(f"{path}: named {suffix_comp} but is not {suffix_comp}-compressed")
    else:
        comp = "none"
    if fmt == "parquet" and comp != "none":
        raise InputError(f"{path}: compressed parquet files are not supported")
    return InputFile(path=path, format=fmt, compression=comp, size=size)


def _wanted(name: str, fmt: str) -> bool:
    """Whether a file met while walking a directory is an input (not a shard's
    ``.meta.json`` record: a corpus folder may hold the shards made from it)."""
    lower = name.lower()
    if lower.endswith(".meta.json"):
        return False
    for suffix in _COMPRESSION_SUFFIXES:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    found = _EXTENSIONS.get(os.path.splitext(lower)[1])
    return found is not None and (fmt == "auto" or found == fmt)


def discover(specs: list[str], fmt: str = "auto") -> list[InputFile]:
    """Expand files, directories (recursive) and globs, in a deterministic order.

    Explicit arguments keep their order; what a directory or glob expands to is
    sorted. Directory walks skip hidden entries and files whose extension is
    not an input format (of ``fmt``, when given); files and glob matches are
    taken whatever their name. A file named twice is read once.
    """
    paths: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            found = []
            for root, dirs, files in os.walk(spec):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                found += [os.path.join(root, f) for f in files
                          if not f.startswith(".") and _wanted(f, fmt)]
            if not found:
                raise InputError(f"{spec}: no input files in this directory")
            paths += sorted(found)
        elif os.path.exists(spec):
            paths.append(spec)
        elif glob.has_magic(spec):
            # A pattern is an explicit choice: no extension filter (so
            # 'docs/**/*.md' with --format text works).
            matched = sorted(p for p in glob.glob(spec, recursive=True) if os.path.isfile(p))
            if not matched:
                raise InputError(f"{spec}: the pattern matches no file")
            paths += matched
        else:
            raise InputError(f"{spec}: no such file or directory")
    seen: set[str] = set()
    inputs = []
    for p in paths:
        key = os.path.realpath(p)
        if key not in seen:
            seen.add(key)
            inputs.append(detect(p, fmt))
    return inputs


# --------------------------------------------------------------------------
# main-process side: raw chunks


class _CountingReader(io.RawIOBase):
    """Wraps the on-disk file to know how many compressed bytes were consumed."""

    def __init__(self, f) -> None:
        self._f = f
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        n = self._f.readinto(b)
        self.consumed += n or 0
        return n


class _ZstdFrames(io.RawIOBase):
    """The zstd frames of a file, one after another (``zstd -c a b``); a file
    that ends inside a frame is an error. (zstandard's ``stream_reader`` returns
    what a truncated file decompresses to as if it were all of it.)"""

    def __init__(self, source, decompressor) -> None:
        self._source, self._decompressor = source, decompressor
        self._obj = decompressor.decompressobj()
        self._in_frame = False  # bytes fed to the current frame, its end not seen
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def _feed(self, data: bytes) -> None:
        out = []
        while data:
            out.append(self._obj.decompress(data))
            self._in_frame = not self._obj.eof
            if self._in_frame:
                break
            # the next frame starts with what this one left over
            data, self._obj = self._obj.unused_data, self._decompressor.decompressobj()
        self._out, self._pos = b"".join(out), 0

    def readinto(self, b) -> int:
        while self._pos >= len(self._out):
            block = self._source.read(1 << 20)
            if not block:
                if self._in_frame:  # worded like gzip's error for a truncated file
                    raise EOFError("compressed file ended inside a zstd frame")
                return 0
            self._feed(block)
        n = min(len(b), len(self._out) - self._pos)
        b[:n] = self._out[self._pos:self._pos + n]
        self._pos += n
        return n


def _open_stream(inp: InputFile):
    raw = open(inp.path, "rb")
    counter = _CountingReader(raw)
    if inp.compression == "gzip":
        stream = gzip.GzipFile(fileobj=io.BufferedReader(counter, 1 << 20), mode="rb")
    elif inp.compression == "zstd":
        try:
            import zstandard
        except ImportError:
            raise InputError(f"{inp.path}: reading .zst needs the 'zstandard' package") from None
        stream = _ZstdFrames(counter, zstandard.ZstdDecompressor())
    else:
        stream = counter
    return raw, counter, stream


def _read_full(stream, n: int) -> bytes:
    """Read up to n bytes; decompressors may return short reads before EOF."""
    parts, got = [], 0
    while got < n:
        block = stream.read(n - got)
        if not block:
            break
        parts.append(block)
        got += len(block)
    return b"".join(parts)


def iter_chunks(inp: InputFile, shard: int, json_key: str,
                chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """Raw chunks of one input file, in file order."""
    with _read_errors(inp.path):
        if inp.format == "parquet":
            yield from _parquet_chunks(inp, shard, json_key, chunk_bytes)
        else:
            yield from _line_chunks(inp, shard, chunk_bytes)


@contextlib.contextmanager
def _read_errors(path: str):
    """A corrupt or unreadable file stops the run with its name, rather than
    silently losing its tail; zlib, zstd and arrow errors become InputError."""
    try:
        yield
    except InputError:
        raise
    except (OSError, EOFError, ValueError) as e:
        raise InputError(f"{path}: cannot read: {type(e).__name__}: {e}") from None
    except Exception as e:
        if type(e).__module__.split(".")[0] in ("zstandard", "pyarrow"):
            raise InputError(f"{path}: cannot read: {type(e).__name__}: {e}") from None
        raise


def _line_chunks(inp: InputFile, shard: int, chunk_bytes: int) -> Iterator[Chunk]:
    raw, counter, stream = _open_stream(inp)
    with raw:
        line, reported = 1, 0
        pending: list[bytes] = []  # the start of a line not yet ended
        held: Chunk | None = None  # one chunk of lookahead: the last one also
        # accounts for the bytes the decompressor read past the final newline
        first = True
        while True:
            block = _read_full(stream, chunk_bytes)
            if not block:
                break
            if first:
                first = False
                if block.startswith(_UTF8_BOM):  # editors' BOM is not part of line 1
                    block = block[len(_UTF8_BOM):]
            cut = block.rfind(b"\n")
            if cut < 0:  # no line ends in this block (a very long line): keep it
                pending.append(block)
                continue
            payload = b"".join(pending + [block[: cut + 1]]) if pending else block[: cut + 1]
            pending = [block[cut + 1:]] if cut + 1 < len(block) else []
            if held is not None:
                yield held
            held = Chunk(shard, inp.path, inp.format, "lines", payload, line,
                         disk_bytes=counter.consumed - reported)
            reported = counter.consumed
            line += payload.count(b"\n")
        if pending:
            if held is not None:
                yield held
            held = Chunk(shard, inp.path, inp.format, "lines", b"".join(pending), line)
        if held is not None:
            held.disk_bytes += inp.size - reported
            yield held


def _parquet_chunks(inp: InputFile, shard: int, column: str, chunk_bytes: int) -> Iterator[Chunk]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise InputError(
            f"{inp.path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    pf = pq.ParquetFile(inp.path)
    names = pf.schema_arrow.names
    if column not in names:
        raise InputError(f"{inp.path}: no column {column!r} (columns: {', '.join(names)})")
    total_rows = max(pf.metadata.num_rows, 1)
    row, reported, batch = 1, 0, []
    size = 0
    for record_batch in pf.iter_batches(batch_size=1024, columns=[column]):
        values = record_batch.column(0).to_pylist()
        batch += values
        size += sum(len(v) for v in values if isinstance(v, (str, bytes)))
        if size >= chunk_bytes:
            done = (row - 1 + len(batch)) * inp.size // total_rows
            yield Chunk(shard, inp.path, "parquet", "docs", batch, row, disk_bytes=done - reported)
            row, reported, batch, size = row + len(batch), done, [], 0
    yield Chunk(shard, inp.path, "parquet", "docs", batch, row, disk_bytes=inp.size - reported)


def iter_file_docs(inputs: list[InputFile], shard: int,
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> Iterator[Chunk]:
    """``--text-mode file``: each file is one document; small files are batched."""
    batch, paths, size = [], [], 0
    for inp in inputs:
        with _read_errors(inp.path):
            raw, _, stream = _open_stream(inp)
            with raw:
                data = stream.read()
        if data.startswith(_UTF8_BOM):
            data = data[len(_UTF8_BOM):]
        batch.append(data)
        paths.append(inp.path)
        size += len(data)
        if size >= chunk_bytes:
            yield Chunk(shard, paths[0], "text", "docs", batch, 0, paths=paths,
                        disk_bytes=sum(os.path.getsize(p) for p in paths))
            batch, paths, size = [], [], 0
    if batch:
        yield Chunk(shard, paths[0], "text", "docs", batch, 0, paths=paths,
                    disk_bytes=sum(os.path.getsize(p) for p in paths))


# --------------------------------------------------------------------------
# worker side: validation and parsing


def parse_chunk(chunk: Chunk, json_key: str, keep_samples: int = 5) -> ParseResult:
    """Documents of a chunk in order, and the bad records by reason."""
    res = ParseResult()
    if chunk.kind == "lines":
        lines = chunk.payload.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the newline that ends the last line starts no line
        for i, raw in enumerate(lines):
            loc = f"{chunk.path}:{chunk.first_line + i}"
            if chunk.format == "jsonl":
                _parse_json_line(raw, loc, json_key, res, keep_samples)
            else:
                if raw.endswith(b"\r"):
                    raw = raw[:-1]  # CRLF files: the \r belongs to the line ending
                _add_text(raw, loc, res, keep_samples)
    else:
        for i, value in enumerate(chunk.payload):
            loc = chunk.paths[i] if chunk.paths else f"{chunk.path}:{chunk.first_line + i}"
            if value is None:
                res.bad(loc, "missing_key", f"{json_key} is null", keep_samples)
            elif isinstance(value, (bytes, str)):
                _add_text(value, loc, res, keep_samples)
            else:
                res.bad(loc, "not_a_string", type(value).__name__, keep_samples)
    return res


def _parse_json_line(raw: bytes, loc: str, key: str, res: ParseResult, keep: int) -> None:
    if not raw.strip():
        res.bad(loc, "empty_document", "blank line", keep)
        return
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        res.bad(loc, "invalid_utf8", f"byte {e.start}", keep)
        return
    try:
        obj = json.loads(line)
    except ValueError as e:
        res.bad(loc, "malformed_json", str(e), keep)
        return
    except RecursionError:  # valid JSON nested deeper than Python's stack allows
        res.bad(loc, "malformed_json", "nested too deeply to parse", keep)
        return
    if not isinstance(obj, dict):
        res.bad(loc, "missing_key", f"a JSON {type(obj).__name__}, not an object", keep)
        return
    value = obj.get(key)
    if value is None:
        res.bad(loc, "missing_key", f"no {key!r}" if key not in obj else f"{key} is null", keep)
    elif not isinstance(value, str):
        res.bad(loc, "not_a_string", f"{key} is a {type(value).__name__}", keep)
    else:
        _add_text(value, loc, res, keep)


def _add_text(value: str | bytes, loc: str, res: ParseResult, keep: int) -> None:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as e:
            res.bad(loc, "invalid_utf8", f"byte {e.start}", keep)
            return
    elif not value.isascii():
        # JSON "\ud800" escapes decode to lone surrogates, which are not text
        # and which the tokenizer cannot encode.
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            res.bad(loc, "invalid_utf8", f"lone surrogate at character {e.start}", keep)
            return
    if not value or value.isspace():
        res.bad(loc, "empty_document", "empty" if not value else "whitespace only", keep)
        return
    res.texts.append(value)
