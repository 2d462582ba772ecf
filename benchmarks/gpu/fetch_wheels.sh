#!/usr/bin/env bash
# Prepares what benchmarks/gpu/check.sh needs on the GPU machine, which has no network, in the
# git-ignored benchmarks/gpu/.carry (name it in the device run's carry):
#   wheels/             prefixserve's dependencies that the machine's image lacks (KINDS.md lists what it
#                       has: torch, triton, transformers, tokenizers, safetensors, numpy, xxhash, httpx,
#                       anyio, click, rich, pyyaml, h11, multidict, prometheus-client, pytest, ...), for
#                       CPython 3.12 manylinux x86_64; never torch;
#   smollm2-tokenizer/  SmolLM2's tokenizer files, from the default model's converted folder (`make install`);
# then checks that what travels (the working tree and .carry) stays under 64 MiB.
#
#   bash benchmarks/gpu/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")"
CARRY=.carry
DEST=$CARRY/wheels
# Versions as `make install` resolves them on the CPU side (pyproject.toml's ranges), pinned so the
# GPU run is the code CI tested.
WHEELS=(
  msgspec==0.22.0 llguidance==1.9.1              # engine: API structs, structured outputs
  litestar==2.25.0 litestar-htmx==0.5.0 multipart==2.0.1 polyfactory==3.5.0 faker==40.63.0
  rich-click==1.9.9 sniffio==1.3.1               # the server (litestar and what the image lacks of its needs)
  uvicorn==0.54.0
)
PURE=(openapi-ui-bundles==0.3.0)                  # /docs and /redoc files: published as an sdist only, built here
rm -rf "$CARRY"; mkdir -p "$DEST" "$CARRY/smollm2-tokenizer"
ROOT=$(git rev-parse --show-toplevel)
PY=${PYTHON:-$ROOT/.venv/bin/python}
MODEL=$("$PY" -c "from engine.models.resolve import resolve_model; print(resolve_model('smollm2-135m-instruct'))" 2>/dev/null | tail -1)
for f in tokenizer.json tokenizer_config.json chat_template.jinja special_tokens_map.json config.json; do
  [ -f "$MODEL/$f" ] && cp "$MODEL/$f" "$CARRY/smollm2-tokenizer/"
done
[ -f "$CARRY/smollm2-tokenizer/tokenizer.json" ] || { echo "no SmolLM2 tokenizer found (run make install)" >&2; exit 1; }
PLATFORMS=()
for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do PLATFORMS+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${PLATFORMS[@]}" -d "$DEST" "${WHEELS[@]}"
python3 -m pip wheel -q --no-deps -w "$DEST" "${PURE[@]}"
ls -la "$DEST" "$CARRY/smollm2-tokenizer"
# The budget: everything that travels (tracked + untracked-not-ignored files, plus what is carried).
tree=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
wheels=$(du -cb "$CARRY" | tail -1 | cut -f1)
total=$((tree + wheels))
echo "travels: tree $((tree / 1024)) KiB + .carry $((wheels / 1024)) KiB = $((total / 1048576)) MiB of 64"
if [ "$total" -gt $((64 * 1048576)) ]; then echo "over the 64 MiB budget" >&2; exit 1; fi
