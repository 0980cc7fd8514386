"""Data for the trainer: megatron GPT/mock datasets, resumable micro-batch
iterators, the tokenizer object, and a synthetic structured corpus."""

from .datasets import (Datasets, build_datasets, build_scored_set, parse_blend,
                       sequences_held, validation_read_over)
from .loader import PretrainingBatchSampler, fixed_batches, micro_batches
from .synthetic import synthetic_documents, write_shard, write_synthetic_corpus
from .tokenizer import VocabOnlyTokenizer, load_tokenizer

__all__ = [
    "Datasets",
    "PretrainingBatchSampler",
    "VocabOnlyTokenizer",
    "build_datasets",
    "build_scored_set",
    "fixed_batches",
    "load_tokenizer",
    "micro_batches",
    "parse_blend",
    "sequences_held",
    "synthetic_documents",
    "validation_read_over",
    "write_shard",
    "write_synthetic_corpus",
]
