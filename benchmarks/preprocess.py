"""Throughput of ``kvtrain data preprocess`` against its ceiling.

On the same corpus (the demo corpus repeated to ``--mb`` MB of jsonl) and the
same tokenizer (BPE trained on the demo corpus), prints:

* ours: tokens/s of the whole ``preprocess`` (read jsonl, parse, encode,
  append EOD, write .bin/.idx, fsync) with all workers;
* ceiling: tokens/s of plain sentencepiece batch encoding of the same
  documents, already in memory, in one process per core (multiprocessing,
  the documents inherited by fork so nothing is copied, the pool warm);
* the ratio ours / ceiling (target >= 0.8).

Token counts include one EOD per document on both sides, so the ratio is the
ratio of elapsed times. The two sides run alternately ``--repeat`` times and
the best run of each is kept (the machine may be shared).

    python benchmarks/preprocess.py [--mb 64] [--vocab-size 8000] [--workers N]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data_tools import demo_corpus, readers  # noqa: E402
from data_tools.preprocess import default_workers, preprocess  # noqa: E402
from data_tools.train_tokenizer import train  # noqa: E402

_DOCS: list[str] = []
_SP = None


def build_corpus(workdir: str, mb: float) -> tuple[str, str]:
    demo = os.path.join(workdir, "demo.jsonl")
    demo_corpus.write(demo)
    with open(demo, "rb") as f:
        lines = f.readlines()
    big = os.path.join(workdir, "corpus.jsonl")
    size = 0
    with open(big, "wb") as f:
        while size < mb * 1e6:
            for line in lines:
                f.write(line)
                size += len(line)
    return demo, big


def _init(model: str) -> None:
    global _SP
    import sentencepiece as spm

    _SP = spm.SentencePieceProcessor(model_file=model)


def _encode_range(bounds: tuple[int, int]) -> tuple[int, float]:
    """(tokens, CPU seconds) of encoding one batch."""
    cpu = time.process_time()
    texts = _DOCS[bounds[0]:bounds[1]]
    try:  # the fastest output sentencepiece has: numpy buffers (>= 0.2.1)
        ids = _SP.encode(texts, out_type="numpy", num_threads=1)
    except ValueError:
        ids = _SP.encode(texts, out_type=int, num_threads=1)
    # + one EOD per document, as preprocess counts
    return sum(len(x) for x in ids) + len(ids), time.process_time() - cpu


def _cpu_seconds() -> float:
    """CPU time of this process and its joined children."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class Ceiling:
    """sentencepiece alone on ``workers`` processes, the pool kept warm."""

    def __init__(self, model: str, corpus: str, workers: int) -> None:
        global _DOCS
        with open(corpus, "rb") as f:
            _DOCS = [json.loads(line)["text"] for line in f]
        # Batches of about preprocess's chunk size, many per worker.
        self.ranges, start, size = [], 0, 0
        for i, doc in enumerate(_DOCS):
            size += len(doc)
            if size >= readers.DEFAULT_CHUNK_BYTES:
                self.ranges.append((start, i + 1))
                start, size = i + 1, 0
        if start < len(_DOCS):
            self.ranges.append((start, len(_DOCS)))
        ctx = multiprocessing.get_context("fork")  # documents shared, not copied
        self.pool = ctx.Pool(workers, initializer=_init, initargs=(model,))
        self.pool.map(_encode_range, self.ranges[:workers])  # warm up

    def run(self) -> tuple[int, float, float]:
        """(tokens, wall seconds, CPU seconds)."""
        t0 = time.perf_counter()
        parts = list(self.pool.imap_unordered(_encode_range, self.ranges))
        wall = time.perf_counter() - t0
        return sum(p[0] for p in parts), wall, sum(p[1] for p in parts)

    def close(self) -> None:
        self.pool.close()
        self.pool.join()


def ours(model: str, corpus: str, workdir: str, workers: int) -> tuple[int, float, float]:
    """The whole preprocess, pool start-up included: (tokens, wall s, CPU s)."""
    cpu, t0 = _cpu_seconds(), time.perf_counter()
    result = preprocess(readers.discover([corpus]), model, os.path.join(workdir, "out"),
                        workers=workers, progress=False, log=lambda m: None)
    return result["counts"].tokens, time.perf_counter() - t0, _cpu_seconds() - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=64, help="corpus size in MB (default 64)")
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--workers", type=int, default=default_workers())
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workdir", default=None, help="keep files here (default: a temp dir)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        workdir = args.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        demo, corpus = build_corpus(workdir, args.mb)
        model = os.path.join(workdir, "tok")
        train(readers.discover([demo]), model, args.vocab_size, log=lambda m: None)
        model += ".model"
        print(f"corpus: {os.path.getsize(corpus) / 1e6:.1f} MB jsonl "
              f"(demo corpus repeated), BPE vocab {args.vocab_size}, "
              f"{args.workers} workers, {os.cpu_count()} CPUs, best of {args.repeat}")
        # Interleaved, best of each: load from other processes hits both alike.
        ceil = Ceiling(model, corpus, args.workers)
        runs_c, runs_o = [], []
        for _ in range(args.repeat):
            runs_c.append(ceil.run())
            runs_o.append(ours(model, corpus, workdir, args.workers))
        ceil.close()
        c_tokens, c_time, _ = min(runs_c, key=lambda r: r[1])
        o_tokens, o_time, _ = min(runs_o, key=lambda r: r[1])
        c_cpu = min(r[2] for r in runs_c)
        o_cpu = min(r[2] for r in runs_o)
        if o_tokens != c_tokens:
            print(f"WARNING: token counts differ: ours {o_tokens}, ceiling {c_tokens}")
        ours_tps, ceil_tps = o_tokens / o_time, c_tokens / c_time
        print(f"ours     {ours_tps:12,.0f} tokens/s  ({o_tokens:,} tokens in {o_time:.2f}s, "
              f"end to end: read, parse, encode, write)")
        print(f"ceiling  {ceil_tps:12,.0f} tokens/s  ({c_tokens:,} tokens in {c_time:.2f}s, "
              f"sentencepiece alone on {args.workers} processes)")
        print(f"ratio    {ours_tps / ceil_tps:.3f}  (target >= 0.8)")
        # CPU seconds are what the wall clock becomes on an idle machine, and
        # less disturbed by other load: a second opinion on a shared machine.
        print(f"cpu      ours {o_cpu:.2f}s, ceiling {c_cpu:.2f}s: ratio {c_cpu / o_cpu:.3f}  "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
