"""Instruction budget of the CuPy kernels' hot loops (v2 to v6), from their sm_90 SASS (no GPU needed).

On the H200 the kernel is limited by instructions per cached token, not by bytes
(benchmarks/RESULTS.md: ncu, ~54 % issue-slot use). These tests pin the tile loop of the
pure-tile path (tiles without sink/local tokens: all but a few per request) so a change that
adds work there fails here, before any GPU run. Budgets are the measured counts plus ~6 %.
"""

from __future__ import annotations

import pytest

import quantmla_core as qm
from quantmla_core.backends.cupy.sass_report import missing_tools, tile_loop

pytestmark = pytest.mark.skipif(bool(missing_tools()), reason=f"needs {', '.join(missing_tools())} (nvcc + CUDA binutils)")

#: (format, d_c, d_r, tokens per tile) -> (MMAs per warp per tile, cp.async per thread per tile,
#: instruction budget; measured 2026-11-30: 1,414 / 1,661 instructions at 32 tokens, 2,540 / 2,972
#: at 64). cp.async: the content-code chunks (T x CB / 16 over 128 threads: 4 or 8 for C4, 2 or 4
#: for C2) + the small sections' chunks (one, or two at 64 tokens).
BUDGETS = {("C4R4", 512, 64, 32): (68, 5, 1500), ("C2R4", 512, 64, 32): (68, 3, 1760),
           ("C4R4", 512, 64, 64): (136, 10, 2700), ("C2R4", 512, 64, 64): (136, 6, 3150)}


@pytest.mark.parametrize("name,dc,dr,tile", list(BUDGETS), ids=lambda v: str(v))
def test_pure_tile_loop_within_budget(name, dc, dr, tile):
    loop = tile_loop(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr), tile=tile)
    mmas, copies, budget = BUDGETS[(name, dc, dr, tile)]
    # QK: 8 content k-steps x 4 token groups + 4 RoPE; PV: 16 n-tiles x 2 k-steps (per warp, 32 tokens)
    assert loop.count("HMMA") == mmas, loop.opcodes
    assert loop.total <= budget, f"{name}: {loop.total} instructions per warp per tile (budget {budget}): {loop.opcodes}"
    assert loop.count("LDGSTS") == copies, loop.opcodes
    assert loop.count("LDL", "STL") == 0, "local-memory traffic (spills) in the tile loop"


def test_loop_finder_on_a_known_snippet():
    from quantmla_core.backends.cupy.sass_report import loops

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        "        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0020*/                   IADD3 R2, R2, 0x1, RZ ;",
        "        /*0030*/               @P0 BRA 0x10 ;",
        "        /*0040*/                   EXIT ;",
    ])
    (loop,) = loops(sass)
    assert (loop.start, loop.end, loop.total) == (0x10, 0x30, 3)
    assert loop.count("HMMA") == 1 and loop.count("BRA") == 1


def test_stall_counts_read_from_the_high_words():
    """Each instruction's encoded stall count (bits 105-108: bits 41-44 of the word cuobjdump prints on the next
    line) is summed per opcode; fixed_wait_cycles is what the loop waits beyond one issue cycle per instruction."""
    from quantmla_core.backends.cupy.sass_report import STALL_SHIFT, loops

    def high(stall: int, other: int = 0x000FC00000000000) -> str:
        return f"                                                                      /* 0x{(stall << STALL_SHIFT) | other:016x} */"

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;                   /* 0x00000a0000017a02 */", high(1),
        "        /*0010*/                   UMOV UR19, 0x40000040 ;                  /* 0x4000004000137882 */", high(3),
        "        /*0020*/                   HGMMA.64x16x16.F32.BF16 R32, R28, gdesc[UR16], R32 ; /* 0x0020001c20207df0 */",
        high(1),
        "        /*0030*/               @P0 BRA 0x10 ;                               /* 0x0000000000000947 */", high(5),
        "        /*0040*/                   EXIT ;                                   /* 0x000000000000794d */", high(5),
    ])
    (loop,) = loops(sass)
    assert (loop.start, loop.end, loop.total) == (0x10, 0x30, 3)
    assert loop.stalls == {"UMOV": 3, "HGMMA": 1, "BRA": 5} and loop.fixed_wait_cycles == 9 - 3
    bare = "\n".join(line for line in sass.splitlines() if "/*0" in line)  # no high words: no stall counts
    assert loops(bare)[0].stalls == {} and loops(bare)[0].fixed_wait_cycles == 0


