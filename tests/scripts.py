"""Scripts of the repository (``benchmarks/``: no package) loaded as modules by tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path


def load_script(path: Path, name: str):
    """The script at ``path`` as the module ``name`` (registered in ``sys.modules``:
    dataclasses look their module up there)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
