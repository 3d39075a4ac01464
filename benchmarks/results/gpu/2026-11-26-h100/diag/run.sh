#!/usr/bin/env bash
# GPU diagnosis of the layers-compile failure, then figures with the first variant that works.
cd "$(dirname "$0")/.."
R=/tmp/d; mkdir -p $R; export PYTHONPATH="$PWD/.diag:$PWD" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export TORCHINDUCTOR_CACHE_DIR=/tmp/d/ind
T0=$(date +%s)
for v in base nosplit noloss static; do
  DIAG_VARIANT=$v timeout -k 5 120 python3 benchmarks/train_step.py --layers 1 --seqlens 2048 --partitions 1 \
    --attention flex --compile layers --warmup 1 --iters 2 --out $R/p1_$v.jsonl > $R/p1_$v.log 2>&1 &
done
timeout -k 5 120 python3 benchmarks/train_step.py --layers 1 --seqlens 2048 --partitions 1 \
  --attention flex --compile flex --warmup 1 --iters 2 --out $R/p1_flexonly.jsonl > $R/p1_flexonly.log 2>&1 &
wait
echo "phase1 done at $(( $(date +%s) - T0 ))s"
CHOSEN=""
for v in base nosplit noloss flexonly; do
  s=$(grep -o '"status": "[a-z]*"' $R/p1_$v.jsonl 2>/dev/null | tail -1)
  echo "$v: $s $(grep -o '"median_ms": [0-9.]*' $R/p1_$v.jsonl)"
  [ -z "$CHOSEN" ] && [ "$s" = '"status": "ok"' ] && CHOSEN=$v
done
echo "static: $(grep -o '"status": "[a-z]*"' $R/p1_static.jsonl | tail -1)"
echo "CHOSEN=$CHOSEN"
C=layers; [ "$CHOSEN" = flexonly ] && C=flex
export DIAG_VARIANT=$CHOSEN
timeout -k 5 100 python3 benchmarks/train_step.py --layers 1 4 --seqlens 8192 --partitions 1 --attention flex \
  --compile $C --warmup 2 --iters 5 --deadline 55 --out $R/p2_train_step.jsonl > $R/p2_train_step.log 2>&1
echo "phase2 train_step done at $(( $(date +%s) - T0 ))s"
left=$(( 255 - ($(date +%s) - T0) ))
[ $left -gt 60 ] && TORCHINDUCTOR_CACHE_DIR=/tmp/d/cold timeout -k 5 $(( left > 70 ? 70 : left )) python3 benchmarks/train_run.py --steps 20 \
  --work /tmp/d/train_run --out $R/p2_train_run.json > $R/p2_train_run.log 2>&1
echo "end at $(( $(date +%s) - T0 ))s"
for f in $R/p*.jsonl $R/p2_train_run.json; do echo "== $f"; cut -c1-700 $f; done
for v in base nosplit noloss static; do echo "== tb $v"; grep -A3 -B30 "^RuntimeError\|Error:" $R/p1_$v.log | grep -v "^E1126" | tail -45; done
tar czf $OUT/diag.tgz -C $R --exclude ind --exclude cold --exclude train_run .
