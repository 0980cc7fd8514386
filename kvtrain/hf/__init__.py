"""Hugging Face export and import (the ``hf`` extra: transformers, safetensors).

``export.export_hf`` writes a checkpoint as a HF folder, ``importer.import_hf``
reads one back as a kvtrain checkpoint. This module imports neither torch nor
transformers: the CLI checks the extra here first.
"""

from __future__ import annotations

import importlib.util
import os
import sys

from kvtrain.config import ConfigError

HF_EXTRA = "pip install 'kvtrain[hf]'"


def require_hf(what: str = "kvtrain export") -> None:
    """One line naming the extra when transformers/safetensors are not installed."""
    missing = [m for m in ("transformers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"{what} needs {' and '.join(missing)}: {HF_EXTRA}")


# every Hugging Face library's switch: nothing from the hub, ever (all paths are local)
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_EVALUATE_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}


def offline() -> None:
    """Sets the Hugging Face offline switches for this process. The libraries
    read them at import, so modules already imported are switched too."""
    os.environ.update(OFFLINE_ENV)
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None:
        datasets_config.HF_HUB_OFFLINE = True
        datasets_config.HF_DATASETS_OFFLINE = True


__all__ = ["HF_EXTRA", "OFFLINE_ENV", "offline", "require_hf"]