def test_hgmma_gaps_and_load_positions_on_a_known_snippet():
    """hgmma_issue_gaps sums the encoded stalls from one HGMMA to the next (keyed by whether the second reads A from
    registers) and restarts after a barrier; load_positions counts the HGMMAs before each LDG."""
    from quantmla_core.backends.cupy.sass_report import STALL_SHIFT, hgmma_issue_gaps, load_positions, loops

    def ins(addr: int, text: str, stall: int) -> str:
        return (f"        /*{addr:04x}*/                   {text} ;\n"
                f"                                                                      /* 0x{stall << STALL_SHIFT:016x} */")

    sass = "\n".join([
        ins(0x00, "MOV R1, c[0x0][0x28]", 1),
        ins(0x10, "LDG.E.128.CONSTANT R40, desc[UR4][R2.64]", 1),
        ins(0x20, "HGMMA.64x16x16.F32.BF16 R32, R28, gdesc[UR16], R32", 1),
        ins(0x30, "UIADD3.64 UR22, UR18, 0x2, URZ", 9),
        ins(0x40, "HGMMA.64x16x16.F32.BF16 R32, R24, gdesc[UR20], R32", 1),
        ins(0x50, "LDG.E.64.CONSTANT R44, desc[UR4][R2.64+0x40]", 2),
        ins(0x60, "HGMMA.64x16x16.F32.BF16 R48, gdesc[UR24].tnspA, R48", 1),
        ins(0x70, "BAR.SYNC.DEFER_BLOCKING R0, 0x80", 1),
        ins(0x80, "HGMMA.64x16x16.F32.BF16 R48, gdesc[UR28].tnspA, R48", 1),
        ins(0x90, "BRA 0x10", 5),
        ins(0xa0, "EXIT", 5),
    ])
    (loop,) = loops(sass)
    assert dict(hgmma_issue_gaps(sass, loop)) == {(True, 10): 1, (False, 3): 1}
    assert load_positions(sass, loop) == [0, 2]


def test_v5_loads_issue_before_the_tiles_matmuls():
    """v5 issues a tile's loads of the worker's next tile before the tile's first HGMMA (QMLA_V5_EARLY_LOADS: a whole
    tile of latency). Stop 37's rolling reloads, written between QK's chunks, were sunk by ptxas to the last quarter
    of QK and ran 10 % slower: this pins where ptxas puts them in the kept build."""
    from quantmla_core.backends.cupy.sass_report import compile_sass_v5, load_positions, v5_loops

    for name in ("C4R4", "C2R4"):
        sass = compile_sass_v5(qm.PackFormat.parse(name))[0]
        loop = v5_loops(sass)["packed"]
        where = load_positions(sass, loop)
        assert len(where) == loop.count("LDG") >= 15 and set(where) == {0}, (name, where)


def test_v5_loop_fixed_waits_from_a_real_build():
    """The real v5 loop carries stall counts for every instruction: at least one cycle each, at most 15, and
    fixed waits between 0 and 2 cycles an instruction (stop 33: 823 for 1,363 instructions, C4R4; ncu's "wait"
    stall on the H200 was 0.72 cycles an issued instruction)."""
    from quantmla_core.backends.cupy.sass_report import tile_loop_v5

    loop = tile_loop_v5(qm.PackFormat.parse("C4R4"))
    assert set(loop.stalls) == set(loop.opcodes)
    assert loop.total <= sum(loop.stalls.values()) <= 15 * loop.total
    assert 0 < loop.fixed_wait_cycles < 2 * loop.total, (loop.fixed_wait_cycles, loop.total)


def test_lazy_rescale_only_adds_the_warp_vote():
    """``QUANTMLA_CUPY_V2_LAZY_RESCALE=1`` wraps the 64 accumulator multiplies in a warp-uniform
    branch: the loop keeps them (skipped at run time while no row's maximum moves) and gains
    only the vote and the branch."""
    fmt = qm.PackFormat.parse("C4R4")
    base, lazy = tile_loop(fmt), tile_loop(fmt, lazy_rescale=True)
    assert lazy.count("VOTE") >= 1 and base.count("VOTE") == 0
    assert lazy.count("FMUL") == base.count("FMUL") and lazy.count("HMMA") == base.count("HMMA")
    assert lazy.total - base.total <= 16, (base.total, lazy.total)
    assert lazy.count("LDL", "STL") == 0


