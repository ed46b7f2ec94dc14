#!/usr/bin/env bash
# One device call on the H200: install, GPU checks, demo, memory table, backend benchmarks
# (with FlashInfer when carried), HF generate, serving. Results land in $OUT.
# Usage (device tool, carry .whl for FlashInfer): bash benchmarks/run_h200.sh
# Stages can be skipped with SKIP="demo memory checks bench hf serving"; time limits T_*;
# BENCH_K selects benchmarks (pytest -k expression).
set -u
OUT=${OUT:-/tmp/qm_out}
source benchmarks/h200_setup.sh
PY="python3 -P"
stage() { echo; echo "=== $1 ($(date +%T))"; }
stage gpu; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
stage info; $PY -m quantmla_core.info | tee "$OUT/info.txt"
stage torch-backend-on-cuda
timeout ${T_TESTS:-90} $PY -m pytest -q -x -p no:cacheprovider tests/test_torch_backend.py -k cuda 2>&1 | tail -3
[[ " ${SKIP:-} " == *" demo "* ]] || { stage demo; timeout 90 $PY -m quantmla_core.demo 2>&1 | tee "$OUT/demo.txt"; }
[[ " ${SKIP:-} " == *" memory "* ]] || { stage memory; timeout 90 $PY -m benchmarks.memory --out "$OUT/memory.json" 2>&1 | tail -18; }
[[ " ${SKIP:-} " == *" checks "* ]] || { stage gpu_checks; timeout 60 $PY -m benchmarks.gpu_checks 2>&1 | tee "$OUT/gpu_checks.txt"; }
[[ " ${SKIP:-} " == *" bench "* ]] || { stage backend-benchmarks
  timeout ${T_BENCH:-240} $PY -m pytest -q -p no:cacheprovider --import-mode=importlib -m benchmark --benchmark-enable \
    --benchmark-json="$OUT/backends.json" benchmarks/test_backends.py benchmarks/test_attention_gpu.py ${BENCH_K:+-k "$BENCH_K"} 2>&1 | tail -15; }
[[ " ${SKIP:-} " == *" hf "* ]] || {
stage hf_generate
timeout ${T_HF:-150} $PY benchmarks/hf_generate.py --out "$OUT/hf_generate.json" ${HF_ARGS:---formats C4R4,C2R4} 2>&1 | tail -12; }
[[ " ${SKIP:-} " == *" serving "* ]] || {
stage serving
timeout ${T_SERVE:-240} $PY -m benchmarks.serving --out "$OUT/serving.json" --requests ${REQ:-48} --prompt-len ${PROMPT:-4096} \
  --output-len ${OUTLEN:-512} --budget-gib ${BUDGET:-0.25} ${SERVE_ARGS:-} 2>&1 | tail -8; }
stage done
