#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, type check, unit tests, then real loopback swarms.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check swarm peers harness configs scripts tests
.venv/bin/ruff format --check swarm peers harness configs scripts tests
.venv/bin/mypy  # strict, on swarm/, peers/ and harness/ (pyproject.toml)
.venv/bin/python -m pytest -q -x --durations=25 tests "$@"  # the slowest 25 printed: the suite must stay under 30 minutes