#: kernel v3, per warp per 64-token tile: (MMAs, cp.async per thread, instruction budget; measured
#: 2026-11-30: C4R4 1,786, C2R4 1,816, with the correction taken out per tile). MMAs: QK 36 k-steps x
#: 2 row n-tiles; PV 16 n-tiles x 4 k-steps + one zero-point correction per (k-step, nibble slice).
V3_BUDGETS = {("C4R4", 512, 64): (72 + 64 + 8, 10, 1880), ("C2R4", 512, 64): (72 + 64 + 16, 6, 1910)}


@pytest.mark.parametrize("name,dc,dr", list(V3_BUDGETS), ids=lambda v: str(v))
def test_v3_tile_loop_within_budget(name, dc, dr):
    from quantmla_core.backends.cupy.sass_report import tile_loop_v3

    loop = tile_loop_v3(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr))
    mmas, copies, budget = V3_BUDGETS[(name, dc, dr)]
    assert loop.count("HMMA") == mmas, loop.opcodes
    assert loop.count("LDGSTS") == copies, loop.opcodes
    assert loop.total <= budget, f"{name}: {loop.total} instructions per warp per tile (budget {budget})"
    assert loop.count("LDL", "STL") == 0, "local-memory traffic (spills) in the tile loop"


#: the CuPy writer's straight-line path per token (benchmarks/writer_sass.py; on the H200 it matched
#: ncu's executed instructions per token within 1 %), measured 2026-11-30: C4R4 461, C2R4 489 (the stop-13 kernel: 667 for C4R4)
WRITER_BUDGETS = {"C4R4": 490, "C2R4": 520}


@pytest.mark.parametrize("name", list(WRITER_BUDGETS))
def test_writer_token_path_within_budget(name):
    from benchmarks import writer_sass

    ins = writer_sass._opcodes(writer_sass.cupy_sass(qm.PackFormat.parse(name), None))
    path = writer_sass.cupy_token_path(ins)
    assert path <= WRITER_BUDGETS[name], f"{name}: {path} instructions on a token's path (budget {WRITER_BUDGETS[name]})"
    truncations = ("F2I.U32.TRUNC.NTZ", "F2I.FTZ.U32.TRUNC.NTZ")  # the second: an -ftz=true build, as the launcher's
    assert not any(op.startswith("F2I") for _, op, _ in ins[:path] if op not in truncations), \
        "a float-to-int conversion per value is back on the token path"


@pytest.mark.parametrize("kernel", ["v2", "v3"])
@pytest.mark.parametrize("name", ["C4R4", "C2R4"])
def test_partial_outputs_leave_as_float4(kernel, name):
    """The split partials go out as float4 rows through shared memory: the kernel's only global
    stores are 16-byte ones (outputs) and 8-byte ones ((m, l) pairs). Scalar stores straight from
    the MMA fragments touched a 32-byte sector per value (H200, stop 15: v2 at B8 L4K 40.5 -> 31.3 us)."""
    import collections
    import re

    from quantmla_core.backends.cupy.sass_report import compile_sass, compile_sass_v3

    fmt = qm.PackFormat.parse(name)
    sass, _ = compile_sass(fmt) if kernel == "v2" else compile_sass_v3(fmt)
    stores = collections.Counter(m.group(1) for m in re.finditer(r"\b(STG\.E[.A-Z0-9]*)\b", sass))
    assert stores["STG.E.128"] >= 1 and set(stores) <= {"STG.E.128", "STG.E.64"}, dict(stores)


