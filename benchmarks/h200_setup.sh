# Sourced by the benchmarks/run_h200*.sh scripts, from the repository root with $OUT set: installs
# the package into /tmp/qm as pip lays it out (backends/, reference/, calibration/ under
# quantmla_core/) and, when their wheels were carried in .whl/ (PERFORMANCE.md), FlashInfer into
# /tmp/site; exports PYTHONPATH and the FlashInfer variables.
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
rm -rf /tmp/qm  # a warm machine keeps the last call's copy, which pip --target would not replace
if ! python3 -m pip install -q --no-build-isolation --no-deps --no-compile --target /tmp/qm . > "$OUT/install.log" 2>&1; then
  echo "pip install failed (see install.log); copying the package layout by hand"
  mkdir -p /tmp/qm && cp -r quantmla_core /tmp/qm/ && cp -r backends /tmp/qm/quantmla_core/backends \
    && cp -r reference /tmp/qm/quantmla_core/reference && cp -r calibration /tmp/qm/quantmla_core/calibration
fi
export PYTHONPATH=/tmp/qm:$PWD
if ls .whl/flashinfer_python-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl > "$OUT/flashinfer_install.log" 2>&1 \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a FLASHINFER_WORKSPACE_BASE=/tmp
fi
# SM clocks, power and throttle reasons every 250 ms beside every run (the GPU meets its 700 W cap under long
# C4R4 runs, stop 28): $OUT/smi.csv; graph_probe.py rows carry their wall-clock times to match
if command -v nvidia-smi > /dev/null; then
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    --format=csv -lms 250 > "$OUT/smi.csv" 2>&1 &
  QM_SMI_PID=$!
  trap 'kill $QM_SMI_PID 2> /dev/null' EXIT
fi
