"""The tokenizer object megatron's GPT datasets need: ``vocab_size``, ``eod``, ``pad``
and ``unique_identifiers`` (a JSON-able dict that goes into the index-cache hash).

``data.tokenizer`` names a SentencePiece model, loaded with the data tools'
``data_tools.tokenizer.SentencePieceTokenizer`` (EOD = the EOS piece that
preprocessing appends; pad -1 when the model has none). Shards tokenized
elsewhere can be trained on with ``data.tokenizer: null``: the vocabulary is
then ``model.vocab_size`` and the end-of-document id ``data.eod_id``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from kvtrain.config import ConfigError
from kvtrain.config.schema import DataConfig, ModelConfig

# megatron's "no pad token" value: GPTDataset masks labels equal to the pad id,
# so a tokenizer without PAD must report an id that never occurs in the data.
NO_PAD = -1


class VocabOnlyTokenizer:
    """Stands in for a tokenizer when only ids matter (mock data, foreign shards)."""

    def __init__(self, vocab_size: int, eod: Optional[int], name: str):
        self.vocab_size = vocab_size
        # GPTDataset only reads eod for reset_* and eod_mask_loss (validated in the
        # config); megatron's mock data appends it to every document.
        self.eod = vocab_size - 1 if eod is None else eod
        self.pad = NO_PAD
        self.bos = None
        self.unique_identifiers = {"class": name, "vocab_size": vocab_size, "eod": self.eod}


def load_tokenizer(data: DataConfig, model: ModelConfig, key: str = "data.tokenizer") -> Any:
    """The tokenizer of a run, checked against ``model.vocab_size`` (``key``: how the
    one-line errors name where the path came from)."""
    if data.type == "mock":
        return VocabOnlyTokenizer(model.vocab_size, data.eod_id, "MockTokenizer")
    if data.tokenizer is None:
        return VocabOnlyTokenizer(model.vocab_size, data.eod_id, "VocabOnlyTokenizer")
    from data_tools.tokenizer import SentencePieceTokenizer  # the project's wrapper

    try:  # PREFIX, PREFIX.model or PREFIX.json
        tokenizer = SentencePieceTokenizer(str(Path(data.tokenizer).expanduser()))
    except (OSError, RuntimeError, ValueError) as e:
        raise ConfigError(f"{key} {data.tokenizer}: cannot load ({e})") from None
    if data.eod_id is not None and data.eod_id != tokenizer.eod:  # meant another one
        raise ConfigError(
            f"data.eod_id ({data.eod_id}) differs from the end-of-document id of {key} "
            f"({tokenizer.eod}): with a tokenizer, leave data.eod_id out (null)")
    if tokenizer.vocab_size > model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model.vocab_size}) is smaller than the vocabulary of "
            f"{key} ({tokenizer.vocab_size})"
        )
    return tokenizer
