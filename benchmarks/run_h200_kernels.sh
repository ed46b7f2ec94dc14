#!/usr/bin/env bash
# Kernel-variant runs on the H200 (carry .whl for FlashInfer). Each mode runs under 10 minutes:
#   bash benchmarks/run_h200_kernels.sh check    # CuPy v2 conformance (+ lazy, separate builds), CUDA graphs, compute-sanitizer
#   bash benchmarks/run_h200_kernels.sh check_triton  # Triton v2 conformance
#   bash benchmarks/run_h200_kernels.sh time     # v1 vs v2 side by side (with FlashInfer BF16)
#   bash benchmarks/run_h200_kernels.sh profile  # Nsight Compute: what limits the v2 kernels (C4R4 H=16 B=32 L=32K)
#   bash benchmarks/run_h200_kernels.sh sweep    # CuPy v2 knobs (registers/CTAs per SM, copy stages, row groups)
#   bash benchmarks/run_h200_kernels.sh writer   # writers on a 128K prompt: conformance, CuPy memcheck, probe (WRITER_ARGS), ncu of both
#   bash benchmarks/run_h200_kernels.sh v3       # CuPy v3: conformance (4 and 8 warps), sanitizers, v2 vs v3 graphed
#   bash benchmarks/run_h200_kernels.sh protected  # the protected-only kernel (one stream vs two, v2 inline vs separate): conformance, sanitizers, graphs
#   bash benchmarks/run_h200_kernels.sh protected_sweep  # caches without protected tokens; v2's split floor at short contexts
#   V3_BASE=path/to/old/attention_v3.cu bash benchmarks/run_h200_kernels.sh v3ab  # v3 conformance and memcheck, then
#       this tree's v3 against the V3_BASE source (CUDA graphs, same shapes) and ncu of both; plan.run GPU tests
#       (AB_VARIANT=v2 V3_BASE=path/to/old/attention_v2.cu: the same for kernel v2, at its shorter contexts)
#   bash benchmarks/run_h200_kernels.sh v4       # CuPy v4 (64 rows per CTA): conformance, sanitizers, v3 vs v4 graphed
#       over V4_SHAPES (FlashInfer BF16 in the same run), ncu of v4 at H128 B32 L32K
#   bash benchmarks/run_h200_kernels.sh v6       # CuPy v6 (64 rows, a dequantizing and an attending warpgroup):
#       conformance, memcheck, v4 vs v6 graphed over V6_SHAPES, and the builds without dequantization / code loads
#   bash benchmarks/run_h200_kernels.sh v6knobs  # v6's knobs (QUANTMLA_CUPY_V6_PV_AT, _PAGE_AHEAD) side by side (CUDA
#       graphs, V6_SHAPES, FlashInfer BF16 in the same process), then conformance and memcheck of V6_KNOB_CHECK
#   bash benchmarks/run_h200_kernels.sh v6ncu    # Nsight Compute of v6 at H128 B32 L32K C4R4 (V6_NCU_SETTINGS: env per run)
#   bash benchmarks/run_h200_kernels.sh v6prot   # v6 attending to the sink/local tokens itself: conformance (every
#       v6 test), memcheck on protected-heavy cases, inline vs separate (QUANTMLA_CUPY_V6_PROTECTED) graphed over V6P_SHAPES
#   bash benchmarks/run_h200_kernels.sh v5prot   # v5 attending to the sink/local tokens itself: conformance (every
#       v5 test, v6's), memcheck on protected-heavy cases (V5P_MEMCHECK_ENV: e.g. QUANTMLA_CUPY_V5_PROT_LOADS=pairs),
#       inline vs separate (QUANTMLA_CUPY_V5_PROTECTED; or V5P_SETTINGS) graphed over V5P_SHAPES
#   bash benchmarks/run_h200_kernels.sh codes    # v5's 2-bit conversion (QUANTMLA_CUPY_CODES_IN_PLACE, 1 by default):
#       conformance of both builds, memcheck of the default, then CUDA graphs of 0 against 1 over CODES_SHAPES (C2R4)
#   bash benchmarks/run_h200_kernels.sh ropefold # v5's RoPE scale on the scores (QUANTMLA_CUPY_V5_ROPE_FOLD, auto: on
#       for 2-bit content): conformance of both builds, CUDA graphs of 1 against 0 over FOLD_SHAPES (C4R4, C2R4),
#       memcheck of the default (a source against another: srcab with SRCAB_KERNEL=attention_v5.cu)
#   bash benchmarks/run_h200_kernels.sh quad     # v5's quad code loads (QUANTMLA_CUPY_V5_QUAD_LOADS): conformance of the
#       flipped build, CUDA graphs of 0 against 1 twice over QUAD_SHAPES (C4R4, FlashInfer BF16 in the process), memcheck
#   bash benchmarks/run_h200_kernels.sh packed   # v5's packed zero-point/scale loads (QUANTMLA_CUPY_V5_PACKED_GROUPS, 2-bit
#       d_c 512): conformance, CUDA graphs of 0 against 1 twice over PACKED_SHAPES (C2R4), memcheck
#   bash benchmarks/run_h200_kernels.sh halves   # v5 with two warpgroups a worker (QUANTMLA_CUPY_V5_HALVES=2): one small
#       case first (a hang stops there), conformance, CUDA graphs of 1 against 2 twice over HALVES_SHAPES (C4R4, C2R4,
#       FlashInfer BF16 in the process), memcheck and racecheck, ncu of both at H16 B32 L32K C4R4
#   bash benchmarks/run_h200_kernels.sh stop43   # torch.ops.quantmla under torch.compile, CUDA cache save/load, the
#       prepared-call and plan tests, host_probe --plan; the same occupancy as the halves without the exchange: four workers at d_c 256
#       (QUANTMLA_CUPY_V5_WORKERS=4) against two and auto, conformance and CUDA graphs over FOUR_SHAPES; Triton at the declared dims
#   bash benchmarks/run_h200_kernels.sh stop45   # decode steps without stream syncs; Triton's protected-tile and merge
#       kernels: conformance, memcheck, before / after twice (the sources before them in probe_tmp/triton_before, carried:
#       mkdir -p probe_tmp/triton_before && for f in $(git ls-tree --name-only 89ce25e backends/triton/ | grep py$); do
#       git show 89ce25e:$f > probe_tmp/triton_before/$(basename $f); done)
#   bash benchmarks/run_h200_kernels.sh stop47   # each Triton kernel's device time before stop 45, at stop 45 and now
#       (probe_tmp/triton_before, probe_tmp/triton_s45 = git show 3779299:backends/triton/*.py, carried) at L4K,
#       QUANTMLA_TRITON_PROTECT_ROWS 16/32/64 at H128 (CUDA graphs), the stop 43/44 test files, v5 four workers at
#       d_c 256, the rest of Triton's real-shape conformance (S47_REAL_S seconds)
#   bash benchmarks/run_h200_kernels.sh stop48   # Triton's protected-tile kernel on a side stream
#       (QUANTMLA_TRITON_PROTECTED_STREAM): bit-identity on the GPU (eager and captured), CUDA graphs of 0 against 1
#       twice over S48_SHAPES (FlashInfer BF16 in the process); then everything the stop47 mode runs
#   bash benchmarks/run_h200_kernels.sh stop48b  # the Triton merge in one pass: GPU conformance of the merge, then each
#       kernel's device time and the call as a CUDA graph in the tree before it (probe_tmp/triton_s47 = git show
#       245c658:backends/triton/*.py, carried) and this one, twice, over S48_SHAPES; Triton real shapes (S48_REAL_S)
#   bash benchmarks/run_h200_kernels.sh stop49   # Triton launches with PDL (QUANTMLA_TRITON_PDL) and kernel v3's protected
#       rows: conformance (bit-identity, the default plans, real shapes), PDL 0/1/2 x rows 16/64, the defaults against
#       PDL 0 with 16 rows (CUDA graphs, FlashInfer BF16 with .whl carried), memcheck with PDL 2
#   bash benchmarks/run_h200_kernels.sh stop50   # kernel v3's codes from 32-bit words: conformance, each kernel's device
#       time before (probe_tmp/triton_head, carried) and now (S50_KT=0: not), CUDA graphs over S50_SHAPES of the runs
#       S50_RUNS (default "head 2 1 0 head 2": before, WORDS forced to 2 / 1 / 0 by probe_tmp/words_probe.py; "after":
#       this tree's defaults), FlashInfer BF16 in each process; memcheck, v3 at real shapes (S50_REAL_K: "and C2R4").
#       The conformance step gets S50_CONF_S seconds (420; stop 50 gave it 200, which its kernel builds filled)
#   bash benchmarks/run_h200_kernels.sh stop51   # code words in the wgmma operand's quad order: conformance (v2 words,
#       v3 code words, v3's C2R4 default) in three processes, CUDA graphs of kernel v2 from bytes against words
#       and words with ZSUB (S51_RUNS, comma-joined settings; S51_SHAPES; probe_tmp/v3_knobs_probe.py carried),
#       kernel v3 C4R4 in quad order with each chunk's scales against the default (S51_V3_RUNS, S51_V3_SHAPES),
#       memcheck (S51_MEMCHECK=0: not), ncu's per-instruction (SASS) stall table of v3 C4R4 (S51_NCU=0: not); S51_CONF=0
#       skips the conformance; everything in $OUT/stop51.tgz.
#       Several minutes of kernel builds: give it a call of its own, or shorten the run lists
#   bash benchmarks/run_h200_kernels.sh stop52   # the transformers integration's StepMemo: tests/test_paged.py and
#       tests/test_integration_transformers.py on CUDA (auto), benchmarks/hf_step_probe.py on auto and triton (a
#       27-layer decode step with the memo against each layer its own) at S52_BATCHES, S52_PROMPT; $OUT/stop52.tgz
#   bash benchmarks/run_h200_kernels.sh stop54   # the GPU checks stops 51-53 could not run and kernel v4's first run,
#       in five processes at once: stop 51's conformance (v2 words; v3 code words; v3's C2R4 default at many requests
#       and real shapes), stop 52's allocator and integration tests on CUDA (auto), kernel v4 (one small case, then
#       its test files); then, each only while S54_LIMIT seconds (default 540) are not spent: v3 against v4 as CUDA
#       graphs (S54_V4_SHAPES, S54_V4_FORMATS), memcheck of v2 words, v3 C2R4 and v4; $OUT/stop54.tgz
#   bash benchmarks/run_h200_kernels.sh v4probe  # where kernel v4's time goes: CUDA graphs of its default build beside
#       its measurement builds (QUANTMLA_TRITON_V4_PROBE 1: the loader writes no keys, 2: no loader output product, 3:
#       neither) over PROBE_SHAPES, each kernel's duration in one call (ncu), the SASS lines of the split kernel with
#       the most stall samples (ncu source page, CSV), builds 1 against 3, BF16 pages' builds 1-3 beside CuPy (dispatch.py
#       puts CuPy's v4 first over BF16 pages on sm_90 from stop 18's numbers), then v4's tests; $OUT/v4probe.tgz
#   bash benchmarks/run_h200_kernels.sh v4inline # (branch proto/v4-inline-protect) kernel v4 with the protected tokens
#       inline: benchmarks/v4inline_diag.py (inline against not, per request and split count), stop 56's failing case and an empty last split with tracebacks, CUDA graphs with and without inline
#       protection over V4I_SHAPES, the inline tests; $OUT/v4inline.tgz
#   bash benchmarks/run_h200_kernels.sh stop57   # kernel v4 with the protected tokens inline (the default): the per-request
#       diagnosis of the fix, the inline builds' tests, CUDA graphs inline against not over S57_SHAPES, memcheck of
#       an inline case with empty last splits; $OUT/s57.tgz
#   bash benchmarks/run_h200_kernels.sh stop58   # kernel v4's channel order by pages a split: one small case of each
#       order (a failure stops there), CUDA graphs of Triton's defaults, this tree's and main's (probe_tmp/triton_main,
#       see the mode), both orders at S58_ORDER_SHAPES, the order's GPU tests, memcheck; $OUT/s58.tgz
#   bash benchmarks/run_h200_kernels.sh stop59   # the merge kernel's order in registers: its test, then CUDA graphs of
#       probe 4 (no page loads) beside the defaults (S59_SHAPES), the merge's time against main (probe_tmp/triton_main,
#       see the mode), both channel orders at S59_ORDER_SHAPES; $OUT/s59.tgz. Stop 59's call 1 ran it as of 4545fb4,
#       with an L2-prefetch knob (QUANTMLA_TRITON_V4_L2_AHEAD 0/2/4) since removed
#   bash benchmarks/run_h200_kernels.sh stop59b  # build 4 (the loader's output product in flight): small cases first,
#       then CUDA graphs of builds 1 and 4 (S59B_SHAPES), both channel orders from 8 to 64 pages a split
#       (S59B_ORDER_SHAPES), ncu of v4 (defaults against probe 3) at H128 B32 L32K C4R4 while time is left; $OUT/s59b.tgz
#   bash benchmarks/run_h200_kernels.sh stop60   # build 4's GPU tests (4w8p, 4w8pc) and memcheck, Triton's and CuPy's
#       defaults at H128 (S60_SHAPES; CUDA graphs, FlashInfer BF16 in the process), CuPy v6's probes 1 and 2 (no
#       dequantization, no code loads) at H128 B32 L32K while time is left; $OUT/s60.tgz
#   bash benchmarks/run_h200_kernels.sh stop60b  # CuPy v6 with two dequantizing warpgroups: its GPU tests (a failure
#       stops there), CUDA graphs of one and two (S60B_SHAPES), v6's default/pair/balanced GPU tests after the per-role
#       epilogue, memcheck, then main's v6 sources (probe_tmp/cupy_main, see the mode) against this tree's;
#       $OUT/s60b.tgz.
#       Stop 60 ran it as of e0a8c17 (branch proto/v6-two-dequantizers): on main the knob it sets does not exist
#   bash benchmarks/run_h200_kernels.sh stop60c  # kernel v4's builds 1 and 4 with and without page loads (probe 4) at
#       H128 B32 L32K C4R4, then benchmarks/host_profile.py (cProfile of eager calls, H128 B8 L4K); $OUT/s60c.tgz
#   bash benchmarks/run_h200_kernels.sh stop60d  # Triton's kept prepared calls: their GPU test and the launcher's
#       stream and graph tests, then main's launcher (probe_tmp/triton_main, see the mode) against this tree's, twice:
#       host_profile.py's eager time a call and graph_probe.py's eager and graph times at H128 B8 L4K; $OUT/s60d.tgz
#   bash benchmarks/run_h200_kernels.sh stop61   # the CuPy combine with PDL (QUANTMLA_CUPY_PDL): its tests, the
#       combine's and the CUDA-graph tests (a failure stops there), memcheck, then PDL 0 against 1 twice over S61_SHAPES
#       (CUDA graphs, FlashInfer BF16 eagerly and as a graph in the process) with the SM clock, power and temperature
#       logged every 500 ms, the combine before its pipelined batches against now (PDL 0; probe_tmp/cupy_before =
#       git show 1ce6bf8:backends/cupy/kernels/attention.cu, carried), then v5's and v6's GPU conformance with PDL on;
#       $OUT/s61.tgz
#   bash benchmarks/run_h200_kernels.sh stop61b  # the combine with PDL after split kernels that trigger nothing (their
#       CTAs trigger as they exit): the PDL and CUDA-graph tests, memcheck, then PDL 0 against 1 three times over
#       S61B_SHAPES (CUDA graphs, FlashInfer BF16 in the process), SM clock and power logged; $OUT/s61b.tgz
#   bash benchmarks/run_h200_kernels.sh stop61c  # the final defaults (PDL where the split kernel is one wave): the PDL,
#       combine and CUDA-graph tests, v5's and v6's GPU conformance, then the defaults over S61C_SHAPES (CUDA graphs,
#       FlashInfer BF16 eager and as a graph in the process), SM clock and power logged; $OUT/s61c.tgz
#   bash benchmarks/run_h200_kernels.sh stop62b  # v6 writing the output itself (QUANTMLA_CUPY_V6_MERGE): its tests
#       (S62B_K: pytest's -k), memcheck, CUDA graphs of S62B_SETTINGS (merge 0 against auto) over S62B_SHAPES
#       (FlashInfer BF16 in the process); $OUT/s62b.tgz
#   bash benchmarks/run_h200_kernels.sh stop70   # what bounds kernel v5 at H16 (any card): v7_probe.py (PV's operand
#       in registers, checked against float64; then its builds without PV and without the partial-score exchange),
#       wgmma_rates.py (v5's matmuls alone, mma.sync's rate), CUDA graphs of the defaults of S70_BACKENDS (default
#       triton,cupy) over S70_SHAPES (FlashInfer BF16 in the process), Nsight Compute of the probe and of v5 at H16
#       B32 L32K C4R4 and C2R4 (memory tables, pipes, warp states), v5's GPU tests, while S70_LIMIT seconds (default
#       560) are not spent; $OUT/s70.tgz
#   bash benchmarks/run_h200_kernels.sh stop72   # the v8 and v9 probes (any card): v8_probe.py (mma.sync, scales kept
#       off the values; checked against float64; then its builds without PV and without the tile loop's query reads),
#       v9_probe.py (the same with warp roles, the queries in registers; checked, its build without PV, then with
#       all 32 content k-steps' queries in registers (--qregs 32, stop 72's build, which spills)), CUDA
#       graphs of CuPy's defaults over S72_SHAPES (default 16x32x32768; FlashInfer BF16 in the process),
#       wgmma_rates.py (modes 3 to 8), Nsight Compute of both probes (memory tables, pipes, warp states), while
#       S72_LIMIT seconds (default 560) are not spent; $OUT/s72.tgz
#   bash benchmarks/run_h200_kernels.sh stop64a  # Triton kernel v5 (few rows, tokens as wgmma M): its GPU tests
#       (S64A_K: pytest's -k; against the reference and kernel v4), memcheck, then CUDA graphs of S64A_SETTINGS (v2,
#       v4, v5, v5 two pages ahead) over S64A_SHAPES (CuPy's defaults and FlashInfer BF16 in the process), then
#       (S64A_MERGE_SHAPES set) CuPy's merge 0 against auto, while S64A_LIMIT seconds (default 560) are not spent;
#       $OUT/s64a.tgz. stop63a is the same mode (its first form, v4 below 64 rows, never ran). S64A_MEMCHECK_BUILD:
#       the build memcheck runs (a GPU_BUILDS id of tests/test_triton_v5.py, default a1pc); S64A_BACKENDS: timed
#       beside FlashInfer (default triton,cupy); S64A_TESTS: the test file (default tests/test_triton_v5.py; kernel v6:
#       tests/test_triton_v6.py, whose memcheck builds are its BUILDS, e.g. a1p); S64A_NCU set (an
#       environment setting, e.g. QUANTMLA_TRITON_ATTENTION=v6): ncu's warp-state, scheduler, memory and occupancy
#       sections of kernel S64A_NCU_KERNEL (default split_kernel_v6) at S64A_NCU_SHAPE (default 16x32x32768), C4R4,
#       with each stall reason's warps a issued instruction (smsp__average_warps_issue_stalled_*)
#   bash benchmarks/run_h200_kernels.sh stop62a  # each kernel's device time of CuPy's defaults at H128 (S62A_KT_SHAPES),
#       then mode pdlwaves; $OUT/s62a.tgz and $OUT/pdlw.tgz
#   bash benchmarks/run_h200_kernels.sh pdlwaves  # PDL against plain launches where split kernels take one wave and
#       two (CuPy QUANTMLA_CUPY_PDL, Triton QUANTMLA_TRITON_PDL; 0 against 1 three times over PDLW_SHAPES, CUDA
#       graphs, FlashInfer BF16 before and after each shape's rows), SM clock and power logged; $OUT/pdlw.tgz
#   bash benchmarks/run_h200_kernels.sh stop58probe  # kernel v4's defaults against its probe builds (S58P_SHAPES), then
#       Triton's defaults against CuPy's (S58P_AUTO_SHAPES), CUDA graphs with FlashInfer BF16; $OUT/s58p.tgz
#   bash benchmarks/run_h200_kernels.sh stop57auto  # Triton v4's defaults against CuPy's over S57A_SHAPES (CUDA graphs,
#       FlashInfer BF16 in the process), then the paged and transformers integration tests on CUDA (auto); $OUT/s57a.tgz
#   bash benchmarks/run_h200_kernels.sh stop56   # kernel v4's 8 loader warps: one small case (a failure stops there),
#       CUDA graphs of 4 loader warps (builds 2 and 1) against 8 (build 1) over S56_SHAPES, then the 8-warp tests not
#       yet run (BF16 pages' build 2, probes, poisoned partials); $OUT/s56.tgz. Stop 56's call 2 ran this mode as of
#       commit feaad3a (builds x loader warps x protected tokens inline at H128 B32 L32K)
#   bash benchmarks/run_h200_kernels.sh stop55   # kernel v4 without the empty-split path that serialized its wgmmas:
#       one small case of each build (a failure stops there), CUDA graphs of v3, v4, v4 pipelined over S55_SHAPES
#       (FlashInfer BF16 in the process), then v4's tests beside (S55_HF=1) the transformers integration tests on CUDA
#       (auto), memcheck, ncu of the pipelined build, while S55_LIMIT seconds (default 560) are not spent; $OUT/s55.tgz
#   bash benchmarks/run_h200_kernels.sh triton_v4  # Triton kernel v4 (Gluon): one small case first (a failure stops there),
#       tests/test_triton_v4.py, CUDA graphs of v3, v4 and v4 with QUANTMLA_TRITON_V4_PIPELINE=1 over V4_SHAPES
#       (V4_SETTINGS replaces the three; V4_FORMATS; FlashInfer BF16 in the
#       process) and CuPy's, memcheck, ncu of v4 C4R4 (while V4_LIMIT seconds, default 560, are not spent); V4_HF=1:
#       also tests/test_paged.py and tests/test_integration_transformers.py on CUDA (auto) beside the tests;
#       V4_AB_TREES="NAME:DIR ...": v4 as built from DIR's attention_v4_*.py (carried) at V4_AB_SHAPES too; $OUT/v4.tgz
#   bash benchmarks/run_h200_kernels.sh v6pair   # v6 as two-CTA clusters sharing each key tile (QUANTMLA_CUPY_V6_PAIR):
#       conformance of forced pairs, CUDA graphs of 0 against 1 over V6PAIR_SHAPES, memcheck of the pairs
#   bash benchmarks/run_h200_kernels.sh v6fold   # v6's slack maximum and RoPE fold (QUANTMLA_CUPY_V6_SLACK / _ROPE_FOLD):
#       conformance of each, CUDA graphs of the four builds over V6FOLD_SHAPES (twice), memcheck of both on
#   SRCAB_SOURCES="kept probe_tmp/old.cu kept" SRCAB_ARGS="..." bash benchmarks/run_h200_kernels.sh srcab  # one kernel
#       source (SRCAB_KERNEL, default attention_v6.cu) against others from the working tree, one process each
#   bash benchmarks/run_h200_kernels.sh v6small  # where v6's time goes at short contexts: each kernel's duration
#       (ncu) at V6_SMALL_SHAPES, then CUDA graphs of V6_SMALL_SETTINGS (FlashInfer BF16 in the same process)
# Results land in $OUT.
set -u
MODE=${1:-check}
OUT=${OUT:-/tmp/qm_out}
source benchmarks/h200_setup.sh
T="python3 -P -m pytest -q -p no:cacheprovider"
# kernel v4's first check: one small case of each of its builds into $1/first.txt; fails (status 1) where it failed
v4_first() {
  timeout -k 10 150 $T -x -rfE tests/test_triton_v4.py -k "matches_reference_and_v3 and C4R4 and L63_64_65 and H128" \
    > "$1/first.txt" 2>&1; echo "rc=$?" >> "$1/first.txt"; tail -2 "$1/first.txt"; grep -q "^rc=0" "$1/first.txt"
}
# another commit's Triton sources (carried in probe_tmp/triton_$1) over a copy of the installed package: /tmp/qm_$1
triton_tree() { rm -rf /tmp/qm_$1 && cp -r /tmp/qm /tmp/qm_$1 && cp probe_tmp/triton_$1/*.py /tmp/qm_$1/quantmla_core/backends/triton/; }
# PYTHONPATH with tree $1's package in place of this one ("after": this tree)
tree_path() { [ "$1" = after ] && echo "$PYTHONPATH" || echo "${PYTHONPATH/\/tmp\/qm:/\/tmp\/qm_$1:}"; }
# each Triton kernel's device time (C4R4) in the trees $1 over the shapes $2; JSON $OUT/kernel_times_triton_<tree>$3.json
smi_log() {  # nvidia-smi's SM clock, power and temperature every 500 ms into $1/smi.csv until smi_stop
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv -lms 500 \
    > "$1/smi.csv" 2>&1 &
  SMI=$!
}
smi_stop() { kill "$SMI" 2>/dev/null; }
# pytest's exit status $2 appended to its log $1, the log's failures and summary shown; status 0 where it passed
tests_report() { echo "rc=$2" >> "$1"; grep -E "^E  |^FAILED" "$1" | head -12; tail -2 "$1"; [ "$2" = 0 ]; }
cupy_pdl_first() {  # the PDL, combine and CUDA-graph tests, then (if they pass) memcheck of PDL's bit-for-bit case
  timeout -k 10 $2 $T -x -rfE --tb=long tests/test_cupy_pdl.py tests/test_cupy_combine.py \
    tests/test_cupy_backend.py -k "pdl or combine or cuda_graph" > "$1/first.txt" 2>&1
  tests_report "$1/first.txt" $? || return 1
  timeout -k 5 60 compute-sanitizer --tool memcheck $T tests/test_cupy_pdl.py -k same_bits > "$1/memcheck.txt" 2>&1
  echo "rc=$?" >> "$1/memcheck.txt"; tail -3 "$1/memcheck.txt"
}
triton_kernel_times() {
  for run in $1; do
    echo "=== Triton $run: each kernel's device time (torch.profiler), the call as a CUDA graph, FlashInfer BF16"
    PYTHONPATH=$(tree_path $run) timeout 100 python3 -P benchmarks/kernel_times.py --backends triton --formats C4R4 \
      --shapes $2 --json "$OUT/kernel_times_triton_$run$3.json" 2>&1 | grep -v "^{\|profiler" | tail -30
  done
}
if [ "$MODE" = stop48 ]; then
  PS=QUANTMLA_TRITON_PROTECTED_STREAM
  echo "=== Triton protected tiles on a side stream: bit-identical to one stream (eager and in a CUDA graph)"
  timeout 150 $T -rfE tests/test_triton_backend.py tests/test_triton_launch_geometry.py -k "side_stream" 2>&1 | tail -3
  echo "=== Triton protected tiles: one stream (0) against a side stream (1), twice (CUDA graphs; FlashInfer BF16)"
  timeout 200 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 --settings "$PS=0;$PS=1;$PS=0;$PS=1" \
    --shapes ${S48_SHAPES:-16x8x4096,16x32x4096,128x8x4096} --json "$OUT/graph_triton_side_stream.json" 2>&1 | grep -v "^{" | tail -30
  MODE=stop47
fi
if [ "$MODE" = check ]; then
  echo "=== cupy v2 conformance"; timeout 190 $T tests/test_cupy_backend.py -x -k v2 2>&1 | tail -6 | tee "$OUT/cupy_v2.txt"
  echo "=== cuda graph capture"; timeout 90 $T tests/test_cupy_backend.py -k cuda_graph 2>&1 | tail -4
  echo "=== cupy v2 64-token tiles conformance"; timeout 120 $T tests/test_cupy_backend.py -x -k tile64 2>&1 | tail -3
  echo "=== cupy v2 lazy rescale conformance"; QUANTMLA_CUPY_V2_LAZY_RESCALE=1 timeout 90 $T tests/test_cupy_backend.py -x \
    -k "attention_v2_matches_reference and float32-]" 2>&1 | tail -3
  echo "=== cupy v2 separate protected conformance"; QUANTMLA_CUPY_V2_PROTECTED=separate timeout 90 $T tests/test_cupy_backend.py -x \
    -k "attention_v2_matches_reference and float32-]" 2>&1 | tail -3
  echo "=== cupy v2 racecheck"; timeout 60 compute-sanitizer --tool racecheck $T tests/test_cupy_backend.py -x -k "v2_matches and (L17_31_100 or L900_16)" 2>&1 | tail -4
  echo "=== cupy v2 memcheck"; timeout 60 compute-sanitizer --tool memcheck $T tests/test_cupy_backend.py -x -k "v2_matches and (L17_31_100 or L40_33)" 2>&1 | tail -4
elif [ "$MODE" = v3 ]; then
  echo "=== cupy v3 conformance"; timeout 120 $T tests/test_cupy_v3.py -k "v3_matches or eight_warps or four_stages" 2>&1 | tail -3 | tee "$OUT/cupy_v3.txt"
  echo "=== cupy v3 racecheck"; timeout 90 compute-sanitizer --tool racecheck $T tests/test_cupy_v3.py -k "v3_matches and (L17_31_100 or L900_16)" 2>&1 | tail -2
  echo "=== cupy v3 memcheck"; timeout 90 compute-sanitizer --tool memcheck $T tests/test_cupy_v3.py -k "v3_matches and (L17_31_100 or L40_33)" 2>&1 | tail -2
  echo "=== v2 vs v3 (CUDA graphs)"; timeout 200 python3 -P benchmarks/graph_probe.py --backends cupy --sweep QUANTMLA_CUPY_ATTENTION=v2,v3 \
    --shapes 16x8x4096,16x32x32768,16x128x32768,128x32x32768 --formats C4R4,C2R4 --json "$OUT/graph_v2_v3.json" 2>&1 | grep -v "^{" | tail -16
elif [ "$MODE" = v3ab ]; then
  V=${AB_VARIANT:-v3}
  if [ "$V" = v3 ]; then
    SEL="tests/test_cupy_v3.py tests/test_plan.py -k v3_matches||eight_warps||four_stages||on_gpu"
    SAN="tests/test_cupy_v3.py -k v3_matches&&(L17_31_100||L40_33||L900_16)"; SHAPES=${V3_SHAPES:-16x32x32768,16x128x32768,128x32x32768}
  else
    SEL="tests/test_cupy_backend.py tests/test_plan.py -k v2_matches||cuda_graph||on_gpu"
    SAN="tests/test_cupy_backend.py -k v2_matches&&(L17_31_100||L40_33||L900_16)"; SHAPES=${V3_SHAPES:-16x8x4096,16x32x4096,128x8x4096}
  fi
  k() { echo "$1" | sed 's/||/ or /g; s/&&/ and /g'; }
  echo "=== cupy $V conformance, plan.run"; timeout 150 $T ${SEL% -k *} -k "$(k "${SEL#* -k }")" 2>&1 | tail -3 | tee "$OUT/cupy_$V.txt"
  for tool in memcheck racecheck; do
    echo "=== cupy $V $tool"; timeout 90 compute-sanitizer --tool $tool $T ${SAN% -k *} -k "$(k "${SAN#* -k }")" 2>&1 | tail -2
  done
  KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels
  NCU="ncu -k regex:qmla_attn_$V -s 2 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis --section SchedulerStats \
    --section WarpStateStats --section InstructionStats --section SourceCounters"
  PROBE="benchmarks/cupy_probe.py --variant $V --shapes ${SHAPES%%,*} --formats C4R4 --no-writer --protection 0,0"
  for which in new base; do
    [ "$which" = base ] && { cp "$KDIR/attention_$V.cu" /tmp/attention_new.cu; cp "$V3_BASE" "$KDIR/attention_$V.cu"; }
    echo "=== $V $which (CUDA graphs)"; timeout 150 python3 -P benchmarks/graph_probe.py --backends cupy \
      --settings "QUANTMLA_CUPY_ATTENTION=$V" --shapes $SHAPES --formats C4R4,C2R4 \
      --json "$OUT/graph_${V}_$which.json" 2>&1 | grep -v "^{" | tail -8
    echo "=== ncu $V $which"; timeout 100 $NCU python3 -P $PROBE > "$OUT/ncu_${V}_$which.txt" 2>&1; \
      grep -E "Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Theoretical Occ|Pipe|Executed Instructions  |excessive" "$OUT/ncu_${V}_$which.txt" | head -20
  done
  cp /tmp/attention_new.cu "$KDIR/attention_$V.cu"
elif [ "$MODE" = v4 ]; then
  echo "=== cupy v4 conformance"; timeout 200 $T tests/test_cupy_v4.py 2>&1 | tail -3 | tee "$OUT/cupy_v4.txt"
  for tool in memcheck racecheck; do
    echo "=== cupy v4 $tool"; timeout 100 compute-sanitizer --tool $tool $T tests/test_cupy_v4.py \
      -k "v4_matches and (L64_65_4097 or L300_17 or L700_63)" 2>&1 | tail -2
  done
  echo "=== v3 vs v4 (CUDA graphs)"; timeout 330 python3 -P benchmarks/graph_probe.py --backends cupy \
    --sweep QUANTMLA_CUPY_ATTENTION=v3,v4 --formats C4R4,C2R4 \
    --shapes ${V4_SHAPES:-128x8x4096,128x32x4096,128x32x32768,128x128x32768,64x32x32768,32x32x32768} \
    --json "$OUT/graph_v3_v4.json" 2>&1 | grep -v "^{" | tail -30
  echo "=== ncu v4"; timeout 100 ncu -k regex:qmla_attn_v4 -s 2 -c 1 --section SpeedOfLight --section ComputeWorkloadAnalysis \
    --section SchedulerStats --section WarpStateStats --section InstructionStats --section MemoryWorkloadAnalysis \
    python3 -P benchmarks/cupy_probe.py --variant v4 --shapes 128x32x32768 --formats C4R4 --no-writer --protection 0,0 \
    > "$OUT/ncu_v4.txt" 2>&1
  grep -E "Duration|Executed Ipc A|Issue Slots Busy|Registers Per|Theoretical Occ|Pipe|Shared|Bank|Executed Instructions  " \
    "$OUT/ncu_v4.txt" | head -24
elif [ "$MODE" = v6 ]; then
  echo "=== cupy v6 conformance"; timeout 200 $T tests/test_cupy_v6.py 2>&1 | tail -3 | tee "$OUT/cupy_v6.txt"
  echo "=== cupy v6 memcheck"; timeout 100 compute-sanitizer --tool memcheck $T tests/test_cupy_v6.py \
    -k "matches_reference and (L64_128_192 or L5000_321 or L900_2 or L2100)" 2>&1 | tail -2
  echo "=== v4 vs v6 (CUDA graphs)"; timeout 280 python3 -P benchmarks/graph_probe.py --backends cupy \
    --sweep QUANTMLA_CUPY_ATTENTION=v4,v6 --formats C4R4,C2R4 \
    --shapes ${V6_SHAPES:-128x32x32768,128x8x4096,64x32x32768,128x128x32768,128x32x131072} \
    --json "$OUT/graph_v4_v6.json" 2>&1 | grep -v "^{" | tail -20
  # what each side costs: the measurement builds of attention_v6.cu (QMLA_V6_PROBE: 1 no dequantization,
  # 2 no code loads; wrong outputs), one process each
  KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels; cp "$KDIR/attention_v6.cu" /tmp/attention_v6_kept.cu
  for probe in 0 1 2; do
    (echo "#define QMLA_V6_PROBE $probe"; cat /tmp/attention_v6_kept.cu) > "$KDIR/attention_v6.cu"
    echo "=== v6 probe $probe"; timeout 100 python3 -P benchmarks/graph_probe.py --backends cupy --settings QUANTMLA_CUPY_ATTENTION=v6 \
      --shapes 128x32x32768 --formats C4R4,C2R4 --json "$OUT/graph_v6_probe$probe.json" 2>&1 | grep -v "^{" | tail -2
  done
  cp /tmp/attention_v6_kept.cu "$KDIR/attention_v6.cu"
elif [ "$MODE" = v6knobs ]; then
  PV=QUANTMLA_CUPY_V6_PV_AT; PA=QUANTMLA_CUPY_V6_PAGE_AHEAD
  echo "=== v6 knobs (CUDA graphs)"; timeout 400 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${V6_KNOB_SETTINGS:-$PV=3 $PA=0;$PV=3 $PA=1;$PV=2 $PA=0;$PV=2 $PA=1;$PV=1 $PA=0;$PV=1 $PA=1}" --formats C4R4,C2R4 \
    --shapes ${V6_SHAPES:-128x32x32768,128x128x32768,64x32x32768,128x8x4096} --json "$OUT/graph_v6_knobs.json" 2>&1 | grep -v "^{" | tail -60
  for setting in ${V6_KNOB_CHECK:-"$PV=2 $PA=1" "$PV=1 $PA=1"}; do
    echo "=== v6 conformance, $setting"; env $setting timeout 150 $T tests/test_cupy_v6.py -k matches_reference 2>&1 | tail -2
    echo "=== v6 memcheck, $setting"; env $setting timeout 90 compute-sanitizer --tool memcheck $T tests/test_cupy_v6.py \
      -k "matches_reference and (L64_128_192 or L5000_321 or L900_2)" 2>&1 | tail -2
  done
elif [ "$MODE" = v6ncu ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  SECS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section InstructionStats --section SourceCounters --section MemoryWorkloadAnalysis"
  IFS=';' read -ra RUNS <<< "${V6_NCU_SETTINGS:-QUANTMLA_CUPY_V6_PV_AT=3}"
  for setting in "${RUNS[@]}"; do
    tag=$(echo "$setting" | tr -c 'A-Za-z0-9\n' _); echo "=== ncu v6 $setting"
    env $setting timeout 200 $NCU -k regex:qmla_attn_v6 -s 2 -c 1 --clock-control none $SECS python3 -P benchmarks/cupy_probe.py --variant v6 \
      --shapes 128x32x32768 --formats C4R4 --no-writer --protection 0,0 > "$OUT/ncu_v6_$tag.txt" 2>&1
    grep -v "^==PROF==" "$OUT/ncu_v6_$tag.txt" | grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|Stall|Throughput|Bank" | head -40
  done
elif [ "$MODE" = v6prot ]; then
  echo "=== v6 conformance (with the knob builds), plan.run"; timeout 300 $T tests/test_cupy_v6.py tests/test_plan.py 2>&1 | tail -3 | tee "$OUT/v6_conformance.txt"
  echo "=== v6 memcheck"; timeout 150 compute-sanitizer --tool memcheck $T tests/test_cupy_v6.py \
    -k "v6_matches and (L70_9000_200 or L17_31_100 or L2049_33_700 or L40_33 or L900_16)" 2>&1 | tail -2
  echo "=== inline vs separate (CUDA graphs)"; timeout 400 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "QUANTMLA_CUPY_V6_PROTECTED=inline;QUANTMLA_CUPY_V6_PROTECTED=separate" --formats C4R4,C2R4 \
    --shapes ${V6P_SHAPES:-128x8x4096,128x32x4096,128x32x32768,128x128x32768,128x32x131072,64x32x32768} \
    --json "$OUT/graph_v6_protected.json" 2>&1 | grep -v "^{" | tail -30
elif [ "$MODE" = v5prot ]; then
  echo "=== v5 conformance (both protected modes, three workers)"; timeout 300 $T tests/test_cupy_v5.py 2>&1 | tail -3 | tee "$OUT/v5_conformance.txt"
  echo "=== v6 conformance (the shared protected-split helper)"; timeout 200 $T tests/test_cupy_v6.py -k "v6_matches" 2>&1 | tail -2
  echo "=== v5 memcheck"; env ${V5P_MEMCHECK_ENV:-} timeout 150 compute-sanitizer --tool memcheck $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and float32-2] and (L64_65_4097_128 or L2000_4_150 or L300_70_5 or L300_17 or L5000_321)" 2>&1 | tail -2
  echo "=== inline vs separate (CUDA graphs)"; timeout 400 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${V5P_SETTINGS:-QUANTMLA_CUPY_V5_PROTECTED=inline;QUANTMLA_CUPY_V5_PROTECTED=separate}" --formats C4R4,C2R4 \
    --shapes ${V5P_SHAPES:-16x8x4096,16x32x4096,16x8x32768,16x32x32768,16x128x32768,16x32x131072,16x128x131072} \
    --json "$OUT/graph_v5_protected.json" 2>&1 | grep -v "^{" | tail -40
elif [ "$MODE" = codes ]; then
  echo "=== v5 codes in place: conformance"; timeout 150 $T tests/test_cupy_v5.py -k "codes_shifted or (v5_matches_reference and C2R4)" \
    2>&1 | tail -3 | tee "$OUT/v5_codes_in_place.txt"
  echo "=== memcheck"; timeout 60 compute-sanitizer --tool memcheck $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and C2R4 and float32-2] and (L2000_4_150 or L5000_321)" 2>&1 | tail -2
  echo "=== 0 against 1 (CUDA graphs)"; timeout 200 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "QUANTMLA_CUPY_CODES_IN_PLACE=0;QUANTMLA_CUPY_CODES_IN_PLACE=1;QUANTMLA_CUPY_CODES_IN_PLACE=0" --formats C2R4 \
    --shapes ${CODES_SHAPES:-16x32x4096,16x32x32768,16x128x32768,16x32x131072,16x128x131072} \
    --json "$OUT/graph_codes_in_place.json" 2>&1 | grep -v "^{" | tail -16
elif [ "$MODE" = ropefold ]; then
  echo "=== v5 conformance (both builds)"; timeout 330 $T tests/test_cupy_v5.py 2>&1 | tail -3 | tee "$OUT/v5_conformance.txt"
  SH=${FOLD_SHAPES:-16x32x4096,16x32x32768,16x128x32768,16x32x131072,16x128x131072}
  echo "=== 1 against 0 (CUDA graphs)"; timeout 300 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "QUANTMLA_CUPY_V5_ROPE_FOLD=1;QUANTMLA_CUPY_V5_ROPE_FOLD=0;QUANTMLA_CUPY_V5_ROPE_FOLD=1" --formats C4R4,C2R4 \
    --shapes $SH --json "$OUT/graph_rope_fold.json" 2>&1 | grep -v "^{" | tail -24
  echo "=== memcheck"; timeout 120 compute-sanitizer --tool memcheck $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and float32-2] and (L64_65_4097_128 or L2000_4_150 or L300_17 or L5000_321)" 2>&1 | tail -2
elif [ "$MODE" = quad ]; then
  echo "=== v5 quad loads: conformance (the flipped build; the default C4R4 v5 tests)"; timeout 200 $T tests/test_cupy_v5.py \
    -k "quad_loads_flipped or (v5_matches_reference and C4R4)" 2>&1 | tail -3 | tee "$OUT/v5_quad_conformance.txt"
  grep -q " passed" "$OUT/v5_quad_conformance.txt" && ! grep -q "failed\|error" "$OUT/v5_quad_conformance.txt" || exit 1
  Q0=QUANTMLA_CUPY_V5_QUAD_LOADS=0; Q1=QUANTMLA_CUPY_V5_QUAD_LOADS=1; QF="$Q1 QUANTMLA_CUPY_V5_ROPE_FOLD=1"
  echo "=== quad loads with the RoPE fold: conformance"; env $QF timeout 150 $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and C4R4" 2>&1 | tail -2
  echo "=== 0 / 1 / 1 with the fold, twice (CUDA graphs)"; timeout 330 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${QUAD_SETTINGS:-$Q0;$Q1;$QF;$Q0;$Q1;$QF}" --formats C4R4 \
    --shapes ${QUAD_SHAPES:-16x32x4096,16x32x32768,16x128x32768,16x32x131072,16x128x131072} \
    --json "$OUT/graph_v5_quad.json" 2>&1 | grep -v "^{" | tail -30
  echo "=== memcheck (quad loads)"; QUANTMLA_CUPY_V5_QUAD_LOADS=1 timeout 120 compute-sanitizer --tool memcheck $T \
    tests/test_cupy_v5.py -k "v5_matches_reference and C4R4 and (L64_65_4097_128 or L2000_4_150 or L5000_321)" 2>&1 | tail -2
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for setting in $Q0 $Q1; do
    tag=$(echo "$setting" | tr -c "A-Za-z0-9\n" _); echo "=== ncu v5 $setting"; env $setting timeout 100 $NCU -k regex:qmla_attn_v5 -s 2 -c 1 --clock-control none \
      --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section WarpStateStats --section SchedulerStats \
      python3 -P benchmarks/cupy_probe.py --variant v5 --shapes 16x32x32768 --formats C4R4 --no-writer --protection 0,0 \
      > "$OUT/ncu_v5_$tag.txt" 2>&1
    grep -v "^==PROF==" "$OUT/ncu_v5_$tag.txt" | grep -E "Duration|L1/TEX Cache|Issue Slots|Issued Warp|Warp Cycles Per Issued|Shared|Global Load" | head -20
  done
elif [ "$MODE" = packed ]; then
  P0=QUANTMLA_CUPY_V5_PACKED_GROUPS=0; P1=QUANTMLA_CUPY_V5_PACKED_GROUPS=1
  echo "=== v5 packed groups: conformance (the flipped build; C2R4 v5 tests with it)"; env $P1 timeout 200 $T \
    tests/test_cupy_v5.py -k "packed_groups_flipped or (v5_matches_reference and C2R4)" 2>&1 | tail -3 \
    | tee "$OUT/v5_packed_conformance.txt"
  grep -q " passed" "$OUT/v5_packed_conformance.txt" && ! grep -q "failed\|error" "$OUT/v5_packed_conformance.txt" || exit 1
  echo "=== 0 against 1, twice (CUDA graphs)"; timeout 300 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${PACKED_SETTINGS:-$P0;$P1;$P0;$P1}" --formats C2R4 \
    --shapes ${PACKED_SHAPES:-16x32x4096,16x32x32768,16x128x32768,16x32x131072,16x128x131072} \
    --json "$OUT/graph_v5_packed.json" 2>&1 | grep -v "^{" | tail -24
  echo "=== memcheck (packed groups)"; env $P1 timeout 120 compute-sanitizer --tool memcheck $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and C2R4 and float32-2] and (L2000_4_150 or L300_17 or L5000_321)" 2>&1 | tail -2
elif [ "$MODE" = halves ]; then
  H1=QUANTMLA_CUPY_V5_HALVES=1; H2=QUANTMLA_CUPY_V5_HALVES=2
  echo "=== v5 halves: one small case first"; timeout 120 $T tests/test_cupy_v5.py \
    -k "v5_halves_match and C4R4 and L64_65_4097_128" 2>&1 | tail -2 | tee "$OUT/v5_halves_first.txt"
  grep -q " passed" "$OUT/v5_halves_first.txt" && ! grep -q "failed\|error" "$OUT/v5_halves_first.txt" || exit 1
  echo "=== conformance"; timeout 200 $T tests/test_cupy_v5.py -k "v5_halves_match" 2>&1 | tail -3 \
    | tee "$OUT/v5_halves_conformance.txt"
  grep -q " passed" "$OUT/v5_halves_conformance.txt" && ! grep -q "failed\|error" "$OUT/v5_halves_conformance.txt" || exit 1
  echo "=== 1 against 2, twice (CUDA graphs)"; timeout 240 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${HALVES_SETTINGS:-$H1;$H2;$H1;$H2}" --formats C4R4,C2R4 \
    --shapes ${HALVES_SHAPES:-16x8x4096,16x32x32768,16x128x32768,16x32x131072} \
    --json "$OUT/graph_v5_halves.json" 2>&1 | grep -v "^{" | tail -40
  for tool in memcheck racecheck; do
    echo "=== $tool (halves)"; env $H2 timeout 100 compute-sanitizer --tool $tool $T tests/test_cupy_v5.py \
      -k "v5_halves_match and (L2000_4_150 or L5000_321)" 2>&1 | tail -2
  done
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for setting in $H1 $H2; do
    tag=$(echo "$setting" | tr -c "A-Za-z0-9\n" _); echo "=== ncu v5 $setting"; env $setting timeout 60 $NCU -k regex:qmla_attn_v5 -s 2 -c 1 --clock-control none \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats \
      python3 -P benchmarks/cupy_probe.py --variant v5 --shapes 16x32x32768 --formats C4R4 --no-writer --protection 0,0 \
      > "$OUT/ncu_v5_$tag.txt" 2>&1
    grep -v "^==PROF==" "$OUT/ncu_v5_$tag.txt" | grep -E "Duration|L1/TEX Cache|Issue Slots|Issued Warp|Warp Cycles Per Issued" | head -12
  done
elif [ "$MODE" = stop43 ]; then
  W2=QUANTMLA_CUPY_V5_WORKERS=2; W4=QUANTMLA_CUPY_V5_WORKERS=4; WA=QUANTMLA_CUPY_V5_WORKERS=auto
  echo "=== torch.ops.quantmla under torch.compile, save/load of CUDA caches (stop 43), the split CuPy launcher's stub tests"
  timeout 200 $T tests/test_torch_ops.py tests/test_cupy_prepared.py tests/test_cache_io.py tests/test_plan.py 2>&1 | tail -3
  echo "=== eager qm.attention against plan.run (Triton's prepared call, stop 44), host and device time"
  timeout 150 python3 -P benchmarks/host_probe.py --plan --json "$OUT/host_plan.json" 2>&1 | tail -16
  echo "=== v5 four workers at d_c 256: conformance"; timeout 120 $T tests/test_cupy_v5.py \
    -k "v5_matches_reference and dc256 and -4]" 2>&1 | tail -2
  echo "=== 2 against 4 workers at d_c 256, twice (CUDA graphs)"; timeout 150 python3 -P benchmarks/graph_probe.py \
    --backends cupy --dims 256,32 --settings "$W2;$W4;$WA;$W2;$W4;$WA" --formats C4R4,C2R4 \
    --shapes ${FOUR_SHAPES:-16x32x32768,16x128x32768,16x32x131072} --json "$OUT/graph_v5_four.json" 2>&1 | grep -v "^{" | tail -24
  python3 -P -c "import torch; from quantmla_core.backends.triton import attention as a; d = torch.device('cuda');
print('limits 512/64', a.device_limits(d, 512, 64), '1024/64', a.device_limits(d, 1024, 64), 'v3_suits', a.v3_suits(d))"
  echo "=== Triton at the declared dims beyond 512/64 and 256/32 (stop 42: the d_c 1024 combine in 16-token tiles)"
  timeout 200 $T tests/test_triton_backend.py -k "declared_dims" 2>&1 | tail -3
elif [ "$MODE" = stop45 ]; then
  echo "=== decode steps queue without a stream sync (index arrays from pinned memory)"
  timeout 120 $T tests/test_paged.py tests/test_integration_transformers.py tests/test_quantizer.py -k "stream_sync" 2>&1 | tail -3
  echo "=== stop 46: a one-token sink and ring with S_q = 2 on every GPU backend (CuPy v5/v6 attend protected tiles themselves)"
  timeout 150 $T tests/test_cupy_backend.py tests/test_triton_backend.py tests/test_torch_backend.py -k "sink1-local1" 2>&1 | tail -3
  timeout 200 $T tests/test_cupy_v5.py tests/test_cupy_v6.py -k "matches and sink1-local1" 2>&1 | tail -3
  echo "=== Triton's protected-tile and merge kernels: conformance (real shapes, many splits and protected tiles, plans)"
  timeout 240 $T tests/test_triton_backend.py -k "real_shapes or merge_over or split_counts" 2>&1 | tail -3
  timeout 90 $T tests/test_plan.py -k "triton" 2>&1 | tail -2
  echo "=== memcheck"; timeout 90 compute-sanitizer --tool memcheck $T tests/test_triton_backend.py -k "merge_over" 2>&1 | tail -2
  # before / after, interleaved: the Triton sources of the commit before stop 45 (carried in probe_tmp/triton_before)
  triton_tree before
  n=0
  for run in before after before after; do
    n=$((n + 1))
    echo "=== Triton $run (eager and CUDA graphs; FlashInfer BF16 in the process)"
    PYTHONPATH=$(tree_path $run) timeout 120 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
      --shapes ${S45_SHAPES:-16x8x4096,16x32x32768,128x8x4096} --json "$OUT/graph_triton_${n}_${run}.json" 2>&1 | grep -v "^{" | tail -8
  done
elif [ "$MODE" = stop47 ]; then
  # three Triton trees: before stop 45 (89ce25e), stop 45's protect_parts (3779299), this tree (waves x tiles a part)
  triton_tree before && triton_tree s45
  triton_kernel_times "${S47_RUNS:-s45 after before}" ${S47_SHAPES:-128x8x4096,16x8x4096,16x32x4096} ""
  R=QUANTMLA_TRITON_PROTECT_ROWS
  echo "=== Triton protected rows a program 32 and 64: conformance first (64 rows build wgmma, which the interpreter does not)"
  timeout 120 $T tests/test_triton_backend.py -k "wider_protected" 2>&1 | tail -2
  env $R=64 timeout 120 $T tests/test_triton_backend.py -k "real_shapes and H128 and sink4 and v3 and C4R4" 2>&1 | tail -2
  echo "=== Triton protected rows a program: 16 (default), 32, 64, twice (CUDA graphs; FlashInfer BF16 in the process)"
  timeout 150 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --settings "$R=16;$R=32;$R=64;$R=16;$R=32;$R=64" \
    --shapes ${S47_ROW_SHAPES:-128x8x4096,128x32x4096,16x8x4096} --json "$OUT/graph_protect_rows.json" 2>&1 | grep -v "^{" | tail -20
  echo "=== torch.ops.quantmla under torch.compile, CUDA cache save/load, plans (stop 43/44)"
  timeout 150 $T tests/test_torch_ops.py tests/test_cache_io.py tests/test_plan.py 2>&1 | tail -2
  echo "=== v5 four workers at d_c 256: conformance"
  timeout 90 $T tests/test_cupy_v5.py -k "v5_matches_reference and dc256 and -4]" 2>&1 | tail -2
  echo "=== Triton conformance at real shapes, split counts, declared dims"
  timeout ${S47_REAL_S:-150} $T -rfE tests/test_triton_backend.py -k "real_shapes or split_counts or declared_dims" 2>&1 | tail -4
elif [ "$MODE" = stop48b ]; then
  echo "=== Triton merge in one pass: conformance on the GPU"
  timeout 150 $T -rfE tests/test_triton_backend.py -k "merge or poisoned or side_stream or split_counts" 2>&1 | tail -4
  triton_tree s47
  export QUANTMLA_TRITON_PROTECTED_STREAM=0  # one stream in both trees (245c658 forked under capture by default)
  kt() { triton_kernel_times "s47 after" ${S48_SHAPES:-128x8x4096,16x8x4096,16x32x32768} _$SECONDS; }
  kt
  R=QUANTMLA_TRITON_PROTECT_ROWS
  echo "=== Triton protected rows a program 16 against 64, twice (CUDA graphs, one stream; FlashInfer BF16 in the process)"
  timeout 120 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --settings "$R=16;$R=64;$R=16;$R=64" \
    --shapes 128x8x4096,128x32x4096 --json "$OUT/graph_protect_rows_one_stream.json" 2>&1 | grep -v "^{" | tail -10
  [ "${S48_SHORT:-0}" = 1 ] && exit 0  # a short call: one round of kernel times, no real-shape conformance
  kt
  echo "=== Triton conformance at real shapes, split counts, declared dims"
  timeout ${S48_REAL_S:-150} $T -rfE tests/test_triton_backend.py -k "real_shapes or declared_dims" 2>&1 | tail -4
elif [ "$MODE" = stop49 ]; then
  echo "=== Triton PDL and v3's protected rows: conformance (bit-identity, defaults, the merge, real shapes)"
  timeout 300 $T -rfE tests/test_triton_backend.py -k "pdl or many_requests or merge_over or poisoned or wider_protected \
    or (real_shapes and v3)" 2>&1 | tail -5
  P=QUANTMLA_TRITON_PDL; R=QUANTMLA_TRITON_PROTECT_ROWS
  echo "=== PDL 0 / 1 / 2, twice (CUDA graphs, 16 protected rows)"
  timeout 250 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 --settings \
    "$P=0 $R=16;$P=1 $R=16;$P=2 $R=16;$P=0 $R=16;$P=1 $R=16;$P=2 $R=16" --shapes 16x8x4096,16x32x4096,128x8x4096,16x32x32768 \
    --json "$OUT/graph_triton_pdl.json" 2>&1 | grep -v "^{" | tail -52
  S="$P=1 $R=16;$P=2 $R=16;$P=1 $R=64;$P=2 $R=64"
  echo "=== PDL 1 / 2 x protected rows 16 / 64, twice (CUDA graphs)"
  timeout 400 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --settings "$S;$S" \
    --shapes 128x8x4096,128x32x4096,128x128x4096,128x32x32768,16x128x4096 --json "$OUT/graph_triton_pdl_rows.json" 2>&1 | grep -v "^{" | tail -45
  echo "=== PDL 0 with 16 rows against the defaults (both unset), twice (CUDA graphs)"
  O="$P=0 $R=16"; N="$P= $R="
  timeout 250 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 --settings "$O;$N;$O;$N" \
    --shapes 16x8x4096,16x32x32768,128x8x4096,128x32x4096,128x128x4096,128x32x32768 --json "$OUT/graph_triton_defaults.json" \
    2>&1 | grep -v "^{" | tail -50
  echo "=== memcheck with PDL 2"
  QUANTMLA_TRITON_PDL=2 timeout 70 compute-sanitizer --tool memcheck $T tests/test_triton_backend.py -k "merge_over or poisoned" 2>&1 | tail -3
elif [ "$MODE" = stop50 ]; then
  # kernel v3's codes from 32-bit words (WORDS 2: taken apart in PTX, the default on NVIDIA; 1: portable Triton; 0: bytes)
  # against the tree before (probe_tmp/triton_head = git show a9b7113:backends/triton/*.py, carried)
  echo "=== v3 code words: conformance (each WORDS, the v3 tests)"
  timeout ${S50_CONF_S:-420} $T -rfE tests/test_triton_backend.py -k "code_words or v3_attention or v3_split or many_requests" 2>&1 | tail -4
  triton_tree head
  [ "${S50_KT:-1}" = 1 ] && triton_kernel_times "head after" ${S50_KT_SHAPES:-128x8x4096,128x32x32768} ""
  n=0
  for run in ${S50_RUNS:-head 2 1 0 head 2}; do  # head: the tree before; after: this tree's defaults; 0-2: WORDS forced
    n=$((n + 1))
    echo "=== Triton $run (CUDA graphs; FlashInfer BF16 in the process)"
    if [ "$run" = head ] || [ "$run" = after ]; then
      PYTHONPATH=$(tree_path $run) timeout 150 python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
        --shapes ${S50_SHAPES:-128x8x4096,128x32x32768,16x32x32768x4} --json "$OUT/graph_words_${n}_$run.json" 2>&1 | grep -v "^{" | tail -8
    else
      WORDS_MODE=$run timeout 150 python3 -P probe_tmp/words_probe.py --backends triton --formats C4R4,C2R4 \
        --shapes ${S50_SHAPES:-128x8x4096,128x32x32768,16x32x32768x4} --json "$OUT/graph_words_${n}_$run.json" 2>&1 | grep -v "^{" | tail -8
    fi
  done
  echo "=== memcheck (words in PTX)"
  timeout 90 compute-sanitizer --tool memcheck $T tests/test_triton_backend.py -k "code_words and C4R4" 2>&1 | tail -3
  echo "=== Triton v3 at real shapes"
  timeout ${S50_REAL_S:-200} $T -rfE tests/test_triton_backend.py -k "real_shapes and v3 ${S50_REAL_K:-}" 2>&1 | tail -4
elif [ "$MODE" = stop51 ]; then
  # code words in the quad order of the wgmma register operand: kernel v3's 2-bit default (WORD_LANES 4) and kernel
  # v2's opt-in words (V2_WORDS=1 in probe_tmp/v3_knobs_probe.py, carried); every file lands in one tar ($OUT returns
  # at most 8 files)
  mkdir -p /tmp/s51
  echo "=== conformance: v2 words, v3 code words, v3 C2R4 (the new default), three processes (S51_CONF=0: not)"
  pids=""
  [ "${S51_CONF:-1}" = 1 ] && sels=("v2_code_words or v2_switches" "code_words and not v2" \
    "v3_attention_matches or many_requests or real_shapes and v3") || sels=()
  for sel in "${sels[@]}"; do
    tag=$(echo "$sel" | tr -c 'A-Za-z0-9\n' _)
    (timeout ${S51_CONF_S:-400} $T -rfE tests/test_triton_backend.py -k "$sel" > "/tmp/s51/conf_$tag.txt" 2>&1; echo "rc=$?" >> "/tmp/s51/conf_$tag.txt") &
    pids="$pids $!"
  done
  wait $pids  # not a bare wait: h200_setup.sh's nvidia-smi logger runs in the background
  for f in /tmp/s51/conf_*.txt; do [ -e "$f" ] && { echo "--- $f"; tail -3 "$f"; }; done
  n=0
  for run in ${S51_RUNS-V2_WORDS=0 V2_WORDS=1 V2_WORDS=1,V2_ZSUB=1 V2_WORDS=0 V2_WORDS=1,V2_ZSUB=1}; do
    n=$((n + 1)); echo "=== [$run] (CUDA graphs; FlashInfer BF16 in the process)"
    env ${run//,/ } timeout 150 python3 -P probe_tmp/v3_knobs_probe.py --backends triton --formats C4R4,C2R4 \
      --shapes ${S51_SHAPES:-16x8x4096,16x32x32768,16x128x32768} --json "/tmp/s51/graph_${n}.json" 2>&1 | grep -v "^{" | tail -8
  done
  n=0
  for run in ${S51_V3_RUNS-V3_LANES=1 V3_LANES=4,V3_TILE_GROUPS=0 V3_LANES=1 V3_LANES=4,V3_TILE_GROUPS=0}; do
    n=$((n + 1)); echo "=== v3 C4R4 [$run] (CUDA graphs; FlashInfer BF16 in the process)"
    env ${run//,/ } timeout 150 python3 -P probe_tmp/v3_knobs_probe.py --backends triton --formats C4R4 \
      --shapes ${S51_V3_SHAPES:-128x8x4096,128x32x32768,16x32x32768x4} --json "/tmp/s51/graph_v3_${n}.json" 2>&1 | grep -v "^{" | tail -6
  done
  if [ "${S51_MEMCHECK:-1}" = 1 ]; then
    echo "=== memcheck (v2 words, v3 C2R4)"
    timeout 120 compute-sanitizer --tool memcheck $T tests/test_triton_backend.py \
      -k "(v2_code_words and C4R4) or (test_v3_code_words and C2R4 and word_lanes)" 2>&1 | tail -3
  fi
  if [ "${S51_NCU:-1}" = 1 ]; then  # the per-instruction stall table that stop 51's call 2 could not bring back
    echo "=== ncu: kernel v3 C4R4 H128 B32 L8K, source counters (SASS) in the tar"
    timeout ${S51_NCU_S:-150} ncu -k regex:split_kernel_v3 -s 3 -c 1 --clock-control none --import-source yes \
      --section WarpStateStats --section SourceCounters --section SpeedOfLight --export /tmp/s51/v3_c4r4 \
      python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --shapes 128x32x8192 > /tmp/s51/ncu_log.txt 2>&1
    ncu --import /tmp/s51/v3_c4r4.ncu-rep --page source --csv --print-source sass > /tmp/s51/v3_c4r4_sass.csv 2>&1
    ncu --import /tmp/s51/v3_c4r4.ncu-rep --page details --csv > /tmp/s51/v3_c4r4_details.csv 2>&1
    tail -2 /tmp/s51/ncu_log.txt; wc -l /tmp/s51/v3_c4r4_sass.csv
  fi
  tar czf "$OUT/stop51.tgz" -C /tmp s51
elif [ "$MODE" = stop52 ]; then
  # the Hugging Face integration's layers sharing one StepMemo (stop 52, built without a GPU): the allocator and
  # integration tests on the GPU backends (auto: CuPy, then Triton), the no-sync decode steps, and a decode step's time
  # with the memo against each layer its own; every file lands in one tar
  mkdir -p /tmp/s52
  for backend in auto; do  # the tests' tiny models (d_c 64) are below the Triton and CuPy dims: auto runs torch on CUDA
    echo "=== allocator and transformers integration tests, QUANTMLA_TEST_HF_BACKEND=$backend"
    QUANTMLA_TEST_HF_BACKEND=$backend timeout ${S52_TEST_S:-240} $T -rfE tests/test_paged.py \
      tests/test_integration_transformers.py > "/tmp/s52/tests_$backend.txt" 2>&1; echo "rc=$?" >> "/tmp/s52/tests_$backend.txt"
    tail -4 "/tmp/s52/tests_$backend.txt"
  done
  for backend in auto triton; do
    echo "=== a decode step, StepMemo against each layer its own ($backend)"
    timeout ${S52_STEP_S:-150} python3 -P benchmarks/hf_step_probe.py --backend $backend --batches ${S52_BATCHES:-8,32} \
      --prompt ${S52_PROMPT:-2048} 2>&1 | grep -v "^{\|Warning" | tail -4 | tee -a /tmp/s52/step.txt
  done
  tar czf "$OUT/stop52.tgz" -C /tmp s52
elif [ "$MODE" = stop54 ]; then
  mkdir -p /tmp/s54; t0=$(date +%s); left() { echo $(( ${S54_LIMIT:-540} - $(date +%s) + t0 )); }
  echo "=== at once: conformance (three processes), the allocator/integration tests (auto), kernel v4's tests"
  pids=""
  for sel in "v2_code_words or v2_switches" "code_words and not v2" "v3_attention_matches or many_requests or real_shapes and v3"; do
    tag=$(echo "$sel" | tr -c 'A-Za-z0-9\n' _)
    (timeout -k 10 ${S54_CONF_S:-330} $T -rfE tests/test_triton_backend.py -k "$sel" > "/tmp/s54/conf_$tag.txt" 2>&1
     echo "rc=$?" >> "/tmp/s54/conf_$tag.txt") &
    pids="$pids $!"
  done
  (QUANTMLA_TEST_HF_BACKEND=auto timeout -k 10 ${S54_CONF_S:-330} $T -rfE tests/test_paged.py tests/test_integration_transformers.py \
     > /tmp/s54/tests_auto.txt 2>&1; echo "rc=$?" >> /tmp/s54/tests_auto.txt) &
  pids="$pids $!"
  (timeout -k 10 150 $T -x -rfE tests/test_triton_v4.py -k "matches_reference_and_v3 and C4R4 and L63_64_65 and H128" \
     > /tmp/s54/v4_first.txt 2>&1; echo "rc=$?" >> /tmp/s54/v4_first.txt
   grep -q "^rc=0" /tmp/s54/v4_first.txt && timeout -k 10 200 $T -rfE tests/test_triton_v4.py tests/test_triton_v4_offline.py \
     > /tmp/s54/v4_conf.txt 2>&1; echo "rc=$?" >> /tmp/s54/v4_conf.txt) &
  pids="$pids $!"
  wait $pids  # not a bare wait: h200_setup.sh's nvidia-smi logger runs in the background
  for f in /tmp/s54/conf_*.txt /tmp/s54/tests_auto.txt /tmp/s54/v4_first.txt /tmp/s54/v4_conf.txt; do
    [ -e "$f" ] && { echo "--- $f"; grep -E "^FAILED|^ERROR" "$f" | head -8; tail -3 "$f"; }
  done
  if grep -q "^rc=0" /tmp/s54/v4_first.txt && [ "$(left)" -gt 100 ]; then
    echo "=== v3 against v4, CUDA graphs (FlashInfer BF16 in the process)"
    timeout -k 10 $(( $(left) < 200 ? $(left) - 60 : 140 )) python3 -P benchmarks/graph_probe.py --backends triton \
      --formats ${S54_V4_FORMATS:-C4R4,C2R4,BF16} --shapes ${S54_V4_SHAPES:-128x32x32768,128x8x4096} \
      --settings "QUANTMLA_TRITON_ATTENTION=v3;QUANTMLA_TRITON_ATTENTION=v4;QUANTMLA_TRITON_ATTENTION=v4" \
      --json /tmp/s54/graph_v4.json 2>&1 | grep -v "^{" | tail -20
  fi
  if [ "$(left)" -gt 50 ]; then
    echo "=== memcheck (v2 words, v3 C2R4$(grep -q '^rc=0' /tmp/s54/v4_first.txt && echo ', v4'))"
    timeout -k 5 $(( $(left) < 100 ? $(left) - 10 : 90 )) compute-sanitizer --tool memcheck $T tests/test_triton_backend.py \
      -k "(v2_code_words and C4R4) or (test_v3_code_words and C2R4)" > /tmp/s54/memcheck.txt 2>&1; tail -3 /tmp/s54/memcheck.txt
    grep -q "^rc=0" /tmp/s54/v4_first.txt && [ "$(left)" -gt 40 ] && timeout -k 5 $(( $(left) - 10 )) compute-sanitizer \
      --tool memcheck $T tests/test_triton_v4.py -k "C2R4 and L63_64_65 or poisoned" > /tmp/s54/memcheck_v4.txt 2>&1
    [ -e /tmp/s54/memcheck_v4.txt ] && tail -3 /tmp/s54/memcheck_v4.txt
  fi
  tar czf "$OUT/stop54.tgz" -C /tmp s54
elif [ "$MODE" = v4probe ]; then
  mkdir -p /tmp/v4p; t0=$(date +%s); left() { echo $(( ${V4P_LIMIT:-560} - $(date +%s) + t0 )); }
  echo "=== v4: one small case of each build"
  v4_first /tmp/v4p || { tail -30 /tmp/v4p/first.txt; tar czf "$OUT/v4probe.tgz" -C /tmp v4p; exit 1; }
  P=QUANTMLA_TRITON_V4_PROBE
  echo "=== default build against the probe builds (CUDA graphs, FlashInfer BF16 in the process)"
  PYTHONWARNINGS=ignore timeout -k 10 ${V4P_GRAPH_S:-120} python3 -P benchmarks/graph_probe.py --backends triton \
    --formats ${V4P_FORMATS:-C4R4,C2R4} --shapes ${PROBE_SHAPES:-128x32x32768} \
    --settings "$P=0;$P=1;$P=2;$P=3" --json /tmp/v4p/graph.json 2>&1 | grep -v "^{" | tail -30
  echo "=== packed pages: build 1 against 3 (the attender's product retired beside QK, as build 0)"
  timeout -k 10 ${V4P_BUILD_S:-60} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
    --shapes 128x32x32768 --settings "QUANTMLA_TRITON_V4_PIPELINE=1;QUANTMLA_TRITON_V4_PIPELINE=3" \
    --json /tmp/v4p/graph_builds.json 2>&1 | grep -v "^{" | tail -6
  echo "=== BF16 pages: builds 1, 2 (the copy beside the loader's output product) and 3, CuPy's v4 beside them"
  timeout -k 10 ${V4P_BF16_S:-80} python3 -P benchmarks/graph_probe.py --backends triton,cupy --formats BF16 \
    --shapes 128x32x32768 --settings "QUANTMLA_TRITON_V4_PIPELINE=1;QUANTMLA_TRITON_V4_PIPELINE=2;QUANTMLA_TRITON_V4_PIPELINE=3" \
    --json /tmp/v4p/graph_bf16.json 2>&1 | grep -v "^{" | tail -8
  echo "=== every kernel of one call (ncu durations), C2R4 H128 B32 L32K"
  for f in C2R4; do
    timeout -k 5 75 ncu -k regex:"split_kernel_v4|protect_kernel|merge_kernel" -s 6 -c 3 --section SpeedOfLight \
      python3 -P benchmarks/graph_probe.py --backends triton \
      --formats $f --shapes 128x32x32768 > /tmp/v4p/ncu_kernels_$f.txt 2>&1
    grep -E "^  [a-z_0-9]+ \(|Duration" /tmp/v4p/ncu_kernels_$f.txt | head -16
  done
  echo "=== split kernel SASS hot spots (ncu source page), C2R4 and C4R4 H128 B32 L8K"
  for f in C2R4 C4R4; do
    timeout -k 5 100 ncu -k regex:split_kernel_v4 -s 3 -c 1 --section WarpStateStats --section SourceCounters \
      --import-source no -o /tmp/v4p/src_$f python3 -P benchmarks/graph_probe.py --backends triton --formats $f \
      --shapes 128x32x8192 > /tmp/v4p/ncu_src_$f.log 2>&1
    ncu -i /tmp/v4p/src_$f.ncu-rep --page source --csv --print-source sass > /tmp/v4p/sass_$f.csv 2> /tmp/v4p/sass_$f.err
    ncu -i /tmp/v4p/src_$f.ncu-rep --page details --section WarpStateStats 2>&1 | grep -E "Stall|Cycles" | head -12
    rm -f /tmp/v4p/src_$f.ncu-rep
  done
  echo "=== v4 tests"
  timeout -k 10 $(( $(left) - 30 > 20 ? $(left) - 30 : 20 )) $T -rfE tests/test_triton_v4.py > /tmp/v4p/conf.txt 2>&1
  echo "rc=$?" >> /tmp/v4p/conf.txt; grep -E "^FAILED|^ERROR" /tmp/v4p/conf.txt | head -10; tail -3 /tmp/v4p/conf.txt
  tar czf "$OUT/v4probe.tgz" -C /tmp v4p
elif [ "$MODE" = v4inline ]; then
  mkdir -p /tmp/v4i; V=QUANTMLA_TRITON_V4_PIPELINE; W=QUANTMLA_TRITON_V4_LOADER_WARPS; I=QUANTMLA_TRITON_V4_INLINE_PROTECT
  echo "=== inline against the protected-tile kernel, per request, over split counts (benchmarks/v4inline_diag.py)"
  timeout -k 10 ${V4I_DIAG_S:-170} python3 -P benchmarks/v4inline_diag.py ${V4I_DIAG_ARGS:-} > /tmp/v4i/diag.txt 2>&1
  echo "rc=$?" >> /tmp/v4i/diag.txt; grep -cE "BAD|DIFFERS|ERROR" /tmp/v4i/diag.txt; grep -E "BAD|DIFFERS|ERROR" /tmp/v4i/diag.txt | cut -c1-400 | head -30
  echo "=== stop 56's failing case and the empty-last-split case, protected tokens inline (full tracebacks)"
  timeout -k 10 150 $T -rfE --tb=long tests/test_triton_v4.py -k "matches_reference_and_v3 and H128 and (L20000_5_9000 or L300_5) and (1w8 or 1w8p)" \
    > /tmp/v4i/first.txt 2>&1; echo "rc=$?" >> /tmp/v4i/first.txt
  grep -E "^(FAILED|PASSED)|Mismatched|Greatest|^E  " /tmp/v4i/first.txt | head -40; tail -2 /tmp/v4i/first.txt
  echo "=== inline against the protected-tile kernel (CUDA graphs, FlashInfer BF16 in the process)"
  timeout -k 10 ${V4I_GRAPH_S:-150} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4,BF16 \
    --shapes ${V4I_SHAPES:-128x32x32768,128x8x4096,64x32x32768} --settings "$I=0;$I=1" \
    --json /tmp/v4i/graph.json 2>&1 | grep -v "^{" | tail -20
  echo "=== v4 tests, protected tokens inline"
  timeout -k 10 ${V4I_TEST_S:-200} $T -rfE tests/test_triton_v4.py -k "p]" > /tmp/v4i/conf.txt 2>&1
  echo "rc=$?" >> /tmp/v4i/conf.txt; grep -E "^FAILED|^ERROR" /tmp/v4i/conf.txt | head -10; tail -3 /tmp/v4i/conf.txt
  tar czf "$OUT/v4inline.tgz" -C /tmp v4i
elif [ "$MODE" = stop57 ]; then
  mkdir -p /tmp/s57; t0=$(date +%s); left() { echo $(( ${S57_LIMIT:-540} - $(date +%s) + t0 )); }
  I=QUANTMLA_TRITON_V4_INLINE_PROTECT
  echo "=== protected tokens inline against the protected-tile kernel, per request and split count"
  timeout -k 10 ${S57_DIAG_S:-90} python3 -P benchmarks/v4inline_diag.py --formats BF16,C4R4 --builds 1w8 \
    --lens 20000_5_9000,300_5,9000 > /tmp/s57/diag.txt 2>&1; echo "rc=$?" >> /tmp/s57/diag.txt
  grep -cE "BAD|DIFFERS|ERROR" /tmp/s57/diag.txt; grep -E "BAD|DIFFERS|ERROR" /tmp/s57/diag.txt | cut -c1-300 | head -8
  echo "=== v4 tests: the inline builds of the defaults (1w8p, 2w8p), the probes"
  timeout -k 10 ${S57_TEST_S:-250} $T -rfE tests/test_triton_v4.py -k "1w8p or 2w8p or (probe and 1w8)" \
    > /tmp/s57/conf.txt 2>&1; echo "rc=$?" >> /tmp/s57/conf.txt
  grep -E "^FAILED|^ERROR" /tmp/s57/conf.txt | head -10; tail -3 /tmp/s57/conf.txt
  echo "=== the defaults (inline) against the protected-tile kernel (CUDA graphs, FlashInfer BF16 in the process)"
  timeout -k 10 $(( $(left) - 60 > 30 ? $(left) - 60 : 30 )) python3 -P benchmarks/graph_probe.py --backends triton \
    --formats C4R4,C2R4,BF16 --shapes ${S57_SHAPES:-128x128x32768,128x32x32768,128x8x4096} --settings "$I=1;$I=0" \
    --json /tmp/s57/graph.json 2>&1 | grep -v "^{" | tail -20
  echo "=== memcheck: inline, the last splits empty"
  timeout -k 10 $(( $(left) > 20 ? $(left) : 20 )) compute-sanitizer --tool memcheck $T tests/test_triton_v4.py \
    -k "matches_reference_and_v3 and C2R4 and L300_5 and 1w8p" > /tmp/s57/memcheck.txt 2>&1
  echo "rc=$?" >> /tmp/s57/memcheck.txt; tail -4 /tmp/s57/memcheck.txt
  tar czf "$OUT/s57.tgz" -C /tmp s57
elif [ "$MODE" = stop58 ]; then
  # before the call: mkdir -p probe_tmp/triton_main && for f in attention_v4_kernel attention_v4_loaders attention \
  #   attention_kernel common_kernels; do git show main:backends/triton/$f.py > probe_tmp/triton_main/$f.py; done
  mkdir -p /tmp/s58; t0=$(date +%s); left() { echo $(( ${S58_LIMIT:-540} - $(date +%s) + t0 )); }
  CO=QUANTMLA_TRITON_V4_CHANNEL_ORDER
  echo "=== first: the merge kernel's channel order, one small case of each packed format in each order"
  timeout -k 10 150 $T -x -rfE --tb=long tests/test_triton_backend.py tests/test_triton_v4.py -k "merge_channel_order or \
(matches_reference_and_v3 and L63_64_65 and H128 and (C4R4 or C2R4) and (1w8p] or 1w8pc))" > /tmp/s58/first.txt 2>&1
  echo "rc=$?" >> /tmp/s58/first.txt; grep -E "^E  |^FAILED" /tmp/s58/first.txt | head -12; tail -2 /tmp/s58/first.txt
  if grep -q "^rc=0" /tmp/s58/first.txt; then
    for tree in after main; do
      [ $tree = main ] && { [ -d probe_tmp/triton_main ] || continue; triton_tree main; }
      echo "=== Triton's defaults, $tree's sources (CUDA graphs, FlashInfer BF16 in the process)"
      PYTHONPATH=$(tree_path $tree) timeout -k 10 ${S58_GRAPH_S:-110} python3 -P benchmarks/graph_probe.py \
        --backends triton --formats C4R4,C2R4,BF16 --shapes ${S58_SHAPES:-128x8x4096,128x32x4096,128x32x32768,128x128x32768,64x32x32768} \
        --json /tmp/s58/graph_$tree.json 2>&1 | grep -v "^{" | tail -16
    done
    echo "=== the two orders where the rule changes (64 and 128 pages a split)"
    timeout -k 10 ${S58_ORDER_S:-70} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
      --shapes ${S58_ORDER_SHAPES:-128x32x8192,128x32x16384} --settings "$CO=0;$CO=1" \
      --json /tmp/s58/graph_orders.json 2>&1 | grep -v "^{" | tail -8
    echo "=== v4 tests: the channel order's builds (1w8c, 1w8pc, 2w8pc), the plain default's references ($(left) s left)"
    timeout -k 10 $(( $(left) - 45 > 30 ? $(left) - 45 : 30 )) $T -rfE tests/test_triton_v4.py \
      -k "1w8c or 1w8pc or 2w8pc or (matches_reference_and_v3 and 1w8p] and (C4R4 or C2R4))" > /tmp/s58/conf.txt 2>&1
    echo "rc=$?" >> /tmp/s58/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s58/conf.txt | head -10; tail -3 /tmp/s58/conf.txt
    timeout -k 5 40 compute-sanitizer --tool memcheck $T tests/test_triton_v4.py \
      -k "matches_reference_and_v3 and C4R4 and L300_5 and 1w8pc" 2>&1 | tail -2
  fi
  tar czf "$OUT/s58.tgz" -C /tmp s58
elif [ "$MODE" = stop59 ]; then
  # before the call: mkdir -p probe_tmp/triton_main && for f in attention_v4_kernel attention_v4_loaders attention \
  #   attention_kernel common_kernels; do git show main:backends/triton/$f.py > probe_tmp/triton_main/$f.py; done
  mkdir -p /tmp/s59; t0=$(date +%s); left() { echo $(( ${S59_LIMIT:-540} - $(date +%s) + t0 )); }
  P=QUANTMLA_TRITON_V4_PROBE; CO=QUANTMLA_TRITON_V4_CHANNEL_ORDER
  echo "=== first: the merge kernel's order in registers, a small case of the order"
  timeout -k 10 150 $T -x -rfE --tb=long tests/test_triton_backend.py tests/test_triton_v4.py -k "merge_channel_order or \
(matches_reference_and_v3 and L63_64_65 and H128 and 1w8pc)" > /tmp/s59/first.txt 2>&1
  echo "rc=$?" >> /tmp/s59/first.txt; grep -E "^E  |^FAILED" /tmp/s59/first.txt | head -12; tail -2 /tmp/s59/first.txt
  if grep -q "^rc=0" /tmp/s59/first.txt; then
    echo "=== the defaults and probe 4 (no page loads) at ${S59_SHAPES:-128x32x32768} ($(left) s left)"
    timeout -k 10 ${S59_AHEAD_S:-200} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4,BF16 \
      --shapes ${S59_SHAPES:-128x32x32768} --settings "$P=0;$P=4" --json /tmp/s59/graph_ahead.json 2>&1 \
      | grep -v "^{\|RuntimeWarning\|warnings.warn" | tail -14
    for tree in after main; do
      [ $tree = main ] && { [ -d probe_tmp/triton_main ] || continue; triton_tree main; }
      echo "=== $tree: the merge kernel's time with the order forced on (kernel_times, C4R4; $(left) s left)"
      env $CO=1 PYTHONPATH=$(tree_path $tree) timeout -k 10 80 python3 -P benchmarks/kernel_times.py --backends triton \
        --formats C4R4 --shapes 128x8x4096 --json /tmp/s59/kt_$tree.json 2>&1 | grep -v "^{\|profiler\|warn" | tail -6
    done
    echo "=== both orders where the rule changes, with the merge's order in registers ($(left) s left)"
    timeout -k 10 $(( $(left) - 20 > 30 ? $(left) - 20 : 30 )) python3 -P benchmarks/graph_probe.py --backends triton \
      --formats C4R4,C2R4 --shapes ${S59_ORDER_SHAPES:-128x32x8192,128x32x16384} --settings "$CO=0;$CO=1" \
      --json /tmp/s59/graph_orders.json 2>&1 | grep -v "^{" | tail -8
  fi
  tar czf "$OUT/s59.tgz" -C /tmp s59
elif [ "$MODE" = stop60 ]; then
  mkdir -p /tmp/s60; t0=$(date +%s); left() { echo $(( ${S60_LIMIT:-540} - $(date +%s) + t0 )); }
  echo "=== kernel v4's build 4 over every GPU case (4w8p, 4w8pc)"
  timeout -k 10 ${S60_CONF_S:-240} $T -rfE tests/test_triton_v4.py -k "4w8p] or 4w8pc" > /tmp/s60/conf4.txt 2>&1
  echo "rc=$?" >> /tmp/s60/conf4.txt; grep -E "^FAILED|^ERROR" /tmp/s60/conf4.txt | head -10; tail -2 /tmp/s60/conf4.txt
  echo "=== memcheck of build 4 ($(left) s left)"
  timeout -k 5 60 compute-sanitizer --tool memcheck $T tests/test_triton_v4.py \
    -k "matches_reference_and_v3 and C2R4 and L300_5 and 4w8pc" > /tmp/s60/memcheck4.txt 2>&1
  echo "rc=$?" >> /tmp/s60/memcheck4.txt; tail -3 /tmp/s60/memcheck4.txt
  echo "=== Triton's and CuPy's defaults at H128 (CUDA graphs, FlashInfer BF16 in the process; $(left) s left)"
  timeout -k 10 ${S60_GRAPH_S:-150} python3 -P benchmarks/graph_probe.py --backends triton,cupy --formats C4R4,C2R4 \
    --shapes ${S60_SHAPES:-128x8x32768,128x32x32768,128x128x32768} --json /tmp/s60/graph_defaults.json 2>&1 \
    | grep -v "^{" | tail -16
  # CuPy v6's measurement builds (QMLA_V6_PROBE 1: no dequantization, 2: no code loads; wrong outputs)
  KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels; cp "$KDIR/attention_v6.cu" /tmp/attention_v6_kept.cu
  for probe in 1 2; do
    [ $(left) -lt 40 ] && break
    (echo "#define QMLA_V6_PROBE $probe"; cat /tmp/attention_v6_kept.cu) > "$KDIR/attention_v6.cu"
    echo "=== CuPy v6 probe $probe ($(left) s left)"
    timeout -k 5 $(( $(left) - 5 < 70 ? $(left) - 5 : 70 )) python3 -P benchmarks/graph_probe.py --backends cupy \
      --shapes 128x32x32768 --formats C4R4,C2R4 --json /tmp/s60/graph_v6_probe$probe.json 2>&1 | grep -v "^{" | tail -3
  done
  cp /tmp/attention_v6_kept.cu "$KDIR/attention_v6.cu"
  tar czf "$OUT/s60.tgz" -C /tmp s60
elif [ "$MODE" = stop60b ]; then
  # before the call: mkdir -p probe_tmp/cupy_main && for f in backends/cupy/kernels/*; do
  #   git show main:$f > probe_tmp/cupy_main/$(basename $f); done   (main's kernel sources, for the "before" timing)
  mkdir -p /tmp/s60b; t0=$(date +%s); left() { echo $(( ${S60B_LIMIT:-540} - $(date +%s) + t0 )); }
  DQ=QUANTMLA_CUPY_V6_DEQUANTIZERS
  echo "=== first: v6 with two dequantizing warpgroups against the reference"
  timeout -k 10 ${S60B_FIRST_S:-150} $T -x -rfE --tb=long tests/test_cupy_v6.py -k "two_dequantizers_match" \
    > /tmp/s60b/first.txt 2>&1
  echo "rc=$?" >> /tmp/s60b/first.txt; grep -E "^E  |^FAILED" /tmp/s60b/first.txt | head -12
  tail -2 /tmp/s60b/first.txt
  if grep -q "^rc=0" /tmp/s60b/first.txt; then
    echo "=== one and two dequantizers, twice (CUDA graphs, FlashInfer BF16 in the process; $(left) s left)"
    timeout -k 10 ${S60B_GRAPH_S:-170} python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
      --shapes ${S60B_SHAPES:-128x32x32768,128x128x32768,128x8x32768,64x32x32768} --settings "$DQ=1;$DQ=2;$DQ=1;$DQ=2" \
      --json /tmp/s60b/graph_dq.json 2>&1 | grep -v "^{" | tail -34
  fi
  echo "=== v6's GPU tests after the per-role epilogue: defaults, pairs, balanced plans ($(left) s left)"
  timeout -k 10 $(( $(left) - 150 > 60 ? $(left) - 150 : 60 )) $T -rfE tests/test_cupy_v6.py \
    -k "v6_matches_reference or pair_matches or balanced_matches" > /tmp/s60b/conf.txt 2>&1
  echo "rc=$?" >> /tmp/s60b/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s60b/conf.txt | head -10; tail -2 /tmp/s60b/conf.txt
  echo "=== memcheck of two dequantizers ($(left) s left)"
  timeout -k 5 60 compute-sanitizer --tool memcheck $T tests/test_cupy_v6.py \
    -k "two_dequantizers_match and 5000" > /tmp/s60b/memcheck.txt 2>&1
  echo "rc=$?" >> /tmp/s60b/memcheck.txt; tail -3 /tmp/s60b/memcheck.txt
  if [ -d probe_tmp/cupy_main ] && [ $(left) -gt 60 ]; then
    KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels; rm -rf /tmp/kernels_kept; cp -r "$KDIR" /tmp/kernels_kept
    for tree in main after; do
      [ $tree = main ] && cp probe_tmp/cupy_main/* "$KDIR"/
      [ $tree = after ] && cp /tmp/kernels_kept/* "$KDIR"/
      echo "=== $tree's v6 sources, the default build ($(left) s left)"
      timeout -k 5 $(( $(left) / 2 - 5 > 30 ? $(left) / 2 - 5 : 30 )) python3 -P benchmarks/graph_probe.py \
        --backends cupy \
        --formats C4R4,C2R4 --shapes 128x32x32768 --json /tmp/s60b/graph_$tree.json 2>&1 | grep -v "^{" | tail -3
    done
    cp /tmp/kernels_kept/* "$KDIR"/
  fi
  tar czf "$OUT/s60b.tgz" -C /tmp s60b
elif [ "$MODE" = stop60c ]; then
  mkdir -p /tmp/s60c; P=QUANTMLA_TRITON_V4_PROBE; PL=QUANTMLA_TRITON_V4_PIPELINE
  echo "=== kernel v4's builds 1 and 4 with and without page loads (probe 4), H128 B32 L32K C4R4 (CUDA graphs)"
  timeout -k 10 ${S60C_GRAPH_S:-150} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 \
    --shapes 128x32x32768 --settings "$PL=1;$PL=4;$PL=1 $P=4;$PL=4 $P=4;$PL=1;$PL=4" \
    --json /tmp/s60c/graph_loads.json 2>&1 \
    | grep -v "^{\|RuntimeWarning\|warnings.warn" | tail -8
  echo "=== where an eager call's host time goes (cProfile, H128 B8 L4K)"
  timeout -k 10 ${S60C_HOST_S:-120} python3 -P benchmarks/host_profile.py --shape 128x8x4096 --formats C4R4,BF16 \
    --backends triton,cupy --out /tmp/s60c 2>&1 | tail -6
  for f in /tmp/s60c/host_profile_triton_*.txt; do head -40 "$f" | tail -32; done
  tar czf "$OUT/s60c.tgz" -C /tmp s60c
elif [ "$MODE" = stop60d ]; then
  # before the call: mkdir -p probe_tmp/triton_main && git show main:backends/triton/attention.py \
  #   > probe_tmp/triton_main/attention.py   (the launcher before its calls were kept, for the "before" host times)
  mkdir -p /tmp/s60d
  echo "=== kept prepared calls on the GPU, Triton's streams and graphs"
  timeout -k 10 ${S60D_CONF_S:-200} $T -rfE tests/test_triton_prepared.py tests/test_triton_backend.py \
    -k "prepared or reused or bit_identical" > /tmp/s60d/conf.txt 2>&1
  echo "rc=$?" >> /tmp/s60d/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s60d/conf.txt | head -10; tail -2 /tmp/s60d/conf.txt
  for tree in ${S60D_TREES:-main after main after}; do
    [ $tree = main ] && { [ -d probe_tmp/triton_main ] || continue; triton_tree main; }
    echo "=== $tree: eager host time a call (host_profile.py), then eager and graph (graph_probe.py), H128 B8 L4K"
    PYTHONPATH=$(tree_path $tree) timeout -k 5 ${S60D_HOST_S:-60} python3 -P benchmarks/host_profile.py \
      --shape 128x8x4096 --formats C4R4,BF16 --backends triton --calls 500 --out /tmp/s60d/$tree 2>&1 | tail -2
    PYTHONPATH=$(tree_path $tree) timeout -k 5 ${S60D_GRAPH_S:-60} python3 -P benchmarks/graph_probe.py \
      --backends triton \
      --formats C4R4,BF16 --shapes 128x8x4096 --json /tmp/s60d/graph_$tree.json 2>&1 | grep -v "^{" | tail -2
  done
  tar czf "$OUT/s60d.tgz" -C /tmp s60d
elif [ "$MODE" = stop61 ]; then
  mkdir -p /tmp/s61; t0=$(date +%s); left() { echo $(( ${S61_LIMIT:-560} - $(date +%s) + t0 )); }
  PDL=QUANTMLA_CUPY_PDL
  echo "=== first: the PDL tests and the CUDA-graph tests (PDL on by default)"
  if cupy_pdl_first /tmp/s61 ${S61_FIRST_S:-150}; then
    smi_log /tmp/s61
    echo "=== PDL 0 against 1, twice (CUDA graphs; FlashInfer BF16 eager and graph; $(left) s left)"
    timeout -k 10 ${S61_GRAPH_S:-240} python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
      --shapes ${S61_SHAPES:-16x8x4096,16x8x32768,16x32x32768,128x8x4096,128x8x32768,128x32x32768,128x128x32768} \
      --settings "$PDL=0;$PDL=1;$PDL=0;$PDL=1" --json /tmp/s61/graph_pdl.json 2>&1 | grep -v "^{" | tail -60
    smi_stop
    if [ -f probe_tmp/cupy_before/attention.cu ]; then
      # the combine before its batches were pipelined (no griddepcontrol.wait in it: PDL 0 only)
      KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels; cp "$KDIR/attention.cu" /tmp/attention_kept.cu
      n=0
      for tree in before after before after; do
        n=$((n + 1))
        [ $tree = before ] && cp probe_tmp/cupy_before/attention.cu "$KDIR/attention.cu"
        [ $tree = after ] && cp /tmp/attention_kept.cu "$KDIR/attention.cu"
        echo "=== the combine: $tree's attention.cu, PDL 0 ($(left) s left)"
        timeout -k 5 ${S61_COMBINE_S:-45} python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4 \
          --shapes ${S61_COMBINE_SHAPES:-16x8x32768,16x32x32768,128x8x32768} --settings "$PDL=0" \
          --json /tmp/s61/graph_combine_${n}_$tree.json 2>&1 | grep -v "^{" | tail -3
      done
      cp /tmp/attention_kept.cu "$KDIR/attention.cu"
    fi
    echo "=== v5's and v6's GPU conformance with PDL on ($(left) s left)"
    timeout -k 10 $(( $(left) - 10 > 30 ? $(left) - 10 : 30 )) $T -rfE tests/test_cupy_v5.py tests/test_cupy_v6.py \
      -k "v5_matches_reference or v6_matches_reference" > /tmp/s61/conf.txt 2>&1
    echo "rc=$?" >> /tmp/s61/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s61/conf.txt | head -10; tail -2 /tmp/s61/conf.txt
  fi
  tar czf "$OUT/s61.tgz" -C /tmp s61
elif [ "$MODE" = stop61b ]; then
  mkdir -p /tmp/s61b; PDL=QUANTMLA_CUPY_PDL
  echo "=== first: the PDL tests and the CUDA-graph tests"
  if cupy_pdl_first /tmp/s61b ${S61B_FIRST_S:-150}; then
    smi_log /tmp/s61b
    echo "=== PDL 0 against 1, three times (CUDA graphs; FlashInfer BF16 eager and graph)"
    timeout -k 10 ${S61B_GRAPH_S:-200} python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
      --shapes ${S61B_SHAPES:-16x8x4096,16x8x32768,128x8x4096,128x8x32768,128x128x32768} \
      --settings "$PDL=0;$PDL=1;$PDL=0;$PDL=1;$PDL=0;$PDL=1" --json /tmp/s61b/graph_pdl.json 2>&1 \
      | grep -v "^{" | tail -60
    smi_stop
  fi
  tar czf "$OUT/s61b.tgz" -C /tmp s61b
elif [ "$MODE" = stop61c ]; then
  mkdir -p /tmp/s61c
  echo "=== the PDL, combine and CUDA-graph tests, v5's and v6's GPU conformance"
  timeout -k 10 ${S61C_CONF_S:-200} $T -rfE tests/test_cupy_pdl.py tests/test_cupy_combine.py tests/test_cupy_backend.py \
    tests/test_cupy_v5.py tests/test_cupy_v6.py -k "pdl or combine or cuda_graph or v5_matches_reference or \
v6_matches_reference" > /tmp/s61c/conf.txt 2>&1
  echo "rc=$?" >> /tmp/s61c/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s61c/conf.txt | head -10; tail -2 /tmp/s61c/conf.txt
  smi_log /tmp/s61c
  echo "=== the defaults (CUDA graphs; FlashInfer BF16 eager and graph)"
  timeout -k 10 ${S61C_GRAPH_S:-120} python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
    --shapes ${S61C_SHAPES:-128x8x32768,128x32x32768,128x128x32768,16x32x32768,16x128x32768} \
    --json /tmp/s61c/graph_defaults.json 2>&1 | grep -v "^{" | tail -12
  smi_stop
  tar czf "$OUT/s61c.tgz" -C /tmp s61c
elif [ "$MODE" = stop62b ]; then
  # v6 writing the output itself (QUANTMLA_CUPY_V6_MERGE): its tests first (a failure stops there), memcheck, then
  # CUDA graphs of merge 0 against auto (FlashInfer BF16 before and after each shape's rows), SM clock and power logged
  mkdir -p /tmp/s62b; t0=$(date +%s); left() { echo $(( ${S62B_LIMIT:-560} - $(date +%s) + t0 )); }
  smi_log /tmp/s62b
  echo "=== v6's merging clusters the GPU holds at once"
  timeout -k 5 60 python3 -P benchmarks/cluster_report.py --sizes 2,4,8 --json /tmp/s62b/clusters.json 2>&1 | tail -4
  echo "=== first: the merge tests, v6's conformance (the default and merge auto), the combine and PDL tests"
  timeout -k 10 ${S62B_FIRST_S:-240} $T -x -rfE --tb=long tests/test_cupy_v6_merge.py tests/test_cupy_combine.py \
    tests/test_cupy_pdl.py tests/test_cupy_v6.py -k "${S62B_K:-merge or combine or pdl or v6_matches_reference \
or knob_builds_match or balanced_matches or pair_matches}" > /tmp/s62b/first.txt 2>&1
  if tests_report /tmp/s62b/first.txt $?; then
    echo "=== memcheck of the merged cases ($(left) s left)"
    timeout -k 5 70 compute-sanitizer --tool memcheck $T tests/test_cupy_v6_merge.py -k "bit_for_bit and (res8 or res32 \
or C2R4)" > /tmp/s62b/memcheck.txt 2>&1
    echo "rc=$?" >> /tmp/s62b/memcheck.txt; tail -3 /tmp/s62b/memcheck.txt
    M=QUANTMLA_CUPY_V6_MERGE
    echo "=== S62B_SETTINGS: merge 0 against auto (CUDA graphs, FlashInfer BF16 before and after; $(left) s left)"
    timeout -k 10 $(( $(left) - 10 )) python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
      --shapes ${S62B_SHAPES:-128x8x4096,128x8x32768,128x32x32768,128x128x32768} \
      --settings "${S62B_SETTINGS:-$M=0;$M=auto;$M=0;$M=auto;$M=auto QUANTMLA_CUPY_V6_BALANCE=0}" \
      --json /tmp/s62b/graph_merge.json 2>&1 \
      | grep -v "^{" | tail -60
  fi
  smi_stop
  tar czf "$OUT/s62b.tgz" -C /tmp s62b
elif [ "$MODE" = stop70 ]; then
  mkdir -p /tmp/s70; t0=$(date +%s); left() { echo $(( ${S70_LIMIT:-560} - $(date +%s) + t0 )); }
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee /tmp/s70/gpu.txt
  echo "=== v7 probe (PV's operand in registers; B32 L32K's tokens, checked against float64)"
  timeout 120 python3 -P benchmarks/v7_probe.py --json /tmp/s70/v7_probe.jsonl 2>&1 | tail -4
  for k in 1 2; do  # builds that leave out PV (1) or the partial-score exchange (2): what each stage costs
    timeout 60 python3 -P benchmarks/v7_probe.py --skip $k --check 0 --json /tmp/s70/v7_probe.jsonl 2>&1 | tail -2
  done
  echo "=== wgmma_rates (v5's matmuls alone: mode 3; mma.sync: mode 4; $(left) s left)"
  timeout 120 python3 -P benchmarks/wgmma_rates.py --json /tmp/s70/wgmma_rates.jsonl 2>&1 | tail -16
  echo "=== CUDA graphs, defaults ($(left) s left)"
  timeout -k 5 100 python3 -P benchmarks/graph_probe.py --backends ${S70_BACKENDS:-triton,cupy} --formats C4R4,C2R4 \
    --shapes ${S70_SHAPES:-16x32x32768} --json /tmp/s70/graph.json 2>&1 | grep -v "^{" | tail -12
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  SECS="--section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
    --section InstructionStats --section WarpStateStats --section SchedulerStats"
  echo "=== ncu v7 probe ($(left) s left)"
  timeout 90 $NCU -k regex:v7_probe -s 1 -c 1 --clock-control none $SECS python3 -P benchmarks/v7_probe.py --iters 1 \
    --check 0 > /tmp/s70/ncu_v7.txt 2>&1
  grep -v "^==PROF==" /tmp/s70/ncu_v7.txt | grep -E "Duration|L1/TEX|Issued Warp|Warp Cycles Per Issued|Executed Ipc" | head -8
  for f in C4R4 C2R4; do
    [ $(left) -gt 100 ] || break
    echo "=== ncu v5 $f 16x32x32768 ($(left) s left)"
    timeout 100 $NCU -k regex:qmla_attn_v5 -s 2 -c 1 --clock-control none $SECS python3 -P benchmarks/cupy_probe.py \
      --variant v5 --shapes 16x32x32768 --formats $f --no-writer --protection 0,0 > /tmp/s70/ncu_v5_$f.txt 2>&1
    grep -v "^==PROF==" /tmp/s70/ncu_v5_$f.txt | grep -E "Duration|L1/TEX|Issued Warp|Warp Cycles Per Issued" | head -8
  done
  if [ $(left) -gt 60 ]; then
    echo "=== v5's GPU tests ($(left) s left)"
    timeout -k 5 $(( $(left) - 10 )) $T -rfE tests/test_cupy_v5.py tests/test_cupy_v5_loads.py 2>&1 | tail -4 \
      | tee /tmp/s70/v5_tests.txt
  fi
  tar czf "$OUT/s70.tgz" -C /tmp s70
elif [ "$MODE" = stop72 ]; then
  mkdir -p /tmp/s72; t0=$(date +%s); left() { echo $(( ${S72_LIMIT:-560} - $(date +%s) + t0 )); }
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee /tmp/s72/gpu.txt
  echo "=== v8 probe (mma.sync, unscaled key tile; B32 L32K's tokens, checked against float64)"
  timeout 120 python3 -P benchmarks/v8_probe.py --json /tmp/s72/v8_probe.jsonl 2>&1 | tail -4
  for k in 1 2; do  # without PV; without the tile loop's query reads
    timeout 60 python3 -P benchmarks/v8_probe.py --skip $k --check 0 --json /tmp/s72/v8_probe.jsonl 2>&1 | tail -2
  done
  echo "=== v9 probe (warp roles, the queries in registers; checked against float64)"
  timeout 120 python3 -P benchmarks/v9_probe.py --json /tmp/s72/v9_probe.jsonl 2>&1 | tail -4
  timeout 60 python3 -P benchmarks/v9_probe.py --skip 1 --check 0 --json /tmp/s72/v9_probe.jsonl 2>&1 | tail -2
  timeout 60 python3 -P benchmarks/v9_probe.py --qregs 32 --check 1 --json /tmp/s72/v9_probe.jsonl 2>&1 | tail -2
  echo "=== CUDA graphs, CuPy's defaults ($(left) s left)"
  timeout -k 5 100 python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
    --shapes ${S72_SHAPES:-16x32x32768} --json /tmp/s72/graph.json 2>&1 | grep -v "^{" | tail -8
  echo "=== wgmma_rates (modes 3 to 8; $(left) s left)"
  timeout $(( $(left) > 200 ? 150 : $(left) / 2 )) python3 -P benchmarks/wgmma_rates.py \
    --json /tmp/s72/wgmma_rates.jsonl 2>&1 | tail -34
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for v in v8 v9; do
    [ $(left) -gt 80 ] || break
    echo "=== ncu $v probe ($(left) s left)"
    timeout $(( $(left) > 150 ? 90 : $(left) - 10 )) $NCU -k regex:${v}_probe -s 1 -c 1 --clock-control none \
      --section SpeedOfLight --section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis \
      --section InstructionStats --section WarpStateStats --section SchedulerStats \
      python3 -P benchmarks/${v}_probe.py --iters 1 --check 0 > /tmp/s72/ncu_$v.txt 2>&1
    grep -v "^==PROF==" /tmp/s72/ncu_$v.txt \
      | grep -E "Duration|L1/TEX|Issued Warp|Warp Cycles Per Issued|Executed Ipc" | head -8
  done
  tar czf "$OUT/s72.tgz" -C /tmp s72
elif [ "$MODE" = stop64a ] || [ "$MODE" = stop63a ]; then
  mkdir -p /tmp/s64a; t0=$(date +%s); left() { echo $(( ${S64A_LIMIT:-${S63A_LIMIT:-560}} - $(date +%s) + t0 )); }
  smi_log /tmp/s64a
  echo "=== first: ${S64A_TESTS:-tests/test_triton_v5.py} (H16, H40, H1): -k ${S64A_K:-a1p] or a1pc]}"
  timeout -k 10 ${S64A_FIRST_S:-240} $T -x -rfE --tb=long ${S64A_TESTS:-tests/test_triton_v5.py} -k "${S64A_K:-a1p] or a1pc]}" \
    > /tmp/s64a/first.txt 2>&1
  if tests_report /tmp/s64a/first.txt $?; then
    echo "=== memcheck, build ${S64A_MEMCHECK_BUILD:-a1pc} of ${S64A_TESTS:-tests/test_triton_v5.py} ($(left) s left)"
    timeout -k 5 90 compute-sanitizer --tool memcheck $T ${S64A_TESTS:-tests/test_triton_v5.py} -k "matches_reference and H16- and \
L63_64_65 and (C4R4 or C2R4) and ${S64A_MEMCHECK_BUILD:-a1pc}]" > /tmp/s64a/memcheck.txt 2>&1
    echo "rc=$?" >> /tmp/s64a/memcheck.txt; tail -3 /tmp/s64a/memcheck.txt
  fi
  V=QUANTMLA_TRITON_ATTENTION
  echo "=== Triton v2, v4, v5 at few rows (CUDA graphs; CuPy, FlashInfer BF16 in the process; $(left) s left)"
  timeout -k 10 $(( $(left) - ${S64A_MERGE_S:-10} )) python3 -P benchmarks/graph_probe.py \
    --backends ${S64A_BACKENDS:-triton,cupy} --formats ${S64A_FORMATS:-C4R4,C2R4} \
    --shapes ${S64A_SHAPES:-16x32x32768,16x128x32768,16x8x4096,16x32x131072,16x32x32768x2} \
    --settings "${S64A_SETTINGS:-$V=v2;$V=v4;$V=v5;$V=v5 QUANTMLA_TRITON_V5_AHEAD=2}" \
    --json /tmp/s64a/graph_fewrows.json 2>&1 | grep -v "^{" | tail -80
  if [ -n "${S64A_NCU:-}" ] && [ $(left) -gt 40 ]; then
    NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
    echo "=== ncu of ${S64A_NCU_KERNEL:-split_kernel_v6}, ${S64A_NCU_SHAPE:-16x32x32768} C4R4, $S64A_NCU ($(left) s left)"
    env $S64A_NCU timeout -k 5 $(( $(left) - 10 < 120 ? $(left) - 10 : 120 )) $NCU \
      -k regex:${S64A_NCU_KERNEL:-split_kernel_v6} -s 3 -c 1 --clock-control none --section SpeedOfLight \
      --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section Occupancy \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --shapes ${S64A_NCU_SHAPE:-16x32x32768} \
      > /tmp/s64a/ncu.txt 2>&1
    grep -v "^==PROF==" /tmp/s64a/ncu.txt | grep -E "Duration|Issue Slots|Issued Warp|Warp Cycles|Eligible|Active Warps|\
Stall|stalled|Shared|Bank|Pipe|Throughput|Occupancy|Registers" | head -80
  fi
  if [ -n "${S64A_MERGE_SHAPES:-}" ]; then
    M=QUANTMLA_CUPY_V6_MERGE
    echo "=== CuPy merge 0 against auto where a row chunk has one split ($(left) s left)"
    timeout -k 10 $(( $(left) - 10 )) python3 -P benchmarks/graph_probe.py --backends cupy --formats C4R4,C2R4 \
      --shapes $S64A_MERGE_SHAPES --settings "$M=0;$M=auto;$M=0;$M=auto" \
      --json /tmp/s64a/graph_merge1.json 2>&1 | grep -v "^{" | tail -20
  fi
  smi_stop
  tar czf "$OUT/s64a.tgz" -C /tmp s64a
elif [ "$MODE" = stop62a ]; then
  # each kernel's device time of CuPy's defaults at H128 (what the combine and the partials cost), then pdlwaves
  mkdir -p /tmp/s62a
  echo "=== CuPy's kernels at H128 (torch.profiler), FlashInfer BF16 beside"
  timeout -k 10 ${S62A_KT_S:-120} python3 -P benchmarks/kernel_times.py --backends cupy --formats C4R4,C2R4 \
    --shapes ${S62A_KT_SHAPES:-128x8x4096,128x8x32768,128x32x32768,128x128x32768} --json /tmp/s62a/kernel_times.json \
    2>&1 | grep -v "^{\|profiler" | tail -60
  tar czf "$OUT/s62a.tgz" -C /tmp s62a
  bash benchmarks/run_h200_kernels.sh pdlwaves
elif [ "$MODE" = pdlwaves ]; then
  mkdir -p /tmp/pdlw
  smi_log /tmp/pdlw
  for be in ${PDLW_BACKENDS:-triton cupy}; do
    V=QUANTMLA_$(echo "$be" | tr a-z A-Z)_PDL
    echo "=== $be: $V 0 against 1, three times (CUDA graphs, FlashInfer BF16 before and after each shape)"
    timeout -k 10 ${PDLW_S:-200} python3 -P benchmarks/graph_probe.py --backends $be --formats C4R4,C2R4 \
      --shapes ${PDLW_SHAPES:-128x8x32768,128x32x32768,128x128x32768} --settings "$V=0;$V=1;$V=0;$V=1;$V=0;$V=1" \
      --json /tmp/pdlw/graph_$be.json 2>&1 | grep -v "^{" | tail -45
  done
  smi_stop
  tar czf "$OUT/pdlw.tgz" -C /tmp pdlw
elif [ "$MODE" = stop59b ]; then
  mkdir -p /tmp/s59b; t0=$(date +%s); left() { echo $(( ${S59_LIMIT:-540} - $(date +%s) + t0 )); }
  P=QUANTMLA_TRITON_V4_PROBE; CO=QUANTMLA_TRITON_V4_CHANNEL_ORDER; PL=QUANTMLA_TRITON_V4_PIPELINE
  echo "=== first: build 4 (the loader's product in flight) on small cases, its probe builds"
  timeout -k 10 150 $T -x -rfE --tb=long tests/test_triton_v4.py -k "(matches_reference_and_v3 and L63_64_65 and H128 \
and (4w8p] or 4w8pc)) or (probe_builds_keep and 4w8) or (poisoned and 4w8p)" > /tmp/s59b/first.txt 2>&1
  echo "rc=$?" >> /tmp/s59b/first.txt; grep -E "^E  |^FAILED" /tmp/s59b/first.txt | head -12; tail -2 /tmp/s59b/first.txt
  if grep -q "^rc=0" /tmp/s59b/first.txt; then
    echo "=== builds 1 and 4, twice (CUDA graphs, FlashInfer BF16 in the process; $(left) s left)"
    timeout -k 10 ${S59B_BUILD_S:-150} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
      --shapes ${S59B_SHAPES:-128x32x32768,128x128x32768,128x8x4096} --settings "$PL=1;$PL=4;$PL=1;$PL=4" \
      --json /tmp/s59b/graph_builds.json 2>&1 | grep -v "^{" | tail -26
  fi
  echo "=== both channel orders at 8 to 64 pages a split ($(left) s left)"
  timeout -k 10 ${S59B_ORDER_S:-150} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
    --shapes ${S59B_ORDER_SHAPES:-128x8x4096,128x8x8192,128x32x4096,128x8x16384,128x128x4096,128x8x32768} \
    --settings "$CO=0;$CO=1" --json /tmp/s59b/graph_orders.json 2>&1 | grep -v "^{" | tail -26
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  SECS="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section WarpStateStats \
--section SchedulerStats"
  for setting in $P=0 $P=3; do
    [ $(left) -lt 60 ] && break
    echo "=== ncu of kernel v4, H128 B32 L32K C4R4, $setting ($(left) s left)"
    env $setting timeout -k 5 $(( $(left) - 10 < 100 ? $(left) - 10 : 100 )) $NCU -k regex:split_kernel_v4 -s 3 -c 1 \
      --clock-control none $SECS python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 \
      --shapes 128x32x32768 > /tmp/s59b/ncu_$setting.txt 2>&1
    grep -v "^==PROF==" /tmp/s59b/ncu_$setting.txt | grep -E "Duration|Issue Slots Busy|Warp Cycles Per Issued|Shared|Bank|\
Tensor|Pipe|Throughput|Stall" | head -40
  done
  tar czf "$OUT/s59b.tgz" -C /tmp s59b
elif [ "$MODE" = stop58probe ]; then
  mkdir -p /tmp/s58p; P=QUANTMLA_TRITON_V4_PROBE
  echo "=== what v4's defaults wait for: the probe builds (1: no keys, 2: no loader output product, 3: neither)"
  timeout -k 10 ${S58P_PROBE_S:-200} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4,BF16 \
    --shapes ${S58P_SHAPES:-128x32x32768} --settings "$P=0;$P=1;$P=2;$P=3" --json /tmp/s58p/graph_probes.json 2>&1 \
    | grep -v "^{\|RuntimeWarning\|warnings.warn" | tail -14
  echo "=== Triton's defaults against CuPy's (CUDA graphs, FlashInfer BF16 in the process)"
  timeout -k 10 ${S58P_AUTO_S:-200} python3 -P benchmarks/graph_probe.py --backends triton,cupy --formats C4R4,C2R4,BF16 \
    --shapes ${S58P_AUTO_SHAPES:-128x32x32768,128x128x32768} --json /tmp/s58p/graph_auto.json 2>&1 | grep -v "^{" | tail -14
  tar czf "$OUT/s58p.tgz" -C /tmp s58p
elif [ "$MODE" = stop57auto ]; then
  mkdir -p /tmp/s57a
  echo "=== Triton v4 (defaults, protected tokens inline) against CuPy (its defaults): CUDA graphs, FlashInfer BF16"
  timeout -k 10 ${S57A_GRAPH_S:-300} python3 -P benchmarks/graph_probe.py --backends triton,cupy --formats C4R4,C2R4,BF16 \
    --shapes ${S57A_SHAPES:-128x8x4096,128x32x32768,64x32x32768,128x128x32768} --json /tmp/s57a/graph.json 2>&1 \
    | grep -v "^{" | tail -30
  echo "=== the paged and transformers integration tests on CUDA (auto)"
  QUANTMLA_TEST_HF_BACKEND=auto timeout -k 10 ${S57A_HF_S:-150} $T -rfE tests/test_paged.py \
    tests/test_integration_transformers.py > /tmp/s57a/hf_tests.txt 2>&1; echo "rc=$?" >> /tmp/s57a/hf_tests.txt
  grep -E "^FAILED|^ERROR" /tmp/s57a/hf_tests.txt | head -5; tail -2 /tmp/s57a/hf_tests.txt
  tar czf "$OUT/s57a.tgz" -C /tmp s57a
elif [ "$MODE" = stop56 ]; then
  mkdir -p /tmp/s56; t0=$(date +%s); left() { echo $(( ${S56_LIMIT:-550} - $(date +%s) + t0 )); }
  V=QUANTMLA_TRITON_V4_PIPELINE; W=QUANTMLA_TRITON_V4_LOADER_WARPS
  echo "=== v4's defaults (8 loader warps): one small case"
  timeout -k 10 150 $T -x -rfE tests/test_triton_v4.py -k "matches_reference_and_v3 and C4R4 and L63_64_65 and H128 and 1w8" \
    > /tmp/s56/first.txt 2>&1; echo "rc=$?" >> /tmp/s56/first.txt; tail -2 /tmp/s56/first.txt
  if grep -q "^rc=0" /tmp/s56/first.txt; then
    echo "=== 4 loader warps (builds 2, 1) against 8 (build 1) beyond H128 B32 L32K (CUDA graphs, FlashInfer BF16 in the process)"
    timeout -k 10 ${S56_SHAPES_S:-130} python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4,C2R4 \
      --shapes ${S56_SHAPES:-128x128x32768,128x8x4096,64x32x32768} --settings "$V=2 $W=4;$V=1 $W=4;$V=1 $W=8" \
      --json /tmp/s56/graph_shapes.json 2>&1 | grep -v "^{" | tail -20
    echo "=== v4 tests: BF16 pages' 8-warp build 2, the 8-warp probes and poisoned partials"
    timeout -k 10 $(( $(left) - 10 > 20 ? $(left) - 10 : 20 )) $T -rfE tests/test_triton_v4.py \
      -k "(BF16 and 2w8) or (poisoned and w8) or (probe and 1w8)" > /tmp/s56/conf.txt 2>&1
    echo "rc=$?" >> /tmp/s56/conf.txt; grep -E "^FAILED|^ERROR" /tmp/s56/conf.txt | head -10; tail -3 /tmp/s56/conf.txt
  else
    tail -30 /tmp/s56/first.txt
  fi
  tar czf "$OUT/s56.tgz" -C /tmp s56
elif [ "$MODE" = stop55 ]; then
  mkdir -p /tmp/s55; t0=$(date +%s); left() { echo $(( ${S55_LIMIT:-560} - $(date +%s) + t0 )); }
  echo "=== v4: one small case of each build"
  if v4_first /tmp/s55; then
    echo "=== v3, v4, v4 pipelined: CUDA graphs (FlashInfer BF16 in the process)"
    timeout -k 10 ${S55_GRAPH_S:-220} python3 -P benchmarks/graph_probe.py --backends triton --formats ${S55_FORMATS:-C4R4,C2R4,BF16} \
      --shapes ${S55_SHAPES:-128x32x32768,128x8x4096,128x128x32768} \
      --settings "${S55_SETTINGS:-QUANTMLA_TRITON_ATTENTION=v3;QUANTMLA_TRITON_ATTENTION=v4;QUANTMLA_TRITON_ATTENTION=v4 QUANTMLA_TRITON_V4_PIPELINE=1}" \
      --json /tmp/s55/graph.json 2>&1 | grep -v "^{" | tail -40
    hf_pid=""
    if [ "${S55_HF:-0}" = 1 ]; then
      (QUANTMLA_TEST_HF_BACKEND=auto timeout -k 10 200 $T -rfE tests/test_paged.py tests/test_integration_transformers.py \
         > /tmp/s55/hf_tests.txt 2>&1; echo "rc=$?" >> /tmp/s55/hf_tests.txt) &
      hf_pid=$!
    fi
    echo "=== v4 tests"
    timeout -k 10 $(( $(left) - 90 )) $T -rfE tests/test_triton_v4.py > /tmp/s55/conf.txt 2>&1; echo "rc=$?" >> /tmp/s55/conf.txt
    grep -E "^FAILED|^ERROR" /tmp/s55/conf.txt | head -10; tail -3 /tmp/s55/conf.txt
    if [ -n "$hf_pid" ]; then
      wait $hf_pid; echo "--- transformers integration (auto)"; grep -E "^FAILED|^ERROR" /tmp/s55/hf_tests.txt | head -5
      tail -2 /tmp/s55/hf_tests.txt
    fi
    echo "=== v4 memcheck"; timeout -k 5 $(( $(left) < 120 ? $(left) / 2 : 60 )) compute-sanitizer --tool memcheck $T \
      tests/test_triton_v4.py -k "C2R4 and L63_64_65 or poisoned" > /tmp/s55/memcheck.txt 2>&1
    tail -3 /tmp/s55/memcheck.txt
    if [ "$(left)" -gt 40 ]; then
      echo "=== ncu: v4 pipelined C4R4 H128 B32 L8K"
      QUANTMLA_TRITON_ATTENTION=v4 QUANTMLA_TRITON_V4_PIPELINE=1 timeout -k 5 $(( $(left) - 10 )) ncu -k regex:split_kernel_v4 \
        -s 3 -c 1 --section WarpStateStats --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
        python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --shapes 128x32x8192 > /tmp/s55/ncu.txt 2>&1
      grep -v "^==PROF==" /tmp/s55/ncu.txt | grep -A80 "split_kernel_v4" | grep -E "Throughput|Duration|Stall|Warp Cycles|Issued|Eligible|Active|Pipe" | head -30
    fi
  else
    tail -30 /tmp/s55/first.txt
  fi
  tar czf "$OUT/s55.tgz" -C /tmp s55
elif [ "$MODE" = triton_v4 ]; then
  mkdir -p /tmp/v4; t0=$(date +%s); left() { echo $(( ${V4_LIMIT:-560} - $(date +%s) + t0 )); }
  hf_pid=""
  if [ "${V4_HF:-0}" = 1 ]; then  # the transformers integration on CUDA (auto) beside v4's tests, done before the timings
    (QUANTMLA_TEST_HF_BACKEND=auto timeout -k 10 200 $T -rfE tests/test_paged.py tests/test_integration_transformers.py \
       > /tmp/v4/hf_tests.txt 2>&1; echo "rc=$?" >> /tmp/v4/hf_tests.txt) &
    hf_pid=$!
  fi
  echo "=== v4: one small case, then its tests"
  ok=1; v4_first /tmp/v4 || { ok=0; tail -30 /tmp/v4/first.txt; }  # then v3 and the other trees alone
  [ $ok = 1 ] && timeout -k 10 ${V4_CONF_S:-200} $T -rfE tests/test_triton_v4.py > /tmp/v4/conf.txt 2>&1
  echo "rc=$?" >> /tmp/v4/conf.txt
  grep -E "^FAILED|^ERROR" /tmp/v4/conf.txt | head -10; tail -3 /tmp/v4/conf.txt
  if [ -n "$hf_pid" ]; then
    wait $hf_pid; echo "--- transformers integration (auto)"; grep -E "^FAILED|^ERROR" /tmp/v4/hf_tests.txt | head -5
    tail -2 /tmp/v4/hf_tests.txt
  fi
  echo "=== v3 against v4, CUDA graphs (FlashInfer BF16 in the process)"
  timeout -k 10 $(( $(left) - 200 )) python3 -P benchmarks/graph_probe.py --backends triton --formats ${V4_FORMATS:-C4R4,C2R4,BF16} \
    --shapes ${V4_SHAPES:-128x32x32768,128x8x4096,128x128x32768,64x32x32768} \
    --settings "${V4_SETTINGS:-QUANTMLA_TRITON_ATTENTION=v3$([ $ok = 1 ] && echo ';QUANTMLA_TRITON_ATTENTION=v4;QUANTMLA_TRITON_ATTENTION=v4 QUANTMLA_TRITON_V4_PIPELINE=1')}" \
    --json /tmp/v4/graph.json 2>&1 | grep -v "^{" | tail -40
  for ab in ${V4_AB_TREES:-}; do  # NAME:DIR, DIR holding other attention_v4_kernel.py / attention_v4_loaders.py
    name=${ab%%:*}; dir=${ab#*:}; rm -rf /tmp/qm_$name; cp -r /tmp/qm /tmp/qm_$name
    cp $dir/attention_v4_*.py /tmp/qm_$name/quantmla_core/backends/triton/
    echo "=== v4 as in $dir ($name), CUDA graphs"
    QUANTMLA_TRITON_ATTENTION=v4 PYTHONPATH=/tmp/qm_$name:${PYTHONPATH#/tmp/qm:} timeout -k 10 $(( $(left) - 200 )) \
      python3 -P benchmarks/graph_probe.py --backends triton --formats ${V4_AB_FORMATS:-C4R4,BF16} \
      --shapes ${V4_AB_SHAPES:-128x32x32768,128x8x4096} --json /tmp/v4/graph_$name.json 2>&1 | grep -v "^{" | tail -8
  done
  echo "=== CuPy, CUDA graphs"; timeout -k 10 $(( $(left) - 150 )) python3 -P benchmarks/graph_probe.py --backends cupy \
    --formats C4R4,C2R4 --shapes ${V4_SHAPES:-128x32x32768,128x8x4096,128x128x32768,64x32x32768} \
    --json /tmp/v4/graph_cupy.json 2>&1 | grep -v "^{" | tail -10
  echo "=== v4 memcheck"; timeout -k 5 $(( $(left) < 200 ? $(left) / 2 : 90 )) compute-sanitizer --tool memcheck $T \
    tests/test_triton_v4.py -k "C2R4 and L63_64_65 or poisoned or C4R4 and L777" > /tmp/v4/memcheck.txt 2>&1
  tail -3 /tmp/v4/memcheck.txt
  if [ "$(left)" -gt 40 ]; then
    echo "=== ncu: v4 C4R4 H128 B32 L8K"
    QUANTMLA_TRITON_ATTENTION=v4 timeout -k 5 $(( $(left) - 10 )) ncu -k regex:split_kernel_v4 -s 3 -c 1 \
      --section WarpStateStats --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      python3 -P benchmarks/graph_probe.py --backends triton --formats C4R4 --shapes 128x32x8192 > /tmp/v4/ncu.txt 2>&1
    grep -v "^==PROF==" /tmp/v4/ncu.txt | grep -A80 "split_kernel_v4" | grep -E "Throughput|Duration|Stall|Warp Cycles|Issued|Eligible|Active|L2 Hit|Mem" | head -40
  fi
  tar czf "$OUT/v4.tgz" -C /tmp v4
elif [ "$MODE" = v6pair ]; then
  echo "=== v6 pairs: one small case first (a hang or a failure stops here)"; timeout 120 $T tests/test_cupy_v6.py \
    -k "v6_pair_matches and L64_128_192" 2>&1 | tail -2 | tee "$OUT/v6_pair_first.txt"
  grep -q " passed" "$OUT/v6_pair_first.txt" && ! grep -q "failed\|error" "$OUT/v6_pair_first.txt" || exit 1
  echo "=== v6 pairs: conformance (forced pairs; the default build's v6 tests)"; timeout 240 $T tests/test_cupy_v6.py \
    -k "v6_pair_matches or v6_matches" 2>&1 | tail -3 | tee "$OUT/v6_pair_conformance.txt"
  echo "=== 0 against 1 (CUDA graphs)"; timeout 330 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${V6PAIR_SETTINGS:-QUANTMLA_CUPY_V6_PAIR=0;QUANTMLA_CUPY_V6_PAIR=1;QUANTMLA_CUPY_V6_PAIR=0;QUANTMLA_CUPY_V6_PAIR=1}" \
    --formats C4R4,C2R4 --shapes ${V6PAIR_SHAPES:-128x32x32768,128x128x32768,128x32x131072,128x8x4096} \
    --json "$OUT/graph_v6_pair.json" 2>&1 | grep -v "^{" | tail -40
  echo "=== memcheck (pairs)"; QUANTMLA_CUPY_V6_PAIR=1 timeout 150 compute-sanitizer --tool memcheck $T tests/test_cupy_v6.py \
    -k "v6_pair_matches and (L70_9000_200 or L17_31_100 or L2049_33_700 or L40_33 or L900_16)" 2>&1 | tail -2
elif [ "$MODE" = v6fold ]; then
  echo "=== v6 slack + fold: one small case first (a failure stops here)"; timeout 120 $T tests/test_cupy_v6.py \
    -k "v6_slack_fold_match and L64_128_192 and 1-1" 2>&1 | tail -2 | tee "$OUT/v6_fold_first.txt"
  grep -q " passed" "$OUT/v6_fold_first.txt" && ! grep -q "failed\|error" "$OUT/v6_fold_first.txt" || exit 1
  echo "=== v6 slack / fold: conformance (each knob and both; the default build's v6 tests)"; timeout 300 $T \
    tests/test_cupy_v6.py -k "v6_slack_fold_match or v6_matches" 2>&1 | tail -3 | tee "$OUT/v6_fold_conformance.txt"
  S0="QUANTMLA_CUPY_V6_SLACK=0 QUANTMLA_CUPY_V6_ROPE_FOLD=0"; S1="QUANTMLA_CUPY_V6_SLACK=1 QUANTMLA_CUPY_V6_ROPE_FOLD=0"
  F1="QUANTMLA_CUPY_V6_SLACK=0 QUANTMLA_CUPY_V6_ROPE_FOLD=1"; B1="QUANTMLA_CUPY_V6_SLACK=1 QUANTMLA_CUPY_V6_ROPE_FOLD=1"
  echo "=== base / slack / fold / both, twice (CUDA graphs)"; timeout 420 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${V6FOLD_SETTINGS:-$S0;$S1;$F1;$B1;$S0;$S1;$F1;$B1}" --formats C4R4,C2R4 \
    --shapes ${V6FOLD_SHAPES:-128x32x32768,128x128x32768,128x32x131072,128x8x4096} \
    --json "$OUT/graph_v6_fold.json" 2>&1 | grep -v "^{" | tail -70
  echo "=== memcheck (slack + fold)"; QUANTMLA_CUPY_V6_SLACK=1 QUANTMLA_CUPY_V6_ROPE_FOLD=1 timeout 150 compute-sanitizer \
    --tool memcheck $T tests/test_cupy_v6.py -k "v6_matches and (L70_9000_200 or L17_31_100 or L2049_33_700 or L40_33)" 2>&1 | tail -2
elif [ "$MODE" = srcab ]; then
  KDIR=/tmp/qm/quantmla_core/backends/cupy/kernels; K=${SRCAB_KERNEL:-attention_v6.cu}; cp "$KDIR/$K" /tmp/srcab_kept.cu
  n=0
  for src in ${SRCAB_SOURCES:-kept}; do
    n=$((n + 1)); [ "$src" = kept ] && cp /tmp/srcab_kept.cu "$KDIR/$K" || cp "$src" "$KDIR/$K"
    echo "=== $K from $src"; timeout 200 python3 -P benchmarks/graph_probe.py $SRCAB_ARGS \
      --json "$OUT/srcab_${n}_$(basename "$src" .cu).json" 2>&1 | grep -v "^{" | tail -12
  done
  cp /tmp/srcab_kept.cu "$KDIR/$K"
elif [ "$MODE" = v6small ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  for shape in ${V6_SMALL_SHAPES:-128x8x4096 128x32x4096}; do
    echo "=== per-kernel durations, $shape C4R4 (ncu, eager; the first call's launches skipped)"
    timeout 200 $NCU -k regex:qmla -s 3 -c 6 --metrics gpu__time_duration.sum,dram__bytes.sum,sm__cycles_active.avg \
      python3 -P benchmarks/cupy_probe.py --variant v6 --shapes $shape --formats C4R4 --no-writer > "$OUT/ncu_v6small_$shape.txt" 2>&1
    grep -E "qmla_|gpu__time_duration|dram__bytes|sm__cycles_active" "$OUT/ncu_v6small_$shape.txt" | head -40
  done
  echo "=== CUDA graphs"; timeout 300 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "${V6_SMALL_SETTINGS:-QUANTMLA_CUPY_ATTENTION=auto;QUANTMLA_CUPY_PROTECTED_STREAM=0;QUANTMLA_CUPY_ATTENTION=v4}" \
    --formats C4R4,C2R4 --shapes ${V6_SMALL_GRAPH_SHAPES:-128x8x4096,128x32x4096,128x8x32768} \
    --json "$OUT/graph_v6small.json" 2>&1 | grep -v "^{" | tail -40
elif [ "$MODE" = protected ]; then
  echo "=== protected kernel conformance, side stream, graph capture"; timeout 200 $T tests/test_cupy_protected.py \
    tests/test_cupy_v3.py tests/test_cupy_backend.py -k "protected or side_stream or cuda_graph" 2>&1 | tail -3 | tee "$OUT/protected_conformance.txt"
  echo "=== protected kernel racecheck / memcheck"; for tool in racecheck memcheck; do timeout 90 compute-sanitizer --tool $tool \
    $T tests/test_cupy_protected.py -k "match_reference and v3 and (L17_31_100 or L900_16)" 2>&1 | tail -2; done
  V3="QUANTMLA_CUPY_ATTENTION=v3"; V2="QUANTMLA_CUPY_ATTENTION=v2"; SIDE="QUANTMLA_CUPY_PROTECTED_STREAM=1"; SEP="QUANTMLA_CUPY_V2_PROTECTED=separate"
  INL="QUANTMLA_CUPY_V2_PROTECTED=inline"; NOSIDE="QUANTMLA_CUPY_PROTECTED_STREAM=0"
  echo "=== protected launch: one stream vs two (CUDA graphs)"; timeout 300 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "$V3 $NOSIDE;$V3 $SIDE;$V2 $INL;$V2 $SEP $NOSIDE;$V2 $SEP $SIDE" \
    --shapes ${PROT_SHAPES:-16x8x4096,16x32x4096,16x32x32768,16x128x32768,128x32x32768} \
    --formats C4R4 --json "$OUT/graph_protected_kernel.json" 2>&1 | grep -v "^{" | tail -30
elif [ "$MODE" = protected_sweep ]; then
  V3="QUANTMLA_CUPY_ATTENTION=v3"; V2="QUANTMLA_CUPY_ATTENTION=v2"; SIDE="QUANTMLA_CUPY_PROTECTED_STREAM=1"; SEP="QUANTMLA_CUPY_V2_PROTECTED=separate"
  echo "=== no protected tokens (sink = local = 0)"; timeout 120 python3 -P benchmarks/graph_probe.py --backends cupy --protection 0,0 \
    --settings "$V3;$V2" --shapes ${PROT_SHAPES:-16x8x4096,16x32x4096,16x32x32768,16x128x32768,128x32x32768} --formats C4R4 \
    --json "$OUT/graph_no_protection.json" 2>&1 | grep -v "^{" | tail -12
  echo "=== v2 split floor at short contexts"; timeout 90 python3 -P benchmarks/graph_probe.py --backends cupy \
    --settings "$V2 QUANTMLA_CUPY_V2_MIN_TILES=2;$V2 QUANTMLA_CUPY_V2_MIN_TILES=4;$V2 $SEP $SIDE QUANTMLA_CUPY_V2_MIN_TILES=4" \
    --shapes 16x8x4096,16x32x4096 --formats C4R4 --json "$OUT/graph_min_tiles.json" 2>&1 | grep -v "^{" | tail -8
elif [ "$MODE" = check_triton ]; then
  echo "=== triton v2 conformance"; timeout 560 $T tests/test_triton_backend.py -x -k "v2 or variant" 2>&1 | tail -6 | tee "$OUT/triton_v2.txt"
elif [ "$MODE" = writer ]; then
  echo "=== writer conformance"; timeout 150 $T tests/test_writer_rules.py tests/test_triton_backend.py tests/test_cupy_backend.py \
    -k "writ or edges" 2>&1 | tail -3 | tee "$OUT/writer_conformance.txt"
  echo "=== cupy writer memcheck"; timeout 120 compute-sanitizer --tool memcheck $T tests/test_cupy_backend.py -x \
    -k "writer_matches_reference or writer_bf16" 2>&1 | tail -2 | tee "$OUT/writer_memcheck.txt"
  echo "=== writer probe"; timeout 240 python3 -P benchmarks/writer_probe.py --json "$OUT/writer_probe.json" ${WRITER_ARGS:-} 2>&1 | tail -40
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  echo "=== ncu triton writer"; timeout 120 $NCU -k regex:write_kernel -s 3 -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 -P benchmarks/writer_probe.py --configs ${NCU_WRITER_CONFIG:-1x1} > "$OUT/ncu_writer.txt" 2>&1; grep -v "^==PROF==" "$OUT/ncu_writer.txt" | grep -A120 "write_kernel" | head -120
  echo "=== ncu cupy writer"; timeout 120 $NCU -k regex:qmla_write -s 2 -c 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section SchedulerStats --section InstructionStats --section MemoryWorkloadAnalysis --section LaunchStats \
    python3 -P benchmarks/writer_probe.py --configs 1x1 > "$OUT/ncu_cupy_writer.txt" 2>&1; grep -v "^==PROF==" "$OUT/ncu_cupy_writer.txt" | grep -A120 "qmla_write" | head -120
elif [ "$MODE" = profile ]; then
  NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
  SECS="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis"
  echo "=== ncu cupy v2"; timeout 150 $NCU -k regex:qmla_attn_v2 -s 2 -c 1 $SECS python3 -P benchmarks/cupy_probe.py --variant v2 \
    --shapes 16x32x32768 --formats C4R4 --no-writer > "$OUT/ncu_cupy_v2.txt" 2>&1; grep -v "^==PROF==" "$OUT/ncu_cupy_v2.txt" | tail -90
  echo "=== ncu triton v2"; PROBE_VARIANTS=v2 PROBE_PAIRS=32x32768 PROBE_KNOBS=0 PROBE_SKIP_WRITER=1 PROBE_BUDGET_S=60 \
    timeout 150 $NCU -k regex:split_kernel_v2 -s 2 -c 1 $SECS python3 -P benchmarks/triton_probe.py > "$OUT/ncu_triton_v2.txt" 2>&1
  grep -v "^==PROF==" "$OUT/ncu_triton_v2.txt" | grep -A200 "split_kernel_v2" | head -90
elif [ "$MODE" = sweep ]; then
  # tokens per tile (QUANTMLA_CUPY_V2_TILE): 64 halves the per-tile work per token (offline SASS -10 %)
  for tile in ${SWEEP_TILE:-32 64}; do echo "=== cupy v2 tile $tile"; QUANTMLA_CUPY_V2_TILE=$tile timeout 120 \
      python3 -P benchmarks/cupy_probe.py --variant v2 --shapes 16x32x32768,16x128x32768,16x32x131072,16x8x4096,128x32x32768 \
      --formats C4R4,C2R4 --no-writer 2>&1 | grep -E "^v2"; done
  for knobs in ${SWEEP_KNOBS:-QUANTMLA_CUPY_V2_LAZY_RESCALE=0 QUANTMLA_CUPY_V2_LAZY_RESCALE=1}; do
    echo "=== cupy v2 $knobs"; env $knobs timeout 90 python3 -P benchmarks/cupy_probe.py --variant v2 --shapes 16x32x32768,16x128x32768 \
      --formats C4R4 --no-writer 2>&1 | grep -E "^v2" ; done
  # caches without sink/local run the build without the protected path (225 instead of 253 registers):
  # what splitting the protected tokens out of the split kernel would give, and whether 3 CTAs/SM pay there
  for minb in ${SWEEP_NOPROT_MINB:-1 3}; do echo "=== cupy v2 no protection MINB=$minb"; QUANTMLA_CUPY_V2_MINB=$minb timeout 90 \
      python3 -P benchmarks/cupy_probe.py --variant v2 --protection 0,0 --shapes 16x32x32768,16x128x32768 --formats C4R4 \
      --no-writer 2>&1 | grep -E "^v2"; done
  # the same split on every cache: packed-only split kernel + a protected-only launch (QUANTMLA_CUPY_V2_PROTECTED=separate)
  for minb in ${SWEEP_SEPARATE_MINB:-1 3}; do echo "=== cupy v2 separate protected MINB=$minb"; QUANTMLA_CUPY_V2_PROTECTED=separate \
      QUANTMLA_CUPY_V2_MINB=$minb timeout 90 python3 -P benchmarks/cupy_probe.py --variant v2 --shapes 16x32x32768,16x128x32768,16x8x4096 \
      --formats C4R4 --no-writer 2>&1 | grep -E "^v2"; done
  for rg in ${SWEEP_RG:-}; do echo "=== cupy v2 H=128 RG=$rg"; QUANTMLA_CUPY_V2_RG=$rg timeout 90 python3 -P benchmarks/cupy_probe.py --variant v2 \
      --shapes 128x32x32768 --formats C4R4 --no-writer 2>&1 | grep -E "^v2"; done
else
  echo "=== cupy v1 vs v2"; timeout 240 python3 -P benchmarks/cupy_probe.py --variant both --no-writer --json "$OUT/cupy_v1_v2.json" 2>&1 | tail -30
  echo "=== triton v1 vs v2"; PROBE_VARIANTS=v1,v2,v2z PROBE_PAIRS=32x32768,8x4096,128x32768 PROBE_BUDGET_S=250 PROBE_SKIP_WRITER=1 \
    timeout 300 python3 -P benchmarks/triton_probe.py 2>&1 | grep -v '^check' | tail -60
fi
