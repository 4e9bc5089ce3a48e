#!/usr/bin/env bash
# Sets up (scripts/setup.sh) and runs the whole test suite: lint, unit tests, then real loopback swarms.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check swarm peers configs scripts tests
.venv/bin/python -m pytest -q -x tests "$@"
