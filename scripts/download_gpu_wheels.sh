#!/usr/bin/env bash
# Prepare what benchmarks/gpu_suite.sh needs on a GPU machine without network (run where there is one):
#   bash scripts/download_gpu_wheels.sh ANCHOR_DIR
# 1. downloads the wheels listed in ANCHOR_DIR/wheels.txt (vLLM speculators 0.9.0 and what it imports
#    that the GPU image lacks) and PEAGLE_WHEELS (torchao, for `peagle train --fp8-matmuls`), for
#    CPython 3.12 manylinux x86_64, into .whl/ (about 10.5 MiB; checked under 64 MiB, what a device run
#    can carry); peagle needs nothing else the image lacks (torch, transformers, tokenizers,
#    safetensors, pyarrow, numpy, typer, pyyaml, tqdm, matplotlib, pytest, hypothesis, pytest-xdist
#    are preinstalled there). FlashAttention-4 (flex's FLASH backend) is not fetched: it needs
#    nvidia-cutlass-dsl, a 92 MB wheel, more than can travel;
# 2. copies the reference harness (bench.py, run_all.sh, ...) to .anchor/speculators_gpu/.
# Both folders are git-ignored; ship them with the run (the device tool's `carry`: [".whl", ".anchor"]),
# then on the GPU machine:  bash benchmarks/gpu_suite.sh --speculators-anchor .anchor/speculators_gpu
set -euo pipefail
cd "$(dirname "$0")/.."
ANCHOR=${1:?usage: bash scripts/download_gpu_wheels.sh ANCHOR_DIR (the folder with bench.py and wheels.txt)}
[ -f "$ANCHOR/wheels.txt" ] && [ -f "$ANCHOR/bench.py" ] || { echo "error: $ANCHOR has no wheels.txt and bench.py" >&2; exit 2; }
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
PEAGLE_WHEELS=("torchao==0.18.0")  # abi3: one wheel for every CPython >= 3.10
MAX_MIB=64
specs=("${PEAGLE_WHEELS[@]}")
while read -r wheel; do
  [ -z "$wheel" ] && continue
  name=${wheel%%-*}; rest=${wheel#*-}; version=${rest%%-*}
  specs+=("$name==$version")
done < "$ANCHOR/wheels.txt"
mkdir -p .whl
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${specs[@]}"
missing=0
while read -r wheel; do
  [ -z "$wheel" ] || [ -f ".whl/$wheel" ] || { echo "missing: .whl/$wheel" >&2; missing=1; }
done < "$ANCHOR/wheels.txt"
for spec in "${PEAGLE_WHEELS[@]}"; do
  name=${spec%%==*}; version=${spec#*==}
  ls .whl/"${name//-/_}-$version"-*.whl >/dev/null 2>&1 || { echo "missing: $spec" >&2; missing=1; }
done
mib=$(( ($(du -sb .whl | cut -f1) + 1048575) / 1048576 ))
if [ "$mib" -gt "$MAX_MIB" ]; then
  echo "error: .whl/ holds $mib MiB, more than the $MAX_MIB MiB a device run can carry" >&2; missing=1
fi
rm -rf .anchor/speculators_gpu && mkdir -p .anchor && cp -r "$ANCHOR" .anchor/speculators_gpu
echo "wheels in .whl/ ($(ls .whl | wc -l) files, $mib MiB), reference harness in .anchor/speculators_gpu"
exit "$missing"
