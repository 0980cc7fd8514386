"""Train/valid/test datasets for the trainer, built with megatron's own builders.

* ``data.type: gpt`` - ``.bin/.idx`` shards (megatron's IndexedDataset format,
  whoever wrote them) blended with ``data.paths`` weights and split by
  ``data.split`` through ``BlendedMegatronDatasetBuilder`` + ``GPTDataset``;
* ``data.type: mock`` - ``MockGPTDataset`` (synthetic documents), for smoke runs.

With ``data.valid_paths`` the validation part is a blend of its own (megatron's
``blend_per_split``, Megatron-LM's ``--valid-data-path``): every document of its
shards, none of which ``data.paths`` may hold, and the training draws from every
document of ``data.paths``. Each of ``data.valid_sets`` is built the same way, by a
builder of its own: all its shards, apart from data.paths, indexed under its own
shards' stamps (a set added keeps the training's index caches).

Index caches (document/sample/shuffle indices) go to ``data.cache_dir``
(default ``<run_dir>/data_cache``); the builder makes rank 0 build them while
the other ranks wait at a barrier, then every rank loads them.

Shards are checked against their index before megatron opens them
(``data_tools.indexed.check_shard``): a missing, truncated or foreign file is
one line naming it, not a traceback at the first batch read.

One trap is checked here rather than inside megatron: a split part that gets
0 documents of a shard but is asked for samples makes ``GPTDataset`` loop
forever (``_get_num_epochs``). Parts we need (train; valid when evaluating)
must own documents; parts we do not use are dropped from the split matrix
without moving the boundaries of the others.

megatron keys its index caches by the shard's path, not its content: a corpus
written again under the same name (a rerun of preprocess) would be read through
the first one's indices. The key here also holds each shard's file sizes and
mtimes (``StampedGPTDataset``), so a rewritten shard gets indices of its own.

Unweighted prefixes (``data.paths: [a, b]``) are blended with weights equal to
their token counts, i.e. like one corpus. megatron itself would build one
epoch of each and blend min(asked, one epoch): a run needing more than one
epoch, or a validation part smaller than eval_iters batches, came up short.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from kvtrain.config import ConfigError
from kvtrain.config.schema import RunConfig
from kvtrain.tasks.config import TASK_TYPES

from .index_cache import built_whole
from .index_memory import check_index_memory, drawn_parts
from .passes import one_pass, part_pass

SPLIT_NAMES = ("training", "validation", "test")  # the parts of data.split, in order


@dataclass
class Datasets:
    """The built datasets (None for a part not built) and what they were built from."""

    train: Any
    valid: Optional[Any]
    test: Optional[Any]
    tokenizer: Any
    valid_sets: dict[str, Any] = field(default_factory=dict)  # data.valid_sets, by name
    warnings: list[str] = field(default_factory=list)  # for rank 0 to say (validation_read_over)


def parse_blend(paths: list) -> tuple[list[str], Optional[list[float]]]:
    """``[a, b]`` -> ([a, b], None); ``[0.7, a, 0.3, b]`` -> ([a, b], [0.7, 0.3])."""
    if all(isinstance(p, str) for p in paths):
        return [str(p) for p in paths], None
    weights = [float(w) for w in paths[0::2]]
    prefixes = [str(p) for p in paths[1::2]]
    return prefixes, weights


def _shard_size(prefix: str, key: str = "data.paths") -> tuple[int, int]:
    """Sequences (megatron's split unit) and tokens in a shard, from its .idx only."""
    from data_tools.indexed import IndexedReader, check_shard

    # megatron finds a damaged shard as an assertion, or a short .bin only at the
    # first batch that reads past its end: check the files against their index,
    # then the index itself (O(sequences), in chunks; megatron's index build reads
    # as much): pointers off their lengths were a ValueError mid-run, negative
    # lengths or decreasing document indices trained on other tokens, silently.
    problem = check_shard(prefix)
    if problem is not None:
        raise ConfigError(f"{key}: shard {problem}")
    reader = IndexedReader(prefix)
    problems = reader.check()
    if problems:
        raise ConfigError(f"{key}: shard {prefix} has a damaged index {reader.idx_file}: "
                          f"{'; '.join(problems)}")
    return reader.sequence_count, reader.num_tokens


def _check_made_with(prefix: str, tokenizer: Any, data: Any, model: Any,
                     key: str = "data.paths") -> None:
    """Refuses a shard whose ``.meta.json`` (preprocess, merge) records another
    tokenizer, EOD id or a larger vocabulary than the run's: its ids would be read
    as other pieces, its document ends missed, or overrun the embedding. Shards
    without a record (megatron's own) are not checked."""
    from data_tools.indexed import read_meta

    meta = read_meta(prefix) or {}
    made = meta.get("fingerprint") if isinstance(meta.get("fingerprint"), dict) else meta
    sha = getattr(tokenizer, "sha256", None)  # a sentencepiece model (data.tokenizer)
    if sha is not None and made.get("tokenizer_sha256", sha) != sha:
        raise ConfigError(
            f"{key}: shard {prefix} was made with another tokenizer than data.tokenizer "
            f"{data.tokenizer} (sha256 {str(made['tokenizer_sha256'])[:12]}... vs {sha[:12]}..., "
            f"its .meta.json says): its ids are other pieces; give the tokenizer it was made with")
    if data.tokenizer is None and data.eod_id is not None and made.get("eod",
                                                                       data.eod_id) != data.eod_id:
        raise ConfigError(
            f"data.eod_id {data.eod_id} is not the EOD id {made['eod']} that shard {prefix} "
            f"ends its documents with (its .meta.json says)")
    vocab = meta.get("vocab_size")
    if isinstance(vocab, int) and vocab > model.vocab_size:
        raise ConfigError(
            f"model.vocab_size ({model.vocab_size}) is smaller than the vocabulary of the "
            f"tokenizer shard {prefix} was made with ({vocab}, its .meta.json says)")


def _datasets_of(path: str) -> list[str]:
    """The datasets a ``data.paths`` entry names, as the data tools read it: a
    dataset prefix, its ``.idx``/``.bin``, a preprocess ``--output-prefix`` (its
    ``_text_document``, or all of its ``_NNNNN_text_document`` shards) or a glob of
    ``.idx`` files. One naming none stays itself: its check says what is missing."""
    from data_tools.indexed import resolve_prefixes

    try:  # a dataset prefix first: resolve_prefixes checks it before the rest
        return resolve_prefixes(path)
    except FileNotFoundError:
        return [path[: -len(".idx")] if path.endswith((".idx", ".bin")) else path]


def _blend(paths: list, key: str = "data.paths",
           known: Optional[dict] = None) -> tuple[tuple, dict[str, tuple[int, int]]]:
    """The blend to hand megatron, and each dataset's sequence and token counts (its
    shard checked). An entry naming several shards shares its weight among them by
    their tokens; unweighted datasets get their token counts as weights: one corpus
    (megatron's own unweighted blend stops at one epoch of each, see above)."""
    entries, entry_weights = parse_blend(paths)
    named = [_datasets_of(entry) for entry in entries]
    prefixes = [prefix for group in named for prefix in group]
    _check_blend_size(key, entries, named)
    known = known or {}  # sizes of shards checked already (a start's build)
    sizes = {p: known[p] if p in known else _shard_size(p, key) for p in prefixes}
    weights = None
    if entry_weights is not None:
        totals = [max(sum(sizes[p][1] for p in group), 1) for group in named]
        weights = [w * sizes[p][1] / total
                   for w, group, total in zip(entry_weights, named, totals) for p in group]
    elif len(prefixes) > 1:
        weights = [float(sizes[p][1]) for p in prefixes]
    return (prefixes, weights), sizes


# megatron's BlendedDataset asserts fewer than 32767 datasets (its dataset ids are int16)
MAX_BLENDED = 32766


def _check_blend_size(key: str, entries: list[str], named: list[list[str]]) -> None:
    """A blend megatron can build: at most MAX_BLENDED datasets. Said before any shard
    is read: megatron found it only after checking and indexing every one (over an hour
    for 32767 tiny shards here), as an ``AssertionError`` traceback."""
    total = sum(len(group) for group in named)
    if total <= MAX_BLENDED:
        return
    entry, group = max(zip(entries, named), key=lambda pair: len(pair[1]))
    merge = (f"kvtrain data merge --output-prefix {entry} {entry}" if len(group) > 1
             and entry not in group and not glob.has_magic(entry) else "kvtrain data merge")
    raise ConfigError(
        f"{key} names {total} datasets" + (f" ({entry}: {len(group)} shards)" if len(group) > 1
                                           else "")
        + f"; megatron blends at most {MAX_BLENDED}: merge them ({merge}) or preprocess the "
        "inputs into fewer shards (kvtrain data preprocess --shards N)")


def _idx_digest(path: str, chunk: int = 1 << 24) -> str:
    """A digest of an ``.idx`` file's bytes: the index caches follow from its sequence
    lengths and document boundaries (the tokens in the ``.bin`` do not change them)."""
    digest = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _file_stamps(prefixes: list[str]) -> dict[str, list]:
    """Each shard's .bin and .idx sizes and mtimes and a digest of its .idx, as rank 0
    (which builds the index caches) sees them: every rank must key the caches alike,
    also where a node reads its own copy of the shards. Sizes and times alone missed
    another corpus of the same sizes copied in with the old times (``rsync -t``); the
    .idx is ~12 bytes a sequence, read once here (the shard check reads it too)."""
    import torch.distributed as dist

    distributed = dist.is_initialized() and dist.get_world_size() > 1
    stamps = {}
    if not distributed or dist.get_rank() == 0:
        for prefix in prefixes:
            files = [os.stat(f"{prefix}{ext}") for ext in (".bin", ".idx")]
            stamps[prefix] = [n for st in files for n in (st.st_size, st.st_mtime_ns)]
            stamps[prefix].append(_idx_digest(f"{prefix}.idx"))
    if distributed:
        box = [stamps]
        dist.broadcast_object_list(box, src=0)
        stamps = box[0]
    return stamps


@functools.cache
def _stamped_gpt_dataset() -> type:
    """megatron's GPTDataset whose index-cache key also holds the shards' file stamps
    (``config.shard_files``); made on first use, as megatron is slow to import."""
    from megatron.core.datasets.gpt_dataset import GPTDataset

    class StampedGPTDataset(GPTDataset):
        @staticmethod
        def _key_config_attributes() -> list[str]:
            return GPTDataset._key_config_attributes() + ["shard_files"]

    # pickle finds the class by this module's name (module __getattr__ below)
    StampedGPTDataset.__module__, StampedGPTDataset.__qualname__ = __name__, "StampedGPTDataset"
    return StampedGPTDataset


def __getattr__(name: str):
    # unpickling a dataset (a loader worker started by spawn) looks the class up here
    if name == "StampedGPTDataset":
        return _stamped_gpt_dataset()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def plan_split(split_matrix: list, counts: dict[str, int], needed: tuple[bool, bool, bool],
               split: str) -> list:
    """The split matrix to build: parts we draw from are checked to own documents
    in every shard; parts we never draw from are dropped (None), so megatron never
    asks them for samples. The boundaries of the other parts do not move."""
    planned = []
    for i, bookends in enumerate(split_matrix):
        if not needed[i]:
            planned.append(None)
            continue
        if bookends is None:
            raise ConfigError(f"data.split {split!r} has no {SPLIT_NAMES[i]} part")
        for prefix, n in counts.items():
            docs = int(round(bookends[1] * n)) - int(round(bookends[0] * n))
            if docs <= 0:
                raise ConfigError(
                    f"data.split {split!r} gives the {SPLIT_NAMES[i]} part 0 of the {n} "
                    f"documents of {prefix}: use more documents or a larger "
                    f"{SPLIT_NAMES[i]} weight"
                    + (" (or set train.eval_interval: null)" if i == 1 else "")
                )
        planned.append(bookends)
    return planned


def _check_apart(blend: Optional[tuple], held_out: Optional[tuple],
                 key: str = "data.valid_paths") -> None:
    """A held-out validation set shares no shard with the training data."""
    if blend is None or held_out is None:
        return
    train = {os.path.realpath(p): p for p in blend[0]}
    both = [p for p in held_out[0] if os.path.realpath(p) in train]
    if both:
        raise ConfigError(f"{key}: {both[0]} is also in data.paths: a held-out "
                          "validation set shares no shard with the training data")


def _named_sets(cfg: RunConfig, blend: Optional[tuple]) -> dict[str, tuple[tuple, dict]]:
    """``data.valid_sets``: each set's blend and its shards' sizes, its shards checked
    whole and apart from data.paths."""
    named = {}
    for name, paths in cfg.data.valid_sets.items():
        key = f"data.valid_sets.{name}"
        named[name] = _blend(paths, key)
        _check_apart(blend, named[name][0], key)
    return named


def _checked_made_with(parts: list[tuple[str, Optional[tuple]]], tokenizer: Any,
                       cfg: RunConfig) -> list[str]:
    """Every shard of the blends (``parts``: each one's key and blend), each checked
    against the tokenizer it was made with (:func:`_check_made_with`)."""
    prefixes = []
    for key, part in parts:
        for prefix in part[0] if part is not None else []:
            _check_made_with(prefix, tokenizer, cfg.data, cfg.model, key)
            prefixes.append(prefix)
    return prefixes


def _dataset_config(cfg: RunConfig, cache_dir: Optional[str], tokenizer: Any,
                    blend: Optional[tuple], blend_per_split: Optional[list], split: Optional[str]):
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    d = cfg.data
    return GPTDatasetConfig(
        random_seed=d.seed if d.seed is not None else cfg.train.seed,
        sequence_length=cfg.train.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=split,
        path_to_cache=cache_dir,
        tokenizer=tokenizer,
        # RoPE takes no position ids, so restarting them per document would change
        # nothing: kvtrain has no such key
        reset_position_ids=False,
        # Documents are separated from the tokens in the forward step (document
        # ids once per micro batch, kvtrain.model.documents), never by a
        # [b, 1, s, s] mask built here: that would cost s^2 per sample.
        reset_attention_mask=False,
        eod_mask_loss=d.eod_mask_loss,
        create_attention_mask=False,
        mid_level_dataset_surplus=0.005,
    )


def _build_valid_set(cfg: RunConfig, cache_dir: Optional[str], tokenizer: Any, set_blend: tuple,
                     samples: int, stamps: dict) -> Any:
    """One named validation set: all of its shards, ``samples`` sequences of them (its
    epochs repeated where it is smaller), drawn in the run's data order (data.seed), so
    that every run of it of one data.seed scores the very same sequences (another seed
    draws another sample of them)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    ds_config = _dataset_config(cfg, cache_dir, tokenizer, None, [None, set_blend, None], None)
    # its own shards' stamps: a set added keeps the training's index caches
    ds_config.shard_files = {p: stamps[p] for p in set_blend[0]}
    sizes = [0, samples, 0] if set_blend[1] is not None else [None, samples, None]
    with built_whole(cache_dir, _writes_caches()):
        return BlendedMegatronDatasetBuilder(_stamped_gpt_dataset(), sizes, lambda: True,
                                             ds_config).build()[1]


def _writes_caches() -> bool:
    """Whether this rank writes the index caches: megatron's builder has rank 0 do it."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def sequences_held(paths: list, key: str, seq_length: int,
                   known: Optional[dict] = None) -> int:
    """The sequences of ``seq_length`` tokens one pass over the blend ``paths`` gives
    (megatron's: a sequence takes ``seq_length`` + 1 tokens, its last the next one's
    first); past them it draws the shards again, another epoch: tokens scored twice."""
    (prefixes, weights), sizes = _blend(paths, key, known)
    return one_pass([max(sizes[p][1] - 1, 0) // seq_length for p in prefixes], weights)


def validation_read_over(cfg: RunConfig, valid_samples: int,
                         known: Optional[dict] = None) -> list[str]:
    """Warnings for validation sets (``data.valid_paths``, ``data.valid_sets``, else
    data.split's validation part) smaller than one validation: each reads its first
    ``valid_samples`` sequences, so megatron draws a small set's shards again (more
    epochs) and its loss weighs their tokens over and over (a 14-token set was recorded
    as 128 tokens a validation). ``known``: the shards' sizes the build checked."""
    d, seq = cfg.data, cfg.train.seq_length
    if not valid_samples:
        return []
    sets = [(f"{key} holds", "its shards", "give it more data",
             sequences_held(paths, key, seq, known))
            for key, paths in [("data.valid_paths", d.valid_paths)]
            + [(f"data.valid_sets.{name}", paths) for name, paths in d.valid_sets.items()]
            if paths]
    if d.type == "gpt" and not d.valid_paths:  # the split's part of data.paths
        (prefixes, weights), _ = _blend(d.paths, "data.paths", known)
        sets.append((f"the validation part of data.split {d.split!r} holds", "its documents",
                     "give it more data (a larger validation weight in data.split)",
                     part_pass(prefixes, weights, d.split, 1, seq)))
    lines = []
    for what, source, advice, held in sets:
        if held < valid_samples:
            over = f"{valid_samples / held:.1f} times over" if held else "over and over"
            lines.append(f"kvtrain: warning: {what} {held} sequences of {seq} tokens (one pass "
                         f"over {source}), fewer than the {valid_samples} a validation reads "
                         f"(train.eval_iters x train.global_batch_size): it reads them {over}; "
                         f"{advice}, or lower train.eval_iters")
    return lines


def build_scored_set(cfg: RunConfig, paths: list, key: str, samples: int,
                     tokenizer: Any) -> Any:
    """The first ``samples`` sequences of the shards ``paths`` (the forms of data.paths),
    as a named validation set of ``cfg``'s run holds them (``kvtrain perplexity``):
    shards checked whole and against the tokenizer they were made with (``key`` names
    them in the one-line refusals); the indices built in memory on every rank, no
    cache written."""
    blend, _ = _blend(paths, key)
    prefixes = _checked_made_with([(key, blend)], tokenizer, cfg)
    # "", not None: megatron's None falls back to a cache folder beside the shards
    return _build_valid_set(cfg, "", tokenizer, blend, samples, _file_stamps(prefixes))


def build_datasets(cfg: RunConfig, cache_dir: str, train_samples: int,
                   valid_samples: int) -> Datasets:
    """Builds the datasets on every rank (rank 0 first: it writes the index caches).

    ``train_samples``/``valid_samples``: sequences that will be drawn, so that
    megatron builds enough epochs of indices (``valid_samples`` of each validation set).
    """
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import MockGPTDataset

    from .tokenizer import load_tokenizer

    d = cfg.data
    if d.type in TASK_TYPES:
        from .induction import synthetic_datasets

        train, valid = synthetic_datasets(cfg, train_samples, valid_samples)
        return Datasets(train=train, valid=valid, test=None, tokenizer=None)
    blend, sizes = _blend(d.paths) if d.type == "gpt" else (None, {})
    held_out, held_out_sizes = _blend(d.valid_paths, "data.valid_paths") if d.valid_paths \
        else (None, {})
    _check_apart(blend, held_out)
    named = _named_sets(cfg, blend) if valid_samples else {}
    # the toy tasks above index nothing
    checked = {**sizes, **held_out_sizes,
               **{p: n for _, set_sizes in named.values() for p, n in set_sizes.items()}}
    check_index_memory(cfg, drawn_parts(d, blend, held_out, named, train_samples,
                                        valid_samples), checked)
    tokenizer = load_tokenizer(d, cfg.model)
    prefixes = _checked_made_with([("data.paths", blend), ("data.valid_paths", held_out)]
                                  + [(f"data.valid_sets.{name}", b)
                                     for name, (b, _) in named.items()], tokenizer, cfg)
    Path(cache_dir).mkdir(parents=True, exist_ok=True)
    # a held-out validation set: each part from its own blend (Megatron-LM's
    # --train-data-path / --valid-data-path), the training from all of data.paths
    ds_config = _dataset_config(
        cfg, cache_dir, tokenizer, blend=None if held_out else blend,
        blend_per_split=[blend, held_out if valid_samples else None, None] if held_out else None,
        split=None if held_out else d.split)
    stamps = _file_stamps(prefixes) if prefixes else {}  # collective
    main = set(blend[0] if blend else []) | set(held_out[0] if held_out else [])
    ds_config.shard_files = {p: v for p, v in stamps.items() if p in main} or None
    needed = (True, valid_samples > 0, False)
    if blend is not None and held_out is None:  # (held out: each part all of its shards)
        counts = {prefix: n for prefix, (n, _) in sizes.items()}
        ds_config.split_matrix = plan_split(ds_config.split_matrix, counts, needed, d.split)
    elif blend is None:
        # Mock data: megatron sets split "1,1,1"; build only what is drawn from.
        ds_config.split_matrix = [m if needed[i] else None
                                  for i, m in enumerate(ds_config.split_matrix)]
    part_sizes = [train_samples, valid_samples if needed[1] else None, None]
    if any(b is not None and b[1] is not None for b in (blend, held_out)):
        # a weighted blend: megatron's builder takes a size for every part (it asserts
        # otherwise, and shares each part's size out by weight): 0 for a part not built
        part_sizes = [0 if n is None else n for n in part_sizes]
    cls = _stamped_gpt_dataset() if d.type == "gpt" else MockGPTDataset
    with built_whole(cache_dir, _writes_caches()):
        train, valid, test = BlendedMegatronDatasetBuilder(
            cls, part_sizes, lambda: True, ds_config
        ).build()
    if train is None or len(train) < train_samples:
        raise ConfigError(
            f"the training data gives {0 if train is None else len(train)} sequences of "
            f"{cfg.train.seq_length} tokens, fewer than the {train_samples} the run needs"
        )
    valid_sets = {name: _build_valid_set(cfg, cache_dir, tokenizer, b, valid_samples, stamps)
                  for name, (b, _) in named.items()}
    return Datasets(train=train, valid=valid, test=test, tokenizer=tokenizer,
                    valid_sets=valid_sets,
                    warnings=validation_read_over(cfg, valid_samples, checked))