#: kernel v4, wgmma build (sm_90a), per warp per 64-token tile (the loop body, both softmax paths):
#: (HGMMA, instruction budget or None; measured 2026-12-01 with nvcc 13.0: C4R4 1,302 / 954, C2R4
#: 1,276 / 892 at d_c 512 / 256). HGMMA: QK (d_c + d_r) / 32 k-steps of one warpgroup's half + 4 PV
#: k-steps. Over bf16 pages the loop copies rows in an inner loop, so only its MMAs are pinned.
V4_BUDGETS = {("C4R4", 512, 64): (22, 1380), ("C2R4", 512, 64): (22, 1350), ("C4R4", 256, 32): (13, 1010),
              ("C2R4", 256, 32): (13, 950), ("BF16", 512, 64): (22, None)}


@pytest.mark.parametrize("name,dc,dr", list(V4_BUDGETS), ids=lambda v: str(v))
def test_v4_wgmma_tile_loop_within_budget(name, dc, dr):
    """The wgmma build's loop: every matmul a Hopper HGMMA (no HMMA), no spills, and the count
    that stop 18's descriptor and dequantization work brought down (1,413 -> 1,264 per warp and
    tile on the unmasked path of C4R4) stays down."""
    from quantmla_core.backends.cupy.sass_report import tile_loop_v4

    loop = tile_loop_v4(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr))
    hgmma, budget = V4_BUDGETS[(name, dc, dr)]
    assert loop.count("HGMMA") == hgmma and loop.count("HMMA") == 0, loop.opcodes
    assert budget is None or loop.total <= budget, f"{name}: {loop.total} instructions per warp per tile (budget {budget})"
    assert loop.count("LDL", "STL") == 0, "local-memory traffic (spills) in the tile loop"


#: kernel v5 per worker warp and 64-token tile (the packed tiles' loop): (HGMMA, instruction budget); stop 22 measured
#: 1,468 / 1,552 / 1,002 / 983 (all paths of the loop body counted, the softmax's second pass included; the lanes
#: load their codes from the pages a tile ahead, with the copy of the loaded registers between tiles; stop 21, with
#: a stage: 1,400 / 1,459 / 930 / 942; stop 26, beside the protected tiles' loop: 1,468 / 1,548 / 999 / 983; stop 29,
#: built with -ftz=true as the launcher builds it (the exponentials lose their subnormal handling), code loads without
#: a predicate and 2-bit content with the RoPE scale folded into the scores: 1,392 / 1,384 / 935 / 879; stop 37, 2-bit
#: content's descriptors advanced by one 64-bit add each (desc_advance64; before: an add and a move of the high word,
#: which 4-bit content keeps): 1,307 / 1,218 / 902 / 814)
V5_BUDGETS = {("C4R4", 512, 64): (68, 1350), ("C2R4", 512, 64): (68, 1260), ("C4R4", 256, 32): (34, 935),
              ("C2R4", 256, 32): (34, 845)}


@pytest.mark.parametrize("name,dc,dr", list(V5_BUDGETS), ids=lambda v: str(v))
def test_v5_tile_loop_within_budget(name, dc, dr):
    """v5's loop: both matmuls HGMMA (QK's (d_c + d_r) / 16 with A from registers, PV's d_c / 16), no
    HMMA, no local memory, and the instruction count that moving the selector out of every prmt and
    storing whole fragments by stmatrix brought down (1,656 -> 1,430 for C4R4) stays down."""
    from quantmla_core.backends.cupy.sass_report import tile_loop_v5

    from quantmla_core.backends.cupy.builds import v5_zfold

    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
    loop = tile_loop_v5(fmt)
    hgmma, budget = V5_BUDGETS[(name, dc, dr)]
    hgmma += 6 * v5_zfold(fmt)  # QMLA_V5_ZFOLD: QK's 2 zero-point k-steps, PV's 4 for their block
    assert loop.count("HGMMA") == hgmma and loop.count("HMMA") == 0, loop.opcodes
    assert loop.total <= budget, f"{name}: {loop.total} instructions per warp per tile (budget {budget})"
    assert loop.count("LDL", "STL") == 0, "local-memory traffic (spills) in the tile loop"


