"""``kvtrain data train-tokenizer``: a Llama-style sentencepiece BPE model.

Settings follow Llama's tokenizer: BPE, byte fallback (no <unk> at encode
time: unseen characters become <0xNN> byte pieces), digits split one per
token, identity normalization and no whitespace folding (so decoding gives the
text back exactly), and the special ids unk=0, bos=1, eos=2, pad=3. Newlines
are never pieces (sentencepiece trains on lines); in documents they encode as
the byte piece <0x0A>.

The documents are read with the same readers as ``preprocess`` and streamed
to sentencepiece, one line per sentence, through its sentence iterator (no
temporary copy of the corpus); sentencepiece keeps a random sample of
``--max-sentences`` lines and trains on it. Outputs are written under
temporary names and renamed in, the sidecar last (an old one removed first): a
PREFIX.json that exists describes a complete tokenizer. The CLI refuses a PREFIX
whose files exist unless ``--force``: shards made with a tokenizer no longer
match it once it is trained again.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import sys
import time

from data_tools import readers
from data_tools.fileio import (atomic_write_bytes, check_not_there, check_prefix,
                              file_in_the_way)
from data_tools.tokenizer import SentencePieceTokenizer, sidecar_path

SPECIAL_IDS = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": 3}


def trainer_options(vocab_size: int, *, character_coverage: float = 0.99995,
                    max_sentences: int = 10_000_000, max_sentence_length: int = 16384,
                    threads: int | None = None) -> dict:
    """sentencepiece training options (without input/model_prefix)."""
    return dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        allow_whitespace_only_pieces=True,
        character_coverage=character_coverage,
        input_sentence_size=max_sentences,
        shuffle_input_sentence=True,
        max_sentence_length=max_sentence_length,
        num_threads=threads or min(os.cpu_count() or 1, 1024),  # sentencepiece's maximum
        unk_surface=" \u2047 ",
        **SPECIAL_IDS,
        pad_piece="<pad>",
    )


class SentenceStream:
    """The documents' non-empty lines, one sentencepiece "sentence" each,
    streamed from the readers; counts what it read and skipped."""

    def __init__(self, inputs: list[readers.InputFile], *, json_key: str, text_mode: str,
                 max_documents: int | None = None, report=None) -> None:
        self.inputs, self.json_key, self.text_mode = inputs, json_key, text_mode
        self.max_documents, self.report = max_documents, report
        self.stats = {"documents": 0, "sentences": 0, "characters": 0, "skipped": {}}
        self.error: BaseException | None = None

    def _chunks(self):
        if self.text_mode == "file":
            yield from readers.iter_file_docs(self.inputs, 0)
        else:
            for inp in self.inputs:
                yield from readers.iter_chunks(inp, 0, self.json_key)

    def __iter__(self):
        stats = self.stats
        try:
            for chunk in self._chunks():
                res = readers.parse_chunk(chunk, self.json_key, keep_samples=3)
                for reason, n in res.counts.items():
                    stats["skipped"][reason] = stats["skipped"].get(reason, 0) + n
                if self.report:
                    for loc, reason, detail in res.samples:
                        self.report(f"train-tokenizer: skipped {loc}: {reason} ({detail})")
                for text in res.texts:
                    for line in text.split("\n"):
                        if line.strip():
                            stats["sentences"] += 1
                            yield line
                    stats["characters"] += len(text)
                    stats["documents"] += 1
                    if self.max_documents and stats["documents"] >= self.max_documents:
                        return
        except Exception as e:  # surfaced after training; C++ would mask it
            self.error = e


def train(inputs: list[readers.InputFile], output_prefix: str, vocab_size: int, *,
          json_key: str = "text", text_mode: str = "line", max_documents: int | None = None,
          seed: int = 1234, verbose: bool = False, log=None, **options) -> dict:
    """Train and write PREFIX.model, PREFIX.vocab and the sidecar PREFIX.json.

    Returns the sidecar dict. The model bytes depend only on the documents,
    the options and the seed (no file names are recorded in it). An option out of
    range raises ``ValueError`` before any input is read (``check_options``)."""
    import sentencepiece as spm

    check_options(vocab_size, seed=seed, max_documents=max_documents, **options)
    log = log or _stderr
    if text_mode == "file" and any(i.format != "text" for i in inputs):
        raise ValueError("--text-mode file reads text files whole; some inputs are not text")
    output_prefix = os.path.abspath(output_prefix)
    folder = os.path.dirname(output_prefix)
    if (blocker := file_in_the_way(folder)) is not None:  # before minutes of training
        raise ValueError(f"{blocker} is a file, not a folder")
    t0 = time.time()
    sentences = SentenceStream(inputs, json_key=json_key, text_mode=text_mode,
                               max_documents=max_documents, report=log)
    # Seeds sentencepiece's sentence sampling: same corpus, same model.
    spm.set_random_generator_seed(seed)
    opts = trainer_options(vocab_size, **options)
    if not verbose:
        opts["minloglevel"] = 2
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences), model_writer=model,
                                       **opts)
    except RuntimeError as e:
        if sentences.error is None and sentences.stats["sentences"]:
            raise ValueError(_sentencepiece_error(str(e), opts)) from None
    if sentences.error is not None:
        raise sentences.error
    stats = sentences.stats
    if stats["sentences"] == 0:
        raise ValueError("no text to train on: every input document was skipped or empty")
    log(f"train-tokenizer: {stats['documents']} documents, {stats['sentences']} lines, "
        f"{stats['characters'] / 1e6:.1f}M characters, vocab {vocab_size}")
    os.makedirs(folder, exist_ok=True)  # only now: a failed training leaves no folder
    # An old sidecar (--force) goes before its model is replaced: cut short, the
    # write must not leave it describing the new model.
    with contextlib.suppress(FileNotFoundError):
        os.unlink(sidecar_path(output_prefix + ".model"))
    atomic_write_bytes(output_prefix + ".model", model.getvalue())
    tok = SentencePieceTokenizer(output_prefix + ".model")
    sp = tok.processor
    vocab = "".join(f"{sp.id_to_piece(i)}\t{sp.get_score(i):g}\n" for i in range(tok.vocab_size))
    atomic_write_bytes(output_prefix + ".vocab", vocab.encode("utf-8"))
    side = tok.sidecar()
    side.update(
        model_type="bpe", byte_fallback=True, split_digits=True,
        trained_on={
            "inputs": [os.path.abspath(i.path) for i in inputs], "json_key": json_key,
            "text_mode": text_mode, "documents": stats["documents"],
            "sentences": stats["sentences"], "skipped": stats["skipped"], "seed": seed,
        },
    )
    # The sidecar last: a PREFIX.json that exists describes a complete tokenizer.
    atomic_write_bytes(sidecar_path(tok.model_path), (json.dumps(side, indent=2) + "\n").encode())
    log(f"train-tokenizer: wrote {output_prefix}.model, .vocab, .json "
        f"(vocab {tok.vocab_size}, eod {tok.eod}, pad {tok.pad}) in {time.time() - t0:.1f}s")
    return side


def _sentencepiece_error(text: str, opts: dict) -> str:
    """A vocabulary the corpus cannot fit, in this CLI's option names
    (sentencepiece names its own: vocab_size, --character_coverage)."""
    vocab, cover = opts["vocab_size"], opts["character_coverage"]
    if m := re.search(r"smaller than required_chars\. \d+ vs (\d+)", text):
        need = int(m[1])
        chars = need - len(SPECIAL_IDS) - 256
        return (f"--vocab-size {vocab} is smaller than the {need} pieces this corpus needs "
                f"({len(SPECIAL_IDS)} special, 256 byte pieces and {chars} characters at "
                f"--character-coverage {cover}): raise --vocab-size or lower "
                f"--character-coverage (to 0.98)")
    if m := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)",
                      text):
        return (f"--vocab-size {vocab} is more pieces than this corpus gives: at most {m[1]} "
                f"here; give a smaller --vocab-size or more text")
    return f"sentencepiece: {text}"


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_options(vocab_size: int, *, seed: int = 1234, max_documents: int | None = None,
                  threads: int | None = None, character_coverage: float = 0.99995,
                  max_sentences: int = 10_000_000, **_) -> None:
    """sentencepiece's own limits (and ours), before the corpus is read: past
    them it fails in its words ("INTERNAL: trainer_interface.cc(94) ...")."""
    if not 0 <= seed < 2**32:  # sentencepiece's seed is unsigned 32-bit
        raise ValueError(f"--seed must be in [0, 2**32 - 1], got {seed}")
    if max_documents is not None and max_documents < 1:  # 0 silently meant all
        raise ValueError(f"--max-documents must be at least 1, got {max_documents}")
    # 4 special and 256 byte pieces, and the corpus has at least one character
    if vocab_size < len(SPECIAL_IDS) + 256 + 1:
        raise ValueError(f"--vocab-size must be at least 261 (4 special pieces, 256 byte "
                         f"pieces and a character), got {vocab_size}")
    if threads is not None and not 1 <= threads <= 1024:  # 0 silently meant all
        raise ValueError(f"--threads must be in [1, 1024], got {threads}")
    if not 0.98 <= character_coverage <= 1.0:  # nan too
        raise ValueError(f"--character-coverage must be in [0.98, 1.0], "
                         f"got {character_coverage}")
    if max_sentences < 1:  # sentencepiece reads 0 as all lines, -1 not at all
        raise ValueError(f"--max-sentences must be at least 1, got {max_sentences}")


def run(args) -> int:
    """CLI entry (see data_tools.cli)."""
    try:
        check_options(args.vocab_size, seed=args.seed, max_documents=args.max_documents,
                      threads=args.threads, character_coverage=args.character_coverage,
                      max_sentences=args.max_sentences)
        check_prefix(args.output, "--output", "tokenizer", added=".model")
        if not args.force:  # before minutes of training
            prefix = os.path.abspath(args.output)
            check_not_there([prefix + ext for ext in (".model", ".vocab", ".json")], "--output")
        inputs = readers.discover(args.input, args.format)
        train(inputs, args.output, args.vocab_size, json_key=args.json_key,
              text_mode=args.text_mode, max_documents=args.max_documents, seed=args.seed,
              verbose=args.verbose, character_coverage=args.character_coverage,
              max_sentences=args.max_sentences, threads=args.threads)
    except (readers.InputError, ValueError) as e:
        print(f"kvtrain data train-tokenizer: error: {e}", file=sys.stderr)
        return 1
    return 0
