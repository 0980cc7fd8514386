"""A checkpoint's loss and perplexity on shards, after training (``kvtrain perplexity``).

The shards are read as a named validation set of the checkpoint's run reads them
(``data.valid_sets``, ``kvtrain.data.build_scored_set``): their first N sequences
in the run's data order, documents separated and end-of-document tokens masked as
the run did, scored by the trainer's own ``Validator`` (megatron's forward-only
schedule, the loss summed over the scored tokens of all micro batches). So with
the run's sequence length, batch and count, the number is the one a ``valid_sets``
entry of the same shards records at that checkpoint; another ``--seq-length`` asks
how the model does on longer (or shorter) contexts than it was trained on, and
``by_position`` the loss at each position in the context (``positions``).

The model is the checkpoint's on this process's tensor-parallel layout
(``load_model``): one process, or every rank of ``torchrun`` a TP rank.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from kvtrain.config import ConfigError, RunConfig
from kvtrain.config.checks import SET_NAME  # data.valid_sets' rule: a file name's part

from .loading import LoadedModel


@dataclass
class Scoring:
    """What to score: ``paths`` (the forms of data.paths) under the name ``name``;
    None takes the run's own: sequences = train.eval_iters x train.global_batch_size,
    batch = train.micro_batch_size, seq_length = train.seq_length, the tokenizer
    data.tokenizer."""

    paths: list
    name: str
    sequences: Optional[int] = None
    batch_size: Optional[int] = None
    seq_length: Optional[int] = None
    tokenizer: Optional[str] = None
    by_position: bool = False  # also the loss at each position in the context

    def check(self) -> "Scoring":
        """Refuses what cannot be scored before anything is loaded (one line each)."""
        if not self.paths:
            raise ConfigError("--data: name at least one shard (the forms of data.paths)")
        if not SET_NAME.fullmatch(self.name):
            raise ConfigError(f"--name {self.name!r}: letters, digits, '_', '-' and '.', "
                              f"starting with a letter or digit")
        for flag, value in (("--sequences", self.sequences), ("--batch-size", self.batch_size),
                            ("--seq-length", self.seq_length)):
            if value is not None and value < 1:
                raise ConfigError(f"{flag} {value}: must be at least 1")
        return self

    def resolved(self, cfg: RunConfig) -> "Scoring":
        """The run's values where none were given."""
        t = cfg.train
        batch = self.batch_size or t.micro_batch_size
        sequences = self.sequences or max(t.eval_iters * t.global_batch_size, batch)
        if sequences % batch:
            given = "" if self.sequences else (
                f" (the default: the run's train.eval_iters {t.eval_iters} x "
                f"train.global_batch_size {t.global_batch_size})")
            raise ConfigError(f"--sequences {sequences}{given} is not a multiple of --batch-size "
                              f"{batch}: every batch is whole (give --sequences)")
        return dataclasses.replace(self, sequences=sequences, batch_size=batch,
                                   seq_length=self.seq_length or t.seq_length,
                                   tokenizer=self.tokenizer or cfg.data.tokenizer)


def default_name(paths: list) -> str:
    """The first shard's file name without megatron's ``_text_document`` suffix."""
    first = next((str(p) for p in paths if isinstance(p, str)), "shards")
    stem = Path(first).name.removesuffix(".idx").removesuffix(".bin")
    stem = stem.removesuffix("_text_document") or "shards"
    return re.sub(r"[^A-Za-z0-9_.-]", "_", stem).lstrip("_.-") or "shards"


def _scoring_config(cfg: RunConfig, s: Scoring) -> RunConfig:
    """The run's config with the scoring's sequence length and tokenizer, reading shards
    (``data.type`` gpt: a run trained on mock or toy data ignored ``--tokenizer``)."""
    train = dataclasses.replace(cfg.train, seq_length=s.seq_length)
    data = dataclasses.replace(cfg.data, type="gpt", tokenizer=s.tokenizer)
    return dataclasses.replace(cfg, train=train, data=data)


def _within_one_pass(s: Scoring, held: int, asked: bool) -> Scoring:
    """At most the ``held`` sequences one pass over the shards gives: past them
    megatron reads the shards again, and a 14-token shard was scored as 3,200
    tokens. The run's count (none asked) is lowered to them, with a line."""
    if s.sequences <= held:
        return s
    fit = held - held % s.batch_size
    what = f"--data holds {held} sequences of {s.seq_length} tokens (one pass over its shards)"
    if fit == 0:
        raise ConfigError(f"{what}: fewer than one batch of {s.batch_size}; lower --batch-size "
                          "or --seq-length")
    if asked:
        raise ConfigError(f"--sequences {s.sequences}: {what}; more would score its tokens "
                          f"again: ask for at most {fit} (a multiple of --batch-size "
                          f"{s.batch_size})")
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"kvtrain perplexity: {what}: scoring {fit} of them, not the run's {s.sequences} "
              "(train.eval_iters x train.global_batch_size)", flush=True)
    return dataclasses.replace(s, sequences=fit)


