"""Time (and check) ``benchmarks/v9_probe.cu``: the v8 probe with warp roles, the queries' fragments in registers.

Four scorer warps convert the codes, run QK and the softmax and fill one of two tile buffers (key tile, P', 128 + z
rows); four summer warps run PV from them. Same synthetic layout, defaults, output and checks as ``v8_probe.py``, with
one partial output a CTA (its tiles in order)::

    source benchmarks/h200_setup.sh; python3 -P benchmarks/v9_probe.py --json "$OUT/v9_probe.json"

``--skip 1`` (the summers skip PV) times the scorers alone; its output is wrong, so it is not checked. ``--qregs N``
(default ``QREGS``): the content k-steps whose query fragments a scorer holds in registers; the rest come from shared
memory. Offline, ``python benchmarks/v9_probe.py --sass [--skip N] [--qregs N]`` prints the scorers' and the summers'
tile loops' SASS histograms.
"""
from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import numpy as np

from benchmarks.probe_cli import (check_probe_options, median_launch_us, partial_errors, probe_main, probe_row,
                                  softmax_reference)
from benchmarks.v7_probe import _bf16_to_f64, layout_bytes, make_inputs
from benchmarks.v8_probe import DC, DR, H, KSTEPS, NGC, TILE, exact_keys, query_fragments

SOURCE = Path(__file__).with_name("v9_probe.cu")
SKIPS = {0: "none", 1: "PV"}  # v9_probe.cu's V9_SKIP
#: v9_probe.cu's V9_QREGS: with all 32 content k-steps in registers the scorers spill (148 bytes, stop 72's build);
#: from 29 down they do not, and 26 gave the fewest fixed-wait cycles short of 24 (stop 73's SASS: 841 a tile against
#: 1,083 at 32), for 6 k-steps' loads (96 wavefronts a tile) from shared memory
QREGS = 26


def smem_bytes(qregs: int = QREGS) -> int:
    """v9_probe.cu's shared memory: the query fragments not in registers, two tile buffers (key tile, P', 128 + z
    rows, the summers' factors), the scorers' tile maxima by parity."""
    fragments = KSTEPS + 3 - qregs  # of v8_probe.query_fragments' 36 k-steps and 3 zero-point parts
    return fragments * 32 * 16 + 2 * (TILE * DC * 2 + NGC * H * TILE * 2 + TILE * 16 + H * 4) + 2 * H * 4 * 4


def check_qregs(qregs: int) -> None:
    if not 1 <= qregs <= 32:
        raise ValueError(f"--qregs must be between 1 and 32 (content k-steps), got {qregs}")


def reference_cta(inp: dict[str, np.ndarray], cta: int, tpc: int, sm_scale: float):
    """Normalized output [16, 512] and log2-sum-exp [16] of one CTA's tokens (float64, exact keys)."""
    k = exact_keys(inp, cta * tpc, (cta + 1) * tpc)
    return softmax_reference(_bf16_to_f64(inp["q"]), k, sm_scale, DC)


def run(ctas: int, tpc: int, iters: int, check: int, seed: int = 0, skip: int = 0, qregs: int = QREGS) -> dict:
    check_probe_options(skip, SKIPS, check, tpc, TILE)
    check_qregs(qregs)
    import cupy

    from quantmla_core.backends.cupy import KERNEL_DIR, compile_cubin

    tokens = ctas * tpc
    inp = make_inputs(np.random.default_rng(seed), tokens)
    dev = {k: cupy.asarray(v) for k, v in inp.items()}
    qb = cupy.asarray(query_fragments(inp["q"]))
    out = cupy.full((ctas, 1, H, DC), np.nan, dtype=cupy.float32)
    ml = cupy.full((ctas, 1, H, 2), np.nan, dtype=cupy.float32)
    opts = ("--std=c++17", f"-I{KERNEL_DIR}", f"-I{SOURCE.parent}", f"-DV9_SKIP={skip}", f"-DV9_QREGS={qregs}")
    fn = cupy.RawModule(path=str(compile_cubin(SOURCE.read_text(), opts, "sm_90a"))).get_function("v9_probe")
    fn.max_dynamic_shared_size_bytes = smem_bytes(qregs)
    sm_scale = 1.0 / np.sqrt(DC + DR)
    args = (dev["cc"], dev["rc"], dev["csc"], dev["cze"], dev["rsc"], dev["rze"], qb, out, ml, np.int32(tpc),
            np.float32(sm_scale * np.log2(np.e)))
    us = median_launch_us(lambda: fn((ctas,), (256,), args, shared_mem=smem_bytes(qregs)), iters)
    o, st = out.get().astype(np.float64), ml.get().astype(np.float64)
    err_o, err_lse = partial_errors(o, st, check, lambda cta, _: reference_cta(inp, cta, tpc, sm_scale))
    return probe_row(SKIPS[skip], ctas, tpc, us, layout_bytes(tokens), check, (err_o, err_lse), o) | {"qregs": qregs}


def role_loop_histograms(skip: int = 0, qregs: int = QREGS) -> dict[str, dict[str, int]]:
    """Opcode counts a tile of the scorers' loop (the smallest loop with QK's 72 MMAs and the zero points' 12) and of
    the summers' loop (the one with a barrier that neither stores P' nor writes the output), static: the rare branches
    counted once."""
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    check_qregs(qregs)
    sass, _ = compile_sass_source(SOURCE, {"V9_SKIP": skip, "V9_QREGS": qregs})
    found = loops(sass)
    scorer = min((lp for lp in found if lp.opcodes.get("HMMA") == 84), key=lambda lp: lp.total)
    summers = (lp for lp in found
               if lp.opcodes.get("BAR") and not lp.opcodes.get("STSM") and not lp.opcodes.get("STG"))
    summer = min(summers, key=lambda lp: lp.total)
    return {"scorer": scorer.opcodes, "summer": summer.opcodes}


def _sass_histogram(skip: int, qregs: int = QREGS) -> dict[str, float]:
    hists = role_loop_histograms(skip, qregs)
    print("v9 summers' tile loop: " + ", ".join(f"{op} {n}" for op, n in sorted(hists["summer"].items(),
                                                                           key=lambda kv: -kv[1])[:10]))
    return hists["scorer"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--qregs", type=int, default=QREGS)
    known, rest = ap.parse_known_args(argv)
    description = f"{__doc__.splitlines()[0]} Also --qregs N (1 to 32, default {QREGS}): k-steps held in registers."
    probe_main(rest, description, partial(run, qregs=known.qregs),
               partial(_sass_histogram, qregs=known.qregs), SKIPS,
               f"v9 scorers' tile loop (64 tokens, a warp; {known.qregs} k-steps in registers)", TILE)


if __name__ == "__main__":
    main()
