"""Hopper wgmma rates from shared memory on one GPU (CuPy; ``benchmarks/wgmma_rates.cu`` has the modes).

Measures how close a warpgroup MMA shape, or v6's mix of them, runs to the tensor cores' dense bf16 rate
(2,048 multiply-adds a clock per SM on the H200), one CTA per SM, each warpgroup timing its own loop with
``clock64``. Used in stop 34 (benchmarks/RESULTS.md) to tell the MMA shapes' own rates from v6's schedule, and in
stop 70 to time kernel v5's matmuls alone (mode 3) and mma.sync's rate (mode 4; mode 5 with its B operands loaded from
shared memory by ldmatrix, as a kernel shaped like v5 would feed it), and in stop 72 the 8-bit integer rates at the
decode shapes (mode 6: mma.sync m16n8k32; mode 7: wgmma m64n16k32 and m64n32k32 with A from registers) and the
matmuls of an 8-bit design's tile alone (mode 8, as mode 3 is v5's)::

    source benchmarks/h200_setup.sh; python3 -P benchmarks/wgmma_rates.py --json "$OUT/wgmma_rates.jsonl"

Each case prints one JSON line: ``cycles_per_iter`` (warpgroup 0's loop), ``ideal_cycles`` (its
multiply-adds at the dense rate of its type: 2,048 a clock for bf16, 4,096 for 8-bit integers), ``sm_mac_per_clk``
(every warpgroup's multiply-adds in warpgroup 0's window), ``fraction_of_peak`` (of that dense rate) and, in mode 1,
``wg1_iters_per_iter`` (the other warpgroup's PV iterations in that window)."""
from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.probe_cli import emit_json_row

PEAK_MAC_PER_CLK = 2048  # dense bf16 multiply-adds a clock per SM (H100/H200: 4 tensor cores x 512)
INT8_PEAK_MAC_PER_CLK = 2 * PEAK_MAC_PER_CLK  # dense u8/s8 multiply-adds a clock per SM
INT8_MODES = (6, 7, 8)
QK_STEPS = 36            # v6's QK: 576 channels in k-steps of 16
PV_MACS = 4 * 64 * 256 * 16  # one PV half: 4 m64n256k16
V5_MMAS = QK_STEPS + 8 * 4   # mode 3: kernel v5's m64n16k16 a tile (QK, then PV's 8 m-blocks x 4 k-steps)
SYNC_MMAS = 136              # mode 4: m16n8k16 a warp and iteration (a quarter of the channels of a 64-token tile)
#: mode 6: m16n8k32 a warp and iteration: QK of the same quarter tile (64 tokens x 32 columns, the 16 queries split in
#: two 8-bit halves, 144 channels in 4.5 k-steps of 32: 72) and its PV (16 rows x 128 channels x 64 tokens: 32)
SYNC_MMAS8 = 72 + 32
QK_STEPS8 = 18               # modes 7, 8: 576 channels in k-steps of 32
PV8_MMAS = 8 * 2             # mode 8: PV's m64n16k32 a tile (8 content groups x 64 tokens in k-steps of 32)
SMEM_BYTES = (16 + 64 + 80) * 1024 + 1024  # the kernel's layout plus the 1 KB alignment slack
#: (mode, N, warpgroups, stores: mode 1 16-byte stores a thread per PV, mode 3 stmatrix.x4 a warp per tile): QK shapes
#: alone, two warpgroups of them, v6's mix with and without the dequantized tile's stores, QK with A from registers,
#: kernel v5's matmuls (one, two and four workers, with and without its key-tile stores), mma.sync (4, 8, 16 warps an
#: SM), the same fed by ldmatrix, 8-bit mma.sync (4, 8, 16 warps), 8-bit wgmma at N 16 and 32 (one and two warpgroups),
#: the 8-bit design's matmuls (one, two and four workers, with and without its u8 key-tile stores)
CASES = [(0, 64, 1, 0), (0, 128, 1, 0), (0, 256, 1, 0), (0, 64, 2, 0), (0, 128, 2, 0), (0, 256, 2, 0),
         (2, 64, 1, 0), (1, 64, 2, 0), (1, 64, 2, 36), (1, 64, 2, 72),
         (3, 16, 1, 0), (3, 16, 2, 0), (3, 16, 2, 32), (3, 16, 4, 0), (3, 16, 4, 32),
         (4, 8, 1, 0), (4, 8, 2, 0), (4, 8, 4, 0), (5, 8, 1, 0), (5, 8, 2, 0), (5, 8, 4, 0),
         (6, 8, 1, 0), (6, 8, 2, 0), (6, 8, 4, 0), (7, 16, 1, 0), (7, 32, 1, 0), (7, 32, 2, 0),
         (8, 32, 1, 0), (8, 32, 2, 0), (8, 32, 2, 16), (8, 32, 4, 0), (8, 32, 4, 16)]