def score(loaded: LoadedModel, scoring: Scoring) -> dict:
    """``{"loss", "ppl", "tokens", "sequences", "batch_size", "seq_length"}`` of the
    loaded model on the scoring's shards, and ``"by_position"`` when asked (the same
    on every rank; collective)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from kvtrain.analysis.positions import icl_score
    from kvtrain.data import build_scored_set, load_tokenizer, sequences_held
    from kvtrain.model.documents import Documents
    from kvtrain.train.evaluation import Validator
    from kvtrain.train.step import global_mean_loss

    from .positions import PositionForwardStep, reduce_by_position

    s = scoring.resolved(loaded.config)
    cfg = _scoring_config(loaded.config, s)
    if s.seq_length > cfg.model.max_position_embeddings:
        raise ConfigError(f"--seq-length {s.seq_length} is longer than the model's "
                          f"model.max_position_embeddings ({cfg.model.max_position_embeddings})")
    key = "--tokenizer" if scoring.tokenizer else "the run's data.tokenizer (or --tokenizer)"
    tokenizer = load_tokenizer(cfg.data, cfg.model, key=key)
    s = _within_one_pass(s, sequences_held(s.paths, "--data", s.seq_length),
                         asked=scoring.sequences is not None)
    dataset = build_scored_set(cfg, s.paths, "--data", s.sequences, tokenizer)
    separated = cfg.data.reset_attention_mask
    documents = Documents(eod=int(tokenizer.eod), thd=loaded.backend == "te") \
        if separated else None
    validator = Validator(dataset, get_forward_backward_func(), [loaded.model],
                          eval_iters=s.sequences // s.batch_size,
                          global_batch_size=s.batch_size, micro_batch_size=s.batch_size,
                          num_microbatches=1, seq_length=s.seq_length,
                          vocab_size=cfg.model.vocab_size, documents=documents,
                          source="--data", name=s.name)
    if s.by_position:
        validator.forward_step = PositionForwardStep(
            validator.forward_step, s.seq_length, int(tokenizer.eod) if separated else None)
    losses = validator.forward()  # collective
    loss, tokens = global_mean_loss(losses, validator.forward_step)
    loaded.model.eval()  # the validator leaves its model in training mode
    result = {"loss": loss, "ppl": math.exp(min(loss, 80.0)), "tokens": tokens,
              "sequences": s.sequences, "batch_size": s.batch_size, "seq_length": s.seq_length}
    if s.by_position:
        means, counts = reduce_by_position(losses, s.seq_length)  # collective
        result["by_position"] = {"context": "document" if separated else "sequence",
                                 "loss": means, "tokens": counts, "icl_score": icl_score(means)}
    return result


def fmt(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.4f}"


def task_name(name: str, seq_length: int, trained: int) -> str:
    """``perplexity/NAME`` (``@L`` at another sequence length than the run's): its row
    in ``kvtrain compare``'s evaluation table."""
    return f"perplexity/{name}" + (f"@{seq_length}" if seq_length != trained else "")


def result_record(loaded: LoadedModel, scoring: Scoring, result: dict, dtype: str) -> dict:
    """The record ``kvtrain compare`` reads as an evaluation (``eval/*.json``): the task's
    metrics, the checkpoint's iteration, the sequences as the limit and the dtype."""
    task = task_name(scoring.name, result["seq_length"], loaded.config.train.seq_length)
    return {"kind": "perplexity", "checkpoint": str(loaded.checkpoint),
            "iteration": loaded.iteration, "attention": loaded.config.model.attention,
            "backend": loaded.backend, "data": list(scoring.paths),
            "tasks": {task: {"loss": result["loss"], "ppl": result["ppl"],
                             "tokens": result["tokens"],
                             **({"icl_score": result["by_position"]["icl_score"]}
                                if result.get("by_position") else {})}},
            "config": {"limit": result["sequences"], "num_fewshot": None, "dtype": dtype,
                       "batch_size": result["batch_size"], "seq_length": result["seq_length"]},
            **({"by_position": result["by_position"]} if result.get("by_position") else {})}


def record_file(name: str, iteration: int, result: dict, trained: int, dtype: str) -> str:
    """``perplexity-NAME-iter_0000100-nN[-seqL][-bf16].json``: scorings that differ in
    sequences, length or dtype keep apart."""
    parts = [f"perplexity-{name}", f"iter_{iteration:07d}", f"n{result['sequences']}"]
    if result["seq_length"] != trained:
        parts.append(f"seq{result['seq_length']}")
    if dtype != "fp32":
        parts.append(dtype)
    return "-".join(parts) + ".json"


__all__ = ["Scoring", "default_name", "fmt", "record_file", "result_record", "score", "task_name"]
