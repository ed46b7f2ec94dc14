"""Time (and check) ``benchmarks/v8_probe.cu``: H16 decode attention on mma.sync, the scales kept off the values.

The probe reads v7_probe's synthetic token-major C4R4 layout (``layout_bytes`` says how big): one 16-row request
spread over ``--ctas`` CTAs of ``--tpc`` tokens each (the defaults are B32 L32K's 1,048,576 tokens), two workers a
CTA taking alternate 64-token tiles, and writes each worker's unnormalized partial output. Printed: the kernel's
median time over ``--iters`` launches (CUDA events, no combine kernel), the bytes it read and, for ``--check`` CTAs,
the largest error of each worker's normalized output and log-sum-exp against float64 over the exactly dequantized
keys (the probe's keys are exact; its weights ``p s`` are rounded to bf16)::

    source benchmarks/h200_setup.sh; python3 -P benchmarks/v8_probe.py --json "$OUT/v8_probe.json"

``--skip 1`` (no PV) times a build without PV's ldmatrix and MMAs; ``--skip 2`` one whose QK MMAs all take a single
query fragment held in registers (no shared-memory query reads in the tile loop). Their outputs are wrong, so they
are not checked.
Offline (nvcc, cuobjdump, nvdisasm), ``python benchmarks/v8_probe.py --sass [--skip N]`` prints the tile loop's SASS
histogram, a tile at a time.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.probe_cli import (check_probe_options, median_launch_us, partial_errors, probe_main, probe_row,
                                  softmax_reference)
from benchmarks.v7_probe import _bf16_to_f64, layout_bytes, make_inputs
from quantmla_core.reference.quantize import bf16_round, bf16_to_bits

SOURCE = Path(__file__).with_name("v8_probe.cu")
PARTS = Path(__file__).with_name("v8_parts.cuh")  # what v8_probe.cu and v9_probe.cu share
SKIPS = {0: "none", 1: "PV", 2: "query loads"}  # v8_probe.cu's V8_SKIP
H, DC, DR, NGC, TILE, WORKERS, KSTEPS = 16, 512, 64, 8, 64, 2, 36
#: v8_probe.cu's shared memory: the queries' fragments (36 k-steps and 3 for the zero points), then per worker its
#: key tile, P' tiles, 128 + z rows and tile maxima
SMEM_BYTES = (KSTEPS + 3) * 32 * 16 + WORKERS * (TILE * DC * 2 + NGC * H * TILE * 2 + TILE * 16 + H * 4 * 4)
#: a warp's MMAs a tile: zero-point MMAs, QK, PV, PV's zero points
HMMA_PER_TILE = {0: 12 + 72 + 64 + 8, 1: 12 + 72, 2: 12 + 72 + 64 + 8}


def kslot_channel(ks: int, k: int) -> int:
    """The channel that QK's k-slot ``k`` (0..15) of k-step ``ks`` (0..35) holds in v8_probe.cu.

    k-steps 0..31 are content: ``ks = 8 gp + 4 half + e`` reads word e of the lane's 16 bytes ``64 gp + 16 q ..``
    (low nibbles, group gp; high nibbles, group 4 + gp); 32..35 are RoPE, ``32 + 2 half + e``, word e of its 8 bytes
    ``8 q ..``. Slot ``2 q + el`` (+ 8) is nibble pair P0 (P1) of lane q's word: bytes 0 and 2 (1 and 3)."""
    q, el, odd = (k & 7) >> 1, k & 1, k >> 3
    if ks < 32:
        gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
        return 256 * half + 64 * gp + 16 * q + 4 * e + odd + 2 * el
    half, e = (ks - 32) >> 1, (ks - 32) & 1
    return DC + 32 * half + 8 * q + 4 * e + odd + 2 * el


def kstep_group(ks: int) -> int:
    """The scale group (0..7 content, 8 RoPE) of k-step ``ks``."""
    return ks // 8 + 4 * ((ks // 4) % 2) if ks < 32 else NGC


