#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, type check, unit tests, then real loopback swarms.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check swarm peers harness configs scripts tests
.venv/bin/ruff format --check swarm peers harness configs scripts tests
# the type check (strict, on swarm/, peers/ and harness/: pyproject.toml; about a minute of one core) runs beside the
# tests, its verdict taken after them
MYPY_LOG=$(mktemp)
.venv/bin/mypy > "$MYPY_LOG" 2>&1 &
MYPY_PID=$!
typecheck() { if wait "$MYPY_PID"; then cat "$MYPY_LOG"; else cat "$MYPY_LOG"; echo "mypy failed"; exit 1; fi; }
# the suite must stay under 30 minutes: the tests on two workers (pytest-xdist, a whole file per worker so a module's
# swarm starts once; a swarm test waits on its peers about half its time, so two share the 2 cores; the longest
# files first, in tests/conftest.py's order, not xdist's most-tests-first), then those marked ``alone`` by
# themselves; the slowest printed
SWARM_TEST_PHASE=shared .venv/bin/python -m pytest -q -x -n 2 --dist loadfile --no-loadscope-reorder --durations=25 tests "$@" || { typecheck; exit 1; }
typecheck
SWARM_TEST_PHASE=alone .venv/bin/python -m pytest -q -x --durations=5 tests "$@" || [ $? -eq 5 ]  # 5: none selected
