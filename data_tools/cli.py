"""Command line of the data tools: ``kvtrain data <command>`` or
``python -m data_tools <command>``.

``register(subparsers)`` adds the ``data`` command to the kvtrain CLI;
``main(argv)`` is the standalone entry. Each command's module is imported
only when that command runs, so ``--help`` never loads sentencepiece, numpy
or pyarrow (and nothing here imports torch, megatron or kvtrain).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from data_tools.fileio import PIPE_CLOSED, os_error_text, stdout_reader_gone

# command -> (module with run(args), one-line help)
COMMANDS = {
    "train-tokenizer": ("data_tools.train_tokenizer",
                        "train a sentencepiece BPE tokenizer (byte fallback, split digits)"),
    "preprocess": ("data_tools.preprocess",
                   "tokenize documents into Megatron .bin/.idx shards"),
    "merge": ("data_tools.merge", "join .bin/.idx datasets (e.g. shards) into one"),
    "inspect": ("data_tools.inspect_shard", "summarize and check a .bin/.idx dataset"),
    "demo-corpus": ("data_tools.demo_corpus",
                    "write a small English corpus from the Python stdlib docs (offline)"),
}

_FORMAT_HELP = ("input format: jsonl, text or parquet; 'auto' (default) goes by the name: "
                ".jsonl/.json/.ndjson, .txt/.text, .parquet, each optionally .gz or .zst")


def _runner(command: str):
    module = COMMANDS[command][0]

    def run(args) -> int:
        try:
            return importlib.import_module(module).run(args)
        except OSError as e:
            if isinstance(e, BrokenPipeError) and stdout_reader_gone():
                return PIPE_CLOSED  # `kvtrain data inspect ... | head`: the pipeline's end
            # A path that cannot be read or written (an output under a file, a
            # full disk): what the user can fix is the path, not the code.
            print(f"kvtrain data {command}: error: {os_error_text(e)}", file=sys.stderr)
            return 1

    return run


def _inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", "-i", nargs="+", required=True, metavar="PATH",
                   help="files, directories (searched recursively) or quoted globs")
    p.add_argument("--json-key", default="text",
                   help="jsonl key (parquet column) holding the text (default: text)")
    p.add_argument("--format", choices=["auto", "jsonl", "text", "parquet"], default="auto",
                   help=_FORMAT_HELP)
    p.add_argument("--text-mode", choices=["line", "file"], default="line",
                   help="text inputs: one document per line (default) or per file")


def _add_train_tokenizer(sub, fmt) -> None:
    p = sub.add_parser("train-tokenizer", help=COMMANDS["train-tokenizer"][1],
                       formatter_class=fmt, description=(
                           "Train a Llama-style sentencepiece BPE model. Writes PREFIX.model,\n"
                           "PREFIX.vocab and PREFIX.json (vocab size and unk/bos/eos/pad ids;\n"
                           "eos is the EOD that preprocess appends)."))
    _inputs(p)
    p.add_argument("--vocab-size", type=int, required=True,
                   help="vocabulary size including specials and the 256 byte pieces "
                        "(at least 261)")
    p.add_argument("--output", "-o", required=True, metavar="PREFIX")
    p.add_argument("--max-sentences", type=int, default=10_000_000,
                   help="lines sampled for training (sentencepiece input_sentence_size)")
    p.add_argument("--max-documents", type=int, default=None,
                   help="read at most this many documents")
    p.add_argument("--character-coverage", type=float, default=0.99995,
                   help="share of the characters kept as pieces, in [0.98, 1] (default "
                        "0.99995); the rest become byte pieces")
    p.add_argument("--threads", type=int, default=None,
                   help="1 to 1024 (default: all cores, at most 1024)")
    p.add_argument("--seed", type=int, default=1234, help="sentence sampling seed")
    p.add_argument("--verbose", action="store_true", help="show sentencepiece's log")
    p.add_argument("--force", action="store_true",
                   help="replace an existing PREFIX.model, .vocab and .json (shards made "
                        "with the old tokenizer no longer match it)")
    p.set_defaults(func=_runner("train-tokenizer"))


def add_commands(sub) -> None:
    """Add the data commands to an argparse subparsers object."""
    fmt = argparse.RawDescriptionHelpFormatter
    _add_train_tokenizer(sub, fmt)

    p = sub.add_parser("preprocess", help=COMMANDS["preprocess"][1], formatter_class=fmt,
                       description=(
                           "Tokenize documents, append EOD to each, and write Megatron\n"
                           "IndexedDataset shards: PREFIX_text_document.bin/.idx for one shard,\n"
                           "PREFIX_00000_text_document, ... for several (one per input file\n"
                           "unless --shards). Bad records are skipped and counted by reason:\n"
                           "invalid_utf8, malformed_json, missing_key, not_a_string,\n"
                           "empty_document."))
    _inputs(p)
    p.add_argument("--tokenizer", "-t", required=True, metavar="MODEL",
                   help="sentencepiece model (PREFIX, PREFIX.model or PREFIX.json)")
    p.add_argument("--output-prefix", "-o", required=True, metavar="PREFIX")
    p.add_argument("--workers", "-j", type=int, default=None,
                   help="tokenizer processes (default: all cores; 0: no subprocess)")
    p.add_argument("--shards", type=int, default=None,
                   help="group the inputs into N shards (default: one per input file)")
    p.add_argument("--resume", action="store_true",
                   help="keep shards a previous run completed with the same inputs and options")
    p.add_argument("--force", action="store_true",
                   help="replace the shards an earlier run wrote at this prefix")
    p.add_argument("--strict", action="store_true",
                   help="stop at the first bad record (exit 1, naming file:line)")
    p.add_argument("--report-bad", type=int, default=5, metavar="N",
                   help="print the first N bad records (default 5)")
    p.add_argument("--chunk-mb", type=float, default=1.0,
                   help="input MiB per work unit, at most 1024 (default 1)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress line")
    p.set_defaults(func=_runner("preprocess"))

    p = sub.add_parser("merge", help=COMMANDS["merge"][1], formatter_class=fmt,
                       description=(
                           "Concatenate datasets in the order given. INPUT is a dataset prefix,\n"
                           "its .idx/.bin, a preprocess PREFIX (all its shards), or a quoted\n"
                           "glob of .idx files. Writes OUT_text_document.bin/.idx."))
    p.add_argument("inputs", nargs="+", metavar="INPUT")
    p.add_argument("--output-prefix", "-o", required=True, metavar="OUT")
    p.add_argument("--force", action="store_true", help="replace an existing OUT_text_document")
    p.set_defaults(func=_runner("merge"))

    p = sub.add_parser("inspect", help=COMMANDS["inspect"][1])
    p.add_argument("prefix", metavar="PREFIX",
                   help="dataset prefix, its .idx, or a preprocess PREFIX")
    p.add_argument("--tokenizer", "-t", metavar="MODEL",
                   help="decode documents with this model (default: the one preprocess used)")
    p.add_argument("--docs", type=int, default=3, help="documents to show (default 3)")
    p.add_argument("--max-chars", type=int, default=400, help="characters shown per document")
    p.set_defaults(func=_runner("inspect"))

    p = sub.add_parser("demo-corpus", help=COMMANDS["demo-corpus"][1])
    p.add_argument("--output", "-o", required=True, metavar="FILE.jsonl")
    p.add_argument("--max-mb", type=float, default=None, help="stop after this many MB")
    p.add_argument("--force", action="store_true", help="replace an existing FILE.jsonl")
    p.set_defaults(func=_runner("demo-corpus"))


def register(subparsers) -> None:
    """Add ``data`` and its commands to the kvtrain CLI."""
    p = subparsers.add_parser(
        "data", help="tokenizer training and corpus preprocessing",
        description="Tokenizer training and corpus -> Megatron .bin/.idx preprocessing.")
    add_commands(p.add_subparsers(dest="data_command", metavar="COMMAND", required=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m data_tools",
        description="Tokenizer training and corpus -> Megatron .bin/.idx preprocessing.")
    add_commands(parser.add_subparsers(dest="data_command", metavar="COMMAND", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