@pytest.mark.parametrize("name", ["C4R4", "C2R4"])
def test_v5_descriptor_advance_knob(name):
    """QMLA_V5_DESC64 (default: 2-bit content only): with 1 the packed loop builds each of its 68 wgmma descriptors by
    one UIADD3.64 instead of a UIADD3 and a UMOV of the high word, 56-57 fewer instructions; the protected loop keeps
    desc_advance either way (ptxas turned 64-bit adds there into four instructions each)."""
    from quantmla_core.backends.cupy.builds import v5_defines
    from quantmla_core.backends.cupy.sass_report import V4_WGMMA_ARCH, _build_sass, v5_loops

    fmt = qm.PackFormat.parse(name)
    built = {}
    for on in (0, 1):
        sass, ptxas = _build_sass("attention_v5.cu", {**v5_defines(fmt), "QMLA_V5_DESC64": on}, V4_WGMMA_ARCH)
        assert "spill stores" not in ptxas or " 0 bytes spill stores" in ptxas, ptxas
        built[on] = v5_loops(sass)
    packed32, prot32 = built[0]["packed"], built[0]["protected"]
    packed64, prot64 = built[1]["packed"], built[1]["protected"]
    from quantmla_core.backends.cupy.builds import v5_zfold

    extra = 6 * v5_zfold(fmt)  # QMLA_V5_ZFOLD's 6 more wgmma, each with its descriptor
    assert packed32.count("UMOV") >= 68 + extra and packed64.count("UMOV") <= 20 + extra, (packed32.opcodes,
                                                                                           packed64.opcodes)
    assert packed32.total - packed64.total >= 50
    # the protected loop's descriptor work is the same (its other code may move a register or so)
    assert (prot32.count("UMOV"), prot32.count("UIADD3")) == (prot64.count("UMOV"), prot64.count("UIADD3"))
    assert abs(prot32.total - prot64.total) <= 4


#: kernel v5's protected-tile loop per worker warp and tile (stop 26): (HGMMA, instruction budget, 4-byte loads);
#: measured 861 / 853 / 639 / 635 instructions, each lane loading its A fragments' bf16 pairs one by one (pairs)
V5_PROTECTED_BUDGETS = {("C4R4", 512, 64): (68, 900, 144), ("C2R4", 512, 64): (68, 900, 144),
                        ("C4R4", 256, 32): (34, 680, 72), ("C2R4", 256, 32): (34, 680, 72)}


@pytest.mark.parametrize("vec", [False, True], ids=["pairs", "vec"])
@pytest.mark.parametrize("name,dc,dr", list(V5_PROTECTED_BUDGETS), ids=lambda v: str(v))
def test_v5_protected_tile_loop_within_budget(name, dc, dr, vec):
    """v5's protected tiles have a loop of their own: the same HGMMA as the packed loop, no dequantization
    (no HADD2), no local memory, and one global load per A-fragment register ((d_c + d_r) / 16 k-steps x 4), or
    with QMLA_V5_PROT_VEC one per token, slice and chunk (a quarter as many at d_c 512; the loaded words moved
    into their fragments cost ~140 instructions)."""
    from quantmla_core.backends.cupy.sass_report import tile_loops_v5

    from quantmla_core.backends.cupy.builds import v5_zfold

    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
    loop = tile_loops_v5(fmt, prot_vec=vec)["protected"]
    hgmma, budget, loads = V5_PROTECTED_BUDGETS[(name, dc, dr)]
    hgmma += 6 * v5_zfold(fmt)  # QMLA_V5_ZFOLD: its zero-point k-steps and PV block run over zeros here too
    assert loop.count("HGMMA") == hgmma and loop.count("HADD2") == 0, loop.opcodes
    assert loads == (dc + dr) // 16 * 4
    if vec:  # content: 4 registers x KCK / SPC words per load (KCK 4: SPC loads a k-step); RoPE: one chunk, 4 loads
        loads = dc // 16 * (2 if name.startswith("C2") else 1) + 4
        budget += 40
    assert loop.count("LDG") == loads, loop.opcodes
    assert loop.total <= budget, f"{name}: {loop.total} instructions per warp per protected tile (budget {budget})"
    assert loop.count("LDL", "STL") == 0, "local-memory traffic (spills) in the protected tile loop"


