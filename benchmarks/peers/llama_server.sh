#!/usr/bin/env bash
# llama.cpp's llama-server, built here from the source the llama-cpp-python sdist on PyPI
# ships (vendor/llama.cpp), for benchmarks/gguf_decode.py. No downloaded binary: cmake
# builds it for this CPU (GGML_NATIVE), CPU backend only.
#   benchmarks/peers/llama_server.sh            # -> benchmarks/peers/llama.cpp/bin/llama-server
#   LLAMA_CPP_SRC=<unpacked sdist>/vendor/llama.cpp benchmarks/peers/llama_server.sh
set -euo pipefail
cd "$(dirname "$0")"
VERSION=0.3.36  # llama-cpp-python
OUT=llama.cpp
[ -x "$OUT/bin/llama-server" ] && { echo "$OUT/bin/llama-server"; exit 0; }
mkdir -p "$OUT"
SRC=${LLAMA_CPP_SRC:-}
if [ -z "$SRC" ]; then
  python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$OUT/sdist"
  tar -xzf "$OUT"/sdist/llama_cpp_python-"$VERSION".tar.gz -C "$OUT/sdist"
  SRC="$OUT/sdist/llama_cpp_python-$VERSION/vendor/llama.cpp"
fi
cmake -S "$SRC" -B "$OUT/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
  -DBUILD_SHARED_LIBS=OFF > "$OUT/build.log" 2>&1
cmake --build "$OUT/build" --target llama-server -j "$(nproc)" >> "$OUT/build.log" 2>&1
mkdir -p "$OUT/bin" && cp "$OUT/build/bin/llama-server" "$OUT/bin/"
echo "$OUT/bin/llama-server"
