"""A file of ``scripts/`` loaded as a module, for the tests of the benchmarks and of the scripts' helpers."""

from __future__ import annotations

import importlib.util
import types
from pathlib import Path


def load_script(name: str) -> types.ModuleType:
    """``scripts/<name>.py`` as a module (the benchmarks import only the standard library at import time)."""
    path = Path(__file__).resolve().parents[2] / "scripts" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
