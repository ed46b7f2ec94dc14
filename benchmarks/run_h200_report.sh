#!/usr/bin/env bash
# The three tables of benchmarks/RESULTS.md (memory, attention, serving) from one H200 session,
# in three device calls issued back to back (each stays well under the 10-minute limit per call):
#   bash benchmarks/run_h200_report.sh tables    # versions, memory table, writer probe, attention grid at H=16
#   bash benchmarks/run_h200_report.sh grid128   # the attention grid at H=128
#   bash benchmarks/run_h200_report.sh grid16    # the attention grid at H=16 alone
#   bash benchmarks/run_h200_report.sh serving   # three cache-pressure serving runs (median shown), CuPy GPU checks
# Carry .whl (FlashInfer wheels, see PERFORMANCE.md). Results land in $OUT; turn them into the
# RESULTS.md tables and plots here with
#   python -m benchmarks.report --memory memory.json --attention grid.json --serving serving.json
set -u
PART=${1:-tables}
OUT=${OUT:-/tmp/qm_out}
source benchmarks/h200_setup.sh
PY="python3 -P"
stage() { echo "=== $1 ($(date +%T))"; }
if [ "$PART" = tables ]; then
  stage versions; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  $PY -m quantmla_core.info > "$OUT/info.txt" 2>&1
  stage memory; timeout 120 $PY -m benchmarks.memory --out "$OUT/memory.json" 2>&1 | tail -4
  stage writer; timeout 90 $PY benchmarks/writer_probe.py --configs 1x1 --graphs --json "$OUT/writer_probe.json" 2>&1 | tail -14
fi
if [ "$PART" = tables ] || [ "$PART" = grid128 ] || [ "$PART" = grid16 ]; then
  H=$([ "$PART" = grid128 ] && echo 128 || echo 16)
  stage "attention grid H=$H"
  timeout 300 $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -m benchmark --benchmark-enable \
    --benchmark-json="$OUT/grid_h$H.json" benchmarks/test_attention_gpu.py -k "4096-$H or 32768-$H or 131072-$H" 2>&1 | tail -3
elif [ "$PART" = serving ]; then
  stage "serving, three whole runs"; timeout 330 $PY -m benchmarks.serving --requests 48 --prompt-len 4096 --output-len 1024 \
    --budget-gib 0.33 --repeats 3 --out "$OUT/serving.json" 2>&1 | tail -16
  stage "cupy GPU checks of this stop's changes"; timeout 200 $PY -m pytest -q -p no:cacheprovider tests/test_cupy_backend.py \
    tests/test_cupy_v3.py tests/test_cupy_v4.py tests/test_cupy_protected.py tests/test_plan.py \
    -k "attention_matches or v2_matches or v3_matches or v4 or match_reference or cuda_graph or int32 or on_gpu" 2>&1 | tail -3 \
    | tee "$OUT/cupy_checks.txt"
fi
stage done
