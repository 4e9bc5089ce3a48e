"""The environment of the harness's child processes: they run ``python -m harness...`` and ``python -m swarm...``
from this checkout, whatever the interpreter has installed and wherever the parent runs (the harness is not
installed: it ships with the source, not the wheel)."""

from __future__ import annotations

import os
from pathlib import Path


def source_root() -> str:
    """The checkout holding this ``harness`` package (and the ``swarm`` and ``peers`` beside it)."""
    return str(Path(__file__).resolve().parents[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root(), env.get("PYTHONPATH")) if p)
    env.update(extra or {})
    return env
