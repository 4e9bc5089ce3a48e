#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, type check, unit tests, then real loopback swarms.
# Arguments go to pytest: `bash scripts/test.sh -m "not slow"` is the fast subset.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check swarm peers harness configs scripts tests
.venv/bin/ruff format --check swarm peers harness configs scripts tests
.venv/bin/mypy  # strict, on swarm/, peers/ and harness/ (pyproject.toml)
# the suite must stay under 30 minutes: the tests on two workers (pytest-xdist, a whole file per worker so a module's
# swarm starts once; a swarm test waits on its peers about half its time, so two share the 2 cores), then those
# marked ``alone`` by themselves; the slowest printed
SWARM_TEST_PHASE=shared .venv/bin/python -m pytest -q -x -n 2 --dist loadfile --durations=25 tests "$@"
SWARM_TEST_PHASE=alone .venv/bin/python -m pytest -q -x --durations=5 tests "$@" || [ $? -eq 5 ]  # 5: none selected
