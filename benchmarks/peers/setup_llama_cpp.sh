#!/usr/bin/env bash
# Set up llama.cpp (through llama-cpp-python's OpenAI-compatible server) as the peer of
# benchmarks/single_stream.py (`--peer llamacpp`).
#
# llama-cpp-python lives in its own venv (.venv-llamacpp, git-ignored) so that its server
# dependencies (fastapi, pydantic-settings, sse-starlette, ...) never touch sloserve's .venv.
# It reads the embedded GGUF as-is, so unlike the vLLM peer no model export is needed.
#
# The package index here has no prebuilt wheel, so pip compiles the bundled llama.cpp from the
# sdist: about 10-20 minutes on 2 cores. The build runs under `nice -n 19` so that it does not
# disturb whatever else is being timed on the machine.
#
# Safe to re-run: the build is skipped when the server already imports from the venv.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
VENV=${LLAMACPP_VENV:-.venv-llamacpp}
LLAMA_CPP_VERSION=${LLAMA_CPP_VERSION:-}   # empty: the newest release on the index
LPY="$VENV/bin/python"

if [ ! -x "$LPY" ]; then
    echo "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi

if ! "$LPY" -c 'import llama_cpp, llama_cpp.server.app' >/dev/null 2>&1; then
    "$LPY" -m pip install -q --upgrade pip
    # A CPU build tuned for this machine, which is what a user of llama.cpp on this box would run:
    #  - GGML_NATIVE=ON: -march=native, so the AVX2/AVX-512/VNNI kernels this CPU has get used.
    #  - GGML_OPENMP=ON: ggml's thread pool on OpenMP (the upstream default, stated so a changed
    #    default cannot silently change the peer). No BLAS: for single-stream decode (matrix x
    #    vector) ggml's own kernels are what runs anyway.
    #  - LLAVA_BUILD=OFF: llama-cpp-python's switch for the multimodal (mtmd) library. The
    #    benchmark model is text-only and llama_cpp imports that library lazily, so skipping it
    #    only saves build time on 2 cores.
    # These are llama.cpp's current GGML_* option names (the old LLAMA_* ones are gone); the
    # sdist's CMakeLists passes CMAKE_ARGS through to the vendored llama.cpp.
    export CMAKE_ARGS="${CMAKE_ARGS:--DGGML_NATIVE=ON -DGGML_OPENMP=ON -DLLAVA_BUILD=OFF}"
    export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
    spec="llama-cpp-python[server]"
    [ -n "$LLAMA_CPP_VERSION" ] && spec="llama-cpp-python[server]==$LLAMA_CPP_VERSION"
    echo "building $spec from source (CMAKE_ARGS=$CMAKE_ARGS, $CMAKE_BUILD_PARALLEL_LEVEL jobs); this takes a while"
    start=$SECONDS
    # --no-binary: always compile here, even if a generic wheel ever shows up on the index, so
    # the native flags above are what gets measured. --no-cache-dir: a wheel cached from an
    # earlier build with other flags must not be reused.
    nice -n 19 "$LPY" -m pip install --no-cache-dir --no-binary llama-cpp-python "$spec"
    echo "build and install took $((SECONDS - start)) s"
fi
"$LPY" -c 'import llama_cpp, llama_cpp.server.app; print(f"llama-cpp-python {llama_cpp.__version__}")'
echo "llama.cpp peer ready: $LPY -m llama_cpp.server"
