"""Hugging Face export and import (the ``hf`` extra: transformers, safetensors).

``export.export_hf`` writes a checkpoint as a HF folder, ``importer.import_hf``
reads one back as a kvtrain checkpoint. This module imports neither torch nor
transformers: the CLI checks the extra here first.
"""

from __future__ import annotations

import importlib.util
import os

from kvtrain.config import ConfigError

HF_EXTRA = "pip install 'kvtrain[hf]'"


def require_hf(what: str = "kvtrain export") -> None:
    """One line naming the extra when transformers/safetensors are not installed."""
    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{what} needs {' and '.join(missing)}: {HF_EXTRA}")


def offline() -> None:
    """Nothing from the Hugging Face hub, ever (every path here is local)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


__all__ = ["HF_EXTRA", "offline", "require_hf"]
