#!/usr/bin/env bash
# Prepare what benchmarks/gpu_suite.sh needs on a GPU machine without network (run where there is one):
#   bash scripts/download_gpu_wheels.sh ANCHOR_DIR
# 1. downloads the wheels listed in ANCHOR_DIR/wheels.txt (vLLM speculators 0.9.0 and what it imports
#    that the GPU image lacks) and PEAGLE_WHEELS (torchao, for `peagle train --fp8-matmuls`), for
#    CPython 3.12 manylinux x86_64, into .whl/ (about 10.5 MiB; checked under 64 MiB, what a device run
#    can carry); peagle needs nothing else the image lacks (torch, transformers, tokenizers,
#    safetensors, pyarrow, numpy, typer, pyyaml, tqdm, matplotlib, pytest, hypothesis, pytest-xdist
#    are preinstalled there);
# 2. downloads FlashAttention-4 (flex's FLASH backend: flash-attn-4 and the CuTe DSL it runs on) into
#    .whl-fa4/: its CUDA 13 library wheel (92 MB) is over what one call carries, so it travels in two
#    sha256-checked parts (scripts/payload.py): .whl-fa4/call1/ (the first part) with the suite's call 1,
#    .whl-fa4/call2/ (the second part and the small wheels) with call 2, which joins and installs them
#    (gpu_suite.sh --fa4 DIR); PEAGLE_FA4=0 skips this;
# 3. copies the reference harness (bench.py, run_all.sh, ...) to .anchor/speculators_gpu/.
# The folders are git-ignored; ship them with the runs (the device tool's `carry`: call 1 [".whl", ".anchor",
# ".whl-fa4/call1"], call 2 [".anchor", ".whl-fa4/call2"]), then on the GPU machine:
#   bash benchmarks/gpu_suite.sh --speculators-anchor .anchor/speculators_gpu --call 1 --fa4 .whl-fa4/call1
#   bash benchmarks/gpu_suite.sh --speculators-anchor .anchor/speculators_gpu --call 2 --fa4 .whl-fa4/call2
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
if [ "${PEAGLE_FA4:-1}" = "1" ]; then
  FA4_WHEELS=("flash-attn-4==4.0.0b36" "nvidia-cutlass-dsl==4.8.1" "nvidia-cutlass-dsl-libs-base==4.8.1"
              "nvidia-cutlass-dsl-libs-core==4.8.1" "nvidia-cutlass-dsl-libs-cu13==4.8.1" "apache-tvm-ffi==0.1.15.post2"
              "torch-c-dlpack-ext==0.1.5" "quack-kernels==0.6.5")  # the image has torch 2.11+cu130, einops, cuda-bindings
  BIG="nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"
  rm -rf .whl-fa4 && mkdir -p .whl-fa4/all .whl-fa4/call1 .whl-fa4/call2
  "$PY" -m pip download --no-deps --only-binary=:all: --pre --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl-fa4/all "${FA4_WHEELS[@]}"
  [ -f ".whl-fa4/all/$BIG" ] || { echo "missing: .whl-fa4/all/$BIG" >&2; exit 2; }
  "$PY" scripts/payload.py split ".whl-fa4/all/$BIG" --out .whl-fa4/parts --part-mib 46
  cp .whl-fa4/parts/"$BIG".part-000 .whl-fa4/parts/"$BIG".sha256.json .whl-fa4/call1/
  cp .whl-fa4/parts/"$BIG".part-001 .whl-fa4/parts/"$BIG".sha256.json .whl-fa4/call2/
  find .whl-fa4/all -name '*.whl' ! -name "$BIG" -exec cp {} .whl-fa4/call2/ \;
  for call in call1 call2; do
    carried=$(( ($(du -sb .whl-fa4/$call | cut -f1) + $([ "$call" = call1 ] && du -sb .whl | cut -f1 || echo 0)
                 + $(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) + 1048575) / 1048576 ))
    echo "FlashAttention-4 for $call: $(ls .whl-fa4/$call | wc -l) files; the call carries ~$carried MiB with the repository"
    [ "$carried" -le "$MAX_MIB" ] || { echo "error: $call would carry $carried MiB, over $MAX_MIB" >&2; missing=1; }
  done
fi
rm -rf .anchor/speculators_gpu && mkdir -p .anchor && cp -r "$ANCHOR" .anchor/speculators_gpu
echo "wheels in .whl/ ($(ls .whl | wc -l) files, $mib MiB), reference harness in .anchor/speculators_gpu"
exit "$missing"