#: kernel v6 per warp and 64-token tile, by role: (attender HGMMA, attender budget, dequantizer budget). Stop 23
#: measured the attender at 936 / 913 / 737 / 737 instructions (QK's (d_c + d_r) / 16 HGMMA, the softmax, half of
#: PV's 4) and the dequantizer at 1,096 / 1,090 / 715 / 702 (its codes' conversion and stores, half of PV); stop 25
#: (protected tiles in loops of their own) 958 / 964 / 751 / 751 and 1,063 / 1,067 / 699 / 701
V6_BUDGETS = {("C4R4", 512, 64): (40, 990, 1130), ("C2R4", 512, 64): (40, 990, 1125), ("C4R4", 256, 32): (22, 780, 740),
              ("C2R4", 256, 32): (22, 780, 725)}


@pytest.mark.parametrize("dc,dr,saved", [(512, 64, 37), (256, 32, 13)])
def test_v5_codes_in_place_take_fewer_instructions(dc, dr, saved):
    """QMLA_CODES_IN_PLACE (2-bit content; on by default): one prmt per byte pair for all four
    slices and one lop3 per slice, so v5's loop loses most of its prmt (what is left converts the 4-bit RoPE
    codes) and `saved` instructions in all (measured), without spills; 4-bit content builds ignore it."""
    from quantmla_core.backends.cupy.sass_report import tile_loops_v5

    fmt = qm.PackFormat.parse("C2R4", latent_dim=dc, rope_dim=dr)
    old, new = (tile_loops_v5(fmt, codes_in_place=cip)["packed"] for cip in (False, True))
    print(f"C2R4 {dc}/{dr}: v5 {old.total} -> {new.total}")
    assert new.total <= old.total - saved and new.count("PRMT") < old.count("PRMT") / 2, (old.opcodes, new.opcodes)
    assert new.count("LDL", "STL") == 0 and new.count("HGMMA") == old.count("HGMMA")
    c4 = qm.PackFormat.parse("C4R4", latent_dim=dc, rope_dim=dr)
    assert tile_loops_v5(c4, codes_in_place=True)["packed"].opcodes == tile_loops_v5(c4)["packed"].opcodes


@pytest.mark.parametrize("name,dc,dr,saved", [("C4R4", 512, 64, 70), ("C2R4", 512, 64, 70), ("C4R4", 256, 32, 30)])
def test_v5_rope_fold_takes_fewer_instructions(name, dc, dr, saved):
    """QMLA_V5_ROPE_FOLD (on by default): the RoPE codes go into QK as exact (code - z) and their float32 scale
    multiplies each score once, so v5's loop drops the per-value float32 scaling of the RoPE part (its FMUL,
    the bf16 -> float32 moves and the repacking F2FP) and `saved` instructions in all (measured: 72 / 71 / 32),
    without spills, for 8 FFMA a thread."""
    from quantmla_core.backends.cupy.sass_report import tile_loops_v5

    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
    old, new = (tile_loops_v5(fmt, rope_fold=fold, zfold=False)["packed"] for fold in (False, True))
    print(f"{name} {dc}/{dr}: v5 {old.total} -> {new.total}")
    assert new.total <= old.total - saved, (old.opcodes, new.opcodes)
    assert new.count("F2FP") < old.count("F2FP") and new.count("FMUL") <= old.count("FMUL") - dr // 2, new.opcodes
    assert new.count("FFMA") >= old.count("FFMA") + 8 and new.count("HGMMA") == old.count("HGMMA")
    assert new.count("LDL", "STL") == 0


@pytest.mark.parametrize("name,dc,dr", [("C4R4", 512, 64), ("C2R4", 256, 32)])
def test_v6_query_loads_all_go_out_before_their_stores(name, dc, dr):
    """v6's prologue loads a thread's share of the CTA's 64 query rows ((d_c + d_r) / 8 16-byte chunks a row over 256
    threads) into registers, every load before the first store (stop 38: a loop whose every load was stored before
    the next went out cost 18 round trips a thread, ~6 us of a CTA's fixed work on the H200). Each chunk is one of
    two predicated loads (latent or RoPE part)."""
    from quantmla_core.backends.cupy.sass_report import compile_sass_v6

    sass = compile_sass_v6(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr))[0]
    head = sass[:sass.index("BAR.SYNC")]
    chunks = 64 * (dc + dr) // 8 // 256
    assert head.count("STS.128") == chunks and head.count("LDG.E.128") == 2 * chunks, (name, chunks)
    # their order: test_query_prologue_loads_go_out_before_their_stores (v6 among the kernels there)


