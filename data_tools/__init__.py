"""Data tools for kvtrain: sentencepiece tokenizer training and corpus ->
Megatron IndexedDataset (``.bin``/``.idx``) preprocessing.

Standalone: nothing here imports ``kvtrain``, torch or megatron, so the tools
run (and ``kvtrain data --help`` answers) without loading the trainer.
The trainer uses ``data_tools.tokenizer.SentencePieceTokenizer``.
"""
