"""The remote-code pair copied into a KV-shift export (``trust_remote_code``).

These two files are self-contained: they import torch and public transformers
APIs only, never kvtrain, because they run wherever the export is loaded.
"""
