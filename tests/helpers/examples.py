"""How many hypothesis examples a fuzz test draws: fewer in the fast subset (``pytest -m "not slow"``), which
``tests/conftest.py`` notes in ``FAST_SUBSET`` when the session is configured."""

from __future__ import annotations

import os

FAST_SUBSET: list[bool] = []  # whether this session deselects the slow tests (`-m "not slow"`)


def fuzz_examples(full: int) -> int:
    """Hypothesis examples for a fuzz test: ``full`` in the full suite, a fifth of it in the fast subset (the same
    seeded, derandomized generators: fewer cases, never other ones), or ``SWARM_FUZZ_EXAMPLES`` where set. Read when
    a test module is imported, after ``pytest_configure``."""
    if os.environ.get("SWARM_FUZZ_EXAMPLES"):
        return int(os.environ["SWARM_FUZZ_EXAMPLES"])
    return max(10, full // 5) if any(FAST_SUBSET) else full
