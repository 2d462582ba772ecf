#!/usr/bin/env bash
# The GPU check (issue 40), on a machine with one NVIDIA GPU and no network: installs the wheels
# benchmarks/gpu/fetch_wheels.sh carried in benchmarks/gpu/.carry (never torch: the machine's own
# torch, Triton and transformers run), then runs benchmarks/gpu/check.py, which writes check.json,
# check.log and check.png into OUT_DIR (default: $OUT, else ./gpu-check-out). At most 8 minutes on one H100.
#
#   bash benchmarks/gpu/check.sh [OUT_DIR] [--dry-run] [--steps env kernels ...]
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR=${OUT:-gpu-check-out}
if [ $# -gt 0 ] && [[ "$1" != --* ]]; then OUT_DIR=$1; shift; fi
PYTHON=${PYTHON:-python3}
WHEELS=benchmarks/gpu/.carry/wheels
if [[ " $* " != *" --dry-run "* ]] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=${TMPDIR:-/tmp}/prefixserve-gpu-site
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    "$WHEELS"/*.whl || { echo "installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PYTHON" benchmarks/gpu/check.py --out "$OUT_DIR" "$@"
