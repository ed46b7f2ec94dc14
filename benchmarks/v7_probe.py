"""Time (and check) ``benchmarks/v7_probe.cu``: decode attention at H 16 with PV's operand kept in registers.

The probe reads a synthetic token-major C4R4 layout (``layout_bytes`` says how big), one 16-row request spread over
``--ctas`` CTAs of ``--tpc`` tokens each (the defaults are B32 L32K's 1,048,576 tokens), and writes each team's
unnormalized partial output. Printed: the kernel's median time over ``--iters`` launches (CUDA events, no combine
kernel), the bytes it read and, for ``--check`` CTAs, the largest error of each team's normalized output and
log-sum-exp against float64 over the same dequantized (bf16) keys::

    source benchmarks/h200_setup.sh; python3 -P benchmarks/v7_probe.py --json "$OUT/v7_probe.json"

``--skip 1`` (no PV) and ``--skip 2`` (no partial-score exchange) time builds that each leave out one stage; their
outputs are wrong, so they are not checked. Offline (nvcc, cuobjdump, nvdisasm), ``python benchmarks/v7_probe.py
--sass [--skip N]`` prints the tile loop's SASS histogram.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from benchmarks.probe_cli import (check_probe_options, median_launch_us, partial_errors, probe_main, probe_row,
                                  softmax_reference)

SOURCE = Path(__file__).with_name("v7_probe.cu")
SKIPS = {0: "none", 1: "PV", 2: "the partial-score exchange"}  # v7_probe.cu's V7_SKIP
H, DC, DR, CROW, RROW, NGC, TEAMS, TILE = 16, 512, 64, 256, 32, 8, 2, 32


def layout_bytes(tokens: int) -> int:
    """Bytes the probe reads a launch: codes, bf16 scales and u8 zero points (content groups and RoPE)."""
    return tokens * (CROW + RROW + NGC * 3 + 3)


def make_inputs(rng: np.random.Generator, tokens: int) -> dict[str, np.ndarray]:
    """Random codes, zero points, bf16 scales (as uint16 bits) and bf16 queries (bits)."""
    def bf16_bits(x: np.ndarray) -> np.ndarray:
        return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)

    return {"cc": rng.integers(0, 256, (tokens, CROW), dtype=np.uint8),
            "rc": rng.integers(0, 256, (tokens, RROW), dtype=np.uint8),
            "csc": bf16_bits(rng.uniform(0.02, 0.2, (tokens, NGC))), "cze": rng.integers(0, 16, (tokens, NGC),
                                                                                              dtype=np.uint8),
            "rsc": bf16_bits(rng.uniform(0.02, 0.2, tokens)), "rze": rng.integers(0, 16, tokens, dtype=np.uint8),
            "q": bf16_bits(rng.standard_normal((H, DC + DR)))}


def _bf16_to_f64(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def _round_bf16(x: np.ndarray) -> np.ndarray:
    b = x.astype(np.float32).view(np.uint32)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.view(np.float32).astype(np.float64)


def dequantized_keys(inp: dict[str, np.ndarray], lo: int, hi: int) -> np.ndarray:
    """[hi - lo, 576] float64: bf16(s (code - z)) of tokens lo .. hi - 1, as the kernel makes them."""
    cc, rc = inp["cc"][lo:hi], inp["rc"][lo:hi]
    content = np.stack([cc & 15, cc >> 4], axis=-1).reshape(hi - lo, DC).astype(np.float64)
    rope = np.stack([rc & 15, rc >> 4], axis=-1).reshape(hi - lo, DR).astype(np.float64)
    cs = np.repeat(_bf16_to_f64(inp["csc"][lo:hi]), DC // NGC, axis=1)
    cz = np.repeat(inp["cze"][lo:hi].astype(np.float64), DC // NGC, axis=1)
    rs = _bf16_to_f64(inp["rsc"][lo:hi])[:, None]
    rz = inp["rze"][lo:hi].astype(np.float64)[:, None]
    return np.concatenate([_round_bf16(cs * (content - cz)), _round_bf16(rs * (rope - rz))], axis=1)


def reference_team(inp: dict[str, np.ndarray], cta: int, team: int, tpc: int, sm_scale: float):
    """Normalized output [16, 512] and log2-sum-exp [16] of one team's tiles (float64)."""
    tiles = range(team, tpc // TILE, TEAMS)
    k = np.concatenate([dequantized_keys(inp, cta * tpc + TILE * t, cta * tpc + TILE * (t + 1)) for t in tiles])
    return softmax_reference(_bf16_to_f64(inp["q"]), k, sm_scale, DC)


def run(ctas: int, tpc: int, iters: int, check: int, seed: int = 0, skip: int = 0) -> dict:
    check_probe_options(skip, SKIPS, check, tpc, TILE * TEAMS)
    import cupy

    from quantmla_core.backends.cupy import KERNEL_DIR, compile_cubin

    tokens = ctas * tpc
    inp = make_inputs(np.random.default_rng(seed), tokens)
    dev = {k: cupy.asarray(v) for k, v in inp.items()}
    out = cupy.full((ctas, TEAMS, H, DC), np.nan, dtype=cupy.float32)
    ml = cupy.full((ctas, TEAMS, H, 2), np.nan, dtype=cupy.float32)
    opts = ("--std=c++17", f"-I{KERNEL_DIR}", f"-DV7_SKIP={skip}")
    fn = cupy.RawModule(path=str(compile_cubin(SOURCE.read_text(), opts, "sm_90a"))).get_function("v7_probe")
    sm_scale = 1.0 / np.sqrt(DC + DR)
    args = (dev["cc"], dev["rc"], dev["csc"], dev["cze"], dev["rsc"], dev["rze"], dev["q"], out, ml,
            np.int32(tpc), np.float32(sm_scale * np.log2(np.e)))
    us = median_launch_us(lambda: fn((ctas,), (128 * TEAMS,), args), iters)
    o, st = out.get().astype(np.float64), ml.get().astype(np.float64)
    err_o, err_lse = partial_errors(o, st, check, lambda cta, team: reference_team(inp, cta, team, tpc, sm_scale))
    return probe_row(SKIPS[skip], ctas, tpc, us, layout_bytes(tokens), check, (err_o, err_lse), o)


def tile_loop_histogram(skip: int = 0) -> dict[str, int]:
    """Opcode counts of the probe's tile loop (its largest loop; static: the rescale branch counted once)."""
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    sass, _ = compile_sass_source(SOURCE, {"V7_SKIP": skip})
    return loops(sass)[0].opcodes


def main(argv: list[str] | None = None) -> None:
    probe_main(argv, __doc__.splitlines()[0], run, tile_loop_histogram, SKIPS, "v7 probe tile loop (32 tokens, a warp)",
               TILE * TEAMS)


if __name__ == "__main__":
    main()
