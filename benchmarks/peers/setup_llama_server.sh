#!/usr/bin/env bash
# Build llama.cpp's own C++ server (`llama-server`) as the peer of sloserve on the same GGUF.
#
# The llama.cpp sources come vendored in the llama-cpp-python sdist on the package index; this
# downloads that sdist, builds only the `llama-server` target (Release, -march=native through
# GGML_NATIVE, no libcurl: models are local files) under `nice -n 19`, and leaves the binary at
# .peers/llama-server (git-ignored). About 10 minutes on 2 cores. Safe to re-run: skipped when the
# binary is there.
#
# Run it as llama.cpp's users do for serving: continuous batching is on by default; give it
# slots (`-np N`) and the context for them (`-c`), all cores (`-t`), e.g.
#   .peers/llama-server -m MODEL.gguf --host 127.0.0.1 --port 8090 -np 32 -c 32768 -t 2
# and send `ignore_eos`, `temperature: 0` and `max_tokens` (what `sloserve bench` sends by default).
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-.venv/bin/python}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PEERS=.peers
BIN=$PEERS/llama-server

if [ -x "$BIN" ]; then
    echo "$BIN is built"; exit 0
fi
mkdir -p "$PEERS/src"
if [ ! -d "$PEERS/src/llama_cpp_python-$VERSION" ]; then
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$PEERS/src"
    tar -xzf "$PEERS/src/llama_cpp_python-$VERSION.tar.gz" -C "$PEERS/src"
fi
SRC="$PEERS/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
nice -n 19 cmake -S "$SRC" -B "$PEERS/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
nice -n 19 cmake --build "$PEERS/build" --target llama-server -j "$(nproc)"
cp "$PEERS/build/bin/llama-server" "$BIN"
echo "built $BIN"
