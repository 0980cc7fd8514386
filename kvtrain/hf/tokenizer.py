"""The run's sentencepiece tokenizer as Hugging Face tokenizer files.

``AutoTokenizer.from_pretrained(OUT)`` reads ``tokenizer.json`` (a ``tokenizers``
BPE pipeline built here from the sentencepiece model) with
``tokenizer_config.json``; ``tokenizer.model`` (the sentencepiece model itself)
is copied too. transformers 5 converts a bare ``tokenizer.model`` with its own
Llama assumptions at every load (slow, and wrong for our settings: measured,
every piece differed), so the conversion is done once here and checked.

The pipeline mirrors the settings of ``data_tools.train_tokenizer`` (BPE, byte
fallback, split digits, identity normalisation, a dummy prefix, whitespace
kept): spaces become ``▁`` with one prepended, digits are split one by one, and
BPE merges in sentencepiece's piece order (a merge's rank is the id of the piece
it makes). ``check_tokenizer`` compares it with sentencepiece on probe texts;
the export refuses a tokenizer that encodes differently.

Like kvtrain's ``preprocess``, the tokenizer adds no BOS and no EOS: the model
was trained on documents separated by EOS only. BOS/EOS/PAD/UNK are the
sentencepiece model's pieces; a model without a pad piece pads with EOS.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError

# texts that exercise the pipeline: spaces, newlines, digits, bytes outside the vocabulary
PROBES = (
    "Hello world", " two  spaces", "line\nbreak\n\nx", "digits 12345 and 3.14",
    "accents é ü, CJK 漢字, emoji 🙂", "  leading", "trailing ", "\tTab\t", "a1b22c333",
    "def f(x):\n    return x ** 2  # square\n", "",
)


def _merges(sp, vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges of a sentencepiece BPE model: every split of a normal piece into
    two pieces of the vocabulary, ranked by the id of the piece it makes."""
    ranked = []
    for piece, rank in vocab.items():
        if sp.is_control(rank) or sp.is_unknown(rank) or sp.is_byte(rank):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((rank, vocab[left], vocab[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(model_path: str | Path):
    """A ``tokenizers.Tokenizer`` equal to the sentencepiece BPE model at ``model_path``."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

    sp = spm.SentencePieceProcessor(model_file=str(model_path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    unk = sp.id_to_piece(sp.unk_id())
    tok = Tokenizer(models.BPE(vocab=vocab, merges=_merges(sp, vocab), fuse_unk=True,
                               byte_fallback=True, unk_token=unk))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Digits(individual_digits=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    specials = [sp.id_to_piece(i) for i in range(sp.get_piece_size())
                if sp.is_control(i) or sp.is_unknown(i)]
    tok.add_special_tokens(specials)
    return tok, sp


def check_tokenizer(tok, sp, texts: tuple[str, ...] = PROBES) -> Optional[str]:
    """None when ``tok`` encodes and decodes ``texts`` as sentencepiece does, else
    the first text that differs (repr)."""
    for text in texts:
        ids = sp.encode(text)
        if tok.encode(text, add_special_tokens=False).ids != ids or tok.decode(ids) != sp.decode(ids):
            return repr(text)
    return None


def special_ids(sp) -> dict[str, Optional[int]]:
    """bos/eos/pad/unk ids (pad falls back to EOS)."""
    def valid(i: int) -> Optional[int]:
        return i if i >= 0 else None

    eos = valid(sp.eos_id())
    pad = valid(sp.pad_id())
    return {"bos": valid(sp.bos_id()), "eos": eos, "pad": eos if pad is None else pad,
            "unk": valid(sp.unk_id())}


def export_tokenizer(model_path: str | Path, out_dir: Path) -> dict[str, Optional[int]]:
    """Writes tokenizer.model, tokenizer.json, tokenizer_config.json and
    special_tokens_map.json into ``out_dir``; returns the special ids."""
    model_path = Path(model_path)
    try:
        tok, sp = build_tokenizer(model_path)
    except (OSError, RuntimeError) as e:
        raise ConfigError(f"tokenizer {model_path}: cannot read it ({e})") from None
    if sp.get_piece_size() and not any(sp.is_byte(i) for i in range(sp.get_piece_size())):
        raise ConfigError(f"tokenizer {model_path}: only byte-fallback BPE models "
                          "(kvtrain data train-tokenizer) can be exported")
    differs = check_tokenizer(tok, sp)
    if differs is not None:
        raise ConfigError(f"tokenizer {model_path}: the Hugging Face conversion encodes "
                          f"{differs} differently from sentencepiece; not exported")
    ids = special_ids(sp)
    piece = {k: (sp.id_to_piece(v) if v is not None else None) for k, v in ids.items()}
    shutil.copyfile(model_path, out_dir / "tokenizer.model")
    tok.save(str(out_dir / "tokenizer.json"))
    names = {f"{k}_token": v for k, v in piece.items() if v is not None}
    # split_special_tokens: "</s>" in a text is plain text, as sentencepiece (and so the
    # training data) reads it, not the EOD id (tokenizer.json cannot hold that switch)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "split_special_tokens": True,
              "model_max_length": 1 << 30, "padding_side": "left", **names}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(names, indent=1) + "\n")
    return ids


__all__ = ["build_tokenizer", "check_tokenizer", "export_tokenizer", "special_ids"]