def _pack(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


def query_fragments(q_bits: np.ndarray) -> np.ndarray:
    """[39, 32, 4] uint32: QK's B fragments a k-step and lane (heads g and 8 + g; k-slots 2q, 2q + 1 and 2q + 8,
    2q + 9), then those of minus the heads' per-group query sums in three bf16 parts, largest first (slots 2q, 2q + 1
    are groups 2q, 2q + 1; slot 8 is the RoPE group)."""
    lanes = np.arange(32)
    g, q = lanes >> 2, lanes & 3
    frags = np.zeros((KSTEPS + 3, 32, 4), np.uint32)
    for ks in range(KSTEPS):
        for nb in range(2):
            h = g + 8 * nb
            cols = [np.array([kslot_channel(ks, int(2 * qq + d)) for qq in q]) for d in (0, 1, 8, 9)]
            frags[ks, :, 2 * nb] = _pack(q_bits[h, cols[0]], q_bits[h, cols[1]])
            frags[ks, :, 2 * nb + 1] = _pack(q_bits[h, cols[2]], q_bits[h, cols[3]])
    qf = _bf16_to_f64(q_bits)
    sums = np.concatenate([qf[:, :DC].reshape(H, NGC, DC // NGC).sum(-1), qf[:, DC:].sum(-1, keepdims=True)], axis=1)
    parts, rest = [], -sums
    for _ in range(3):
        parts.append(bf16_to_bits(bf16_round(rest)))
        rest = rest - _bf16_to_f64(parts[-1])
    for kind, bits in enumerate(parts):
        padded = np.concatenate([bits, np.zeros((H, 16 - NGC - 1), np.uint16)], axis=1)  # slots 9..15 hold 0
        for nb in range(2):
            h = g + 8 * nb
            frags[KSTEPS + kind, :, 2 * nb] = _pack(padded[h, 2 * q], padded[h, 2 * q + 1])
            frags[KSTEPS + kind, :, 2 * nb + 1] = _pack(np.where(q == 0, padded[h, 8], 0), np.zeros(32, np.uint16))
    return frags


def exact_keys(inp: dict[str, np.ndarray], lo: int, hi: int) -> np.ndarray:
    """[hi - lo, 576] float64: s (code - z) of tokens lo .. hi - 1, exactly."""
    cc, rc = inp["cc"][lo:hi], inp["rc"][lo:hi]
    content = np.concatenate([cc & 15, cc >> 4], axis=1).astype(np.float64)  # byte j: channels j, j + 256
    rope = np.concatenate([rc & 15, rc >> 4], axis=1).astype(np.float64)     # byte j: channels j, j + 32
    cs = np.repeat(_bf16_to_f64(inp["csc"][lo:hi]), DC // NGC, axis=1)
    cz = np.repeat(inp["cze"][lo:hi].astype(np.float64), DC // NGC, axis=1)
    rs = _bf16_to_f64(inp["rsc"][lo:hi])[:, None]
    rz = inp["rze"][lo:hi].astype(np.float64)[:, None]
    return np.concatenate([cs * (content - cz), rs * (rope - rz)], axis=1)


def reference_worker(inp: dict[str, np.ndarray], cta: int, worker: int, tpc: int, sm_scale: float):
    """Normalized output [16, 512] and log2-sum-exp [16] of one worker's tiles (float64)."""
    tiles = range(worker, tpc // TILE, WORKERS)
    k = np.concatenate([exact_keys(inp, cta * tpc + TILE * t, cta * tpc + TILE * (t + 1)) for t in tiles])
    return softmax_reference(_bf16_to_f64(inp["q"]), k, sm_scale, DC)


def run(ctas: int, tpc: int, iters: int, check: int, seed: int = 0, skip: int = 0) -> dict:
    check_probe_options(skip, SKIPS, check, tpc, TILE * WORKERS)
    import cupy

    from quantmla_core.backends.cupy import KERNEL_DIR, compile_cubin

    tokens = ctas * tpc
    inp = make_inputs(np.random.default_rng(seed), tokens)
    dev = {k: cupy.asarray(v) for k, v in inp.items()}
    qb = cupy.asarray(query_fragments(inp["q"]))
    out = cupy.full((ctas, WORKERS, H, DC), np.nan, dtype=cupy.float32)
    ml = cupy.full((ctas, WORKERS, H, 2), np.nan, dtype=cupy.float32)
    opts = ("--std=c++17", f"-I{KERNEL_DIR}", f"-I{SOURCE.parent}", f"-DV8_SKIP={skip}")  # v8_parts.cuh
    fn = cupy.RawModule(path=str(compile_cubin(SOURCE.read_text(), opts, "sm_90a"))).get_function("v8_probe")
    fn.max_dynamic_shared_size_bytes = SMEM_BYTES
    sm_scale = 1.0 / np.sqrt(DC + DR)
    args = (dev["cc"], dev["rc"], dev["csc"], dev["cze"], dev["rsc"], dev["rze"], qb, out, ml, np.int32(tpc),
            np.float32(sm_scale * np.log2(np.e)))
    us = median_launch_us(lambda: fn((ctas,), (128 * WORKERS,), args, shared_mem=SMEM_BYTES), iters)
    o, st = out.get().astype(np.float64), ml.get().astype(np.float64)
    err_o, err_lse = partial_errors(o, st, check, lambda cta, wk: reference_worker(inp, cta, wk, tpc, sm_scale))
    return probe_row(SKIPS[skip], ctas, tpc, us, layout_bytes(tokens), check, (err_o, err_lse), o)


def tile_loop_histogram(skip: int = 0) -> dict[str, float]:
    """Opcode counts a tile of the probe's tile loop (its largest loop: the tiles after a worker's first, two barriers
    a tile; static: the rescale branch, taken when the reference maximum moves, counted once a tile)."""
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    sass, _ = compile_sass_source(SOURCE, {"V8_SKIP": skip})
    hist = loops(sass)[0].opcodes
    tiles = hist.get("BAR", 0) // 2
    if not tiles:
        raise RuntimeError("the probe's largest loop holds no barrier: not the tile loop")
    return {op: n / tiles for op, n in hist.items()}


def main(argv: list[str] | None = None) -> None:
    probe_main(argv, __doc__.splitlines()[0], run, tile_loop_histogram, SKIPS,
               "v8 probe tile loop (64 tokens, a warp, a tile)", TILE * WORKERS)


if __name__ == "__main__":
    main()
