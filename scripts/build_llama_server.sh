#!/usr/bin/env bash
# Builds llama.cpp's llama-server once from the sources PyPI ships inside the llama-cpp-python sdist,
# and caches the binary; a second run on the same machine finds it and returns at once.
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
BUILD_TAG="noamx"  # part of the cache path: a change of build flags builds again (drafter_data/server/local.py)
CACHE="${DRAFTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/drafter-data}"
BIN="$CACHE/llama-server-$LLAMA_CPP_PYTHON_VERSION-$BUILD_TAG/llama-server"

if [ -x "$BIN" ] && "$BIN" --version >/dev/null 2>&1; then
  echo "llama-server: cached at $BIN"
  exit 0
fi

for tool in cmake c++ cc; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: building llama-server needs '$tool', which is not installed." >&2
    echo "       On Debian/Ubuntu: apt-get install -y cmake build-essential" >&2
    exit 1
  fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "llama-server: not cached; building from llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sources (about 4 min on 2 cores)"
python3 -m pip download -q --no-deps --no-binary=:all: -d "$work/dl" "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
tar xzf "$work"/dl/llama_cpp_python-*.tar.gz -C "$work" "llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
src="$work/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
# LLAMA_USE_PREBUILT_UI=OFF: with it on, the build fetches UI assets from a hub, which fails offline.
# -mno-amx-*: on CPUs with AMX (Intel Sapphire Rapids and later) -march=native builds ggml's AMX kernels, which
# crash (SIGSEGV in ggml_backend_amx_mul_mat at the first decode) where the kernel does not grant AMX state to the
# process, as in the virtual machines seen here; AVX-512 is kept.
NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF \
  -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log" 2>&1 || { tail -30 "$work/cmake.log" >&2; exit 1; }
cmake --build "$work/build" --target llama-server -j"$(nproc)" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
mkdir -p "$(dirname "$BIN")"
cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "llama-server: built $BIN"