SOURCE = Path(__file__).with_name("wgmma_rates.cu")


def build_options(mode: int, n: int, wgs: int, stores: int) -> tuple[str, ...]:
    """The ``-D`` options of one case's build of :data:`SOURCE` (its ``WR_*`` macros)."""
    from quantmla_core.backends.cupy import define_options

    return define_options({"WR_MODE": mode, "WR_N": n, "WR_WGS": wgs, "WR_STORES": stores})


def macs_per_iter(mode: int, n: int) -> int:
    """Warpgroup 0's multiply-adds per iteration (modes 0 and 3 to 7: each warpgroup's)."""
    if mode == 6:
        return 4 * SYNC_MMAS8 * 16 * n * 32
    if mode == 7:
        return QK_STEPS8 * 64 * n * 32
    if mode == 8:
        return QK_STEPS8 * 64 * n * 32 + PV8_MMAS * 64 * 16 * 32
    if mode == 3:
        return V5_MMAS * 64 * n * 16
    if mode in (4, 5):
        return 4 * SYNC_MMAS * 16 * n * 16
    qk = QK_STEPS * 64 * n * 16
    return qk + PV_MACS if mode == 1 else qk


def run_case(mode: int, n: int, wgs: int, stores: int, iters: int) -> dict:
    import cupy

    from quantmla_core.backends.cupy import KERNEL_DIR, compile_cubin

    opts = ("--std=c++17", f"-I{KERNEL_DIR}") + build_options(mode, n, wgs, stores)
    fn = cupy.RawModule(path=str(compile_cubin(SOURCE.read_text(), opts, "sm_90a"))).get_function("wgmma_rates")
    fn.max_dynamic_shared_size_bytes = SMEM_BYTES
    sms = cupy.cuda.runtime.getDeviceProperties(0)["multiProcessorCount"]
    out = cupy.zeros(sms * wgs * 128, dtype=cupy.float32)
    cyc = cupy.zeros(sms * wgs + sms, dtype=cupy.int64)
    args = (out, cyc, cupy.int32(iters))
    fn((sms,), (wgs * 128,), args, shared_mem=SMEM_BYTES)  # warm-up
    fn((sms,), (wgs * 128,), args, shared_mem=SMEM_BYTES)
    cupy.cuda.runtime.deviceSynchronize()
    c = cyc.get()
    cycles = float(c[: sms * wgs].reshape(sms, wgs)[:, 0].mean())
    wg1 = float(c[sms * wgs:].mean()) / iters if mode == 1 else None
    macs = macs_per_iter(mode, n)
    total = macs * (1 if mode in (1, 2) else wgs) + (wg1 * PV_MACS if mode == 1 else 0)
    peak = INT8_PEAK_MAC_PER_CLK if mode in INT8_MODES else PEAK_MAC_PER_CLK
    return {"mode": mode, "N": n, "warpgroups": wgs, "stores": stores, "cycles_per_iter": cycles,
            "ideal_cycles": macs / peak, "sm_mac_per_clk": total / cycles, "peak_mac_per_clk": peak,
            "fraction_of_peak": total / cycles / peak, "wg1_iters_per_iter": wg1}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--json", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args(argv)
    for case in CASES:
        emit_json_row(run_case(*case, args.iters), args.json)


if __name__ == "__main__":
    main()