def _prologue_builds():
    from quantmla_core.backends.cupy.sass_report import (compile_sass, compile_sass_v3, compile_sass_v4,
                                                         compile_sass_v5, compile_sass_v6)

    fmt = qm.PackFormat.parse("C4R4")
    return {"v2": lambda: compile_sass(fmt), "v3": lambda: compile_sass_v3(fmt), "v5": lambda: compile_sass_v5(fmt),
            "v6": lambda: compile_sass_v6(fmt), "v4": lambda: compile_sass_v4(fmt)}


@pytest.mark.parametrize("kernel", ["v2", "v3", "v4", "v5", "v6"])
def test_query_prologue_loads_go_out_before_their_stores(kernel):
    """Each kernel that stages its queries in shared memory issues all of a thread's global loads before its first
    shared store (sass_report.prologue_loads_and_stores reads "L...LS...S"), so the prologue costs one round trip to
    memory, not one per chunk."""
    from quantmla_core.backends.cupy.sass_report import prologue_loads_and_stores

    order = prologue_loads_and_stores(_prologue_builds()[kernel]()[0])
    assert "L" in order and "S" in order and "SL" not in order, order


def test_prologue_order_on_a_known_snippet():
    """The reader on a hand-written listing: loads and stores up to the first barrier, nothing after it."""
    from quantmla_core.backends.cupy.sass_report import prologue_loads_and_stores

    listing = "\n".join(f"        /*{16 * i:04x}*/                   {op} ;" for i, op in enumerate(
        ["LDG.E.128 R4, desc[UR4][R2.64]", "STS.128 [R0], R4", "LDG.E.128 R8, desc[UR4][R2.64+0x10]",
         "STS.128 [R0+0x10], R8", "BAR.SYNC.DEFER_BLOCKING 0x0", "LDG.E R1, desc[UR4][R2.64]", "STS [R0], R1"]))
    assert prologue_loads_and_stores(listing) == "LSLS"


@pytest.mark.parametrize("name,dc,dr", list(V6_BUDGETS), ids=lambda v: str(v))
def test_v6_tile_loops_within_budget(name, dc, dr):
    """v6's tile loops: the attender's holds QK's HGMMA and its half of PV's, the dequantizer's only its half
    of PV's 4 (and no cp.async: protected tiles have a loop of their own, one 16-byte copy per chunk a thread);
    no HMMA, no local memory, and neither loop grows past what the H200 runs were measured on."""
    from quantmla_core.backends.cupy.sass_report import tile_loops_v6

    loops, _regs = tile_loops_v6(qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr))
    hgmma, att_budget, deq_budget = V6_BUDGETS[(name, dc, dr)]
    att, deq = loops["attender"], loops["dequantizer"]
    assert att.count("HGMMA") == hgmma and deq.count("HGMMA") == 4, (att.opcodes, deq.opcodes)
    assert att.count("HMMA") == 0 and deq.count("HMMA") == 0
    prot = loops["protected"]
    assert att.count("LDGSTS") == 0 and deq.count("LDGSTS") == 0, "cp.async: the protected tiles' loop only"
    assert prot.count("LDGSTS") == (dc + dr) // 16 and prot.count("HGMMA") == 4, prot.opcodes
    assert att.total <= att_budget, f"{name}: attender {att.total} instructions per warp per tile (budget {att_budget})"
    assert deq.total <= deq_budget, f"{name}: dequantizer {deq.total} instructions per warp per tile (budget {deq_budget})"
    assert att.count("LDL", "STL") == 0 and deq.count("LDL", "STL") == 0, "local-memory traffic (spills) in a tile loop"


@pytest.mark.parametrize("dc,dr,expected", [(512, 64, [2, 3]), (256, 32, [2, 3, 4])])
def test_report_covers_only_the_v5_worker_counts_that_build(dc, dr, expected):
    """The report's v5 section compiles each worker count that builds (stop 44 made four a choice at d_c 256
    only, and the report asked for it at d_c 512 and stopped with its ValueError)."""
    from quantmla_core.backends.cupy.sass_report import v5_report_workers

    assert v5_report_workers(qm.PackFormat.parse("C4R4", latent_dim=dc, rope_dim=dr)) == expected
