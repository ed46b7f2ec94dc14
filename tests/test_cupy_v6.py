"""CuPy attention kernel v6 (many query rows on Hopper: one warpgroup dequantizes the next tile while the
other attends to this one, ``kernels/attention_v6.cu``).

CPU: the sm_90a build compiles within its spill allowance and without serialized wgmma at every served format, dims, group
and page size, runs QK as (d_c + d_r) / 16 m64n64k16 and PV as 2 x 4 MN-major MMAs, hands work between
its warpgroups by bar.arrive / bar.sync pairs, and its shared-memory layout matches the launcher's; a
forced v6 runs where it serves and says why elsewhere; the stubbed launch matches the kernel's
signature and adds the protected-only launch. GPU: conformance against the reference (edge lengths,
several requests, S_q > 1, row counts that do not fill a 64-row chunk, every page size, d_c 256)."""

from __future__ import annotations

import re
from functools import lru_cache

import numpy as np
import pytest
import torch
from conformance import Case, check_attention_case
from quantmla_core.backends.cupy.builds import (
    V4_WGMMA_ARCH,
    V6_MAX_SLACK,
    V6_PAIR_AUTO,
    V6_ROPE_FOLD_CONTENT_BITS,
    V6_SLACK,
    protected_ctas,
    smem_per_block,
    v6_defines,
    v6_pairs,
    v6_rope_fold,
    v6_smem_bytes,
)
from quantmla_core.backends.cupy.knobs import V2_MIN_TILES_PER_SPLIT, V6_BALANCE, V6Knobs
from quantmla_core.backends.cupy.plans import V6_BALANCE_CONTENT_BITS, v6_balanced
from quantmla_core.backends.cupy.variants import VARIANT_ENV, select_variant, v6_unsupported_reasons
from test_cupy_backend import (
    BIG,
    NVCC,
    V2_CASES,
    _kernel_params,
    _nvcc_ptx,
    _run_v2_stubbed,
    compile_all,
    compile_cubin_and_ptx,
    gpu,
    ptxas_usage,
)
from test_cupy_v4 import V4_CASES

import quantmla_core as qm
import quantmla_core.backends.cupy.plans as cupy_plans

#: (format, d_c, d_r, group size, page size)
V6_BUILDS = [
    ("C4R4", 512, 64, 64, 64),
    ("C2R4", 512, 64, 64, 64),
    ("C4R4", 512, 64, 128, 16),
    ("C2R4", 512, 64, 128, 128),
    ("C4R4", 256, 32, 64, 32),
    ("C2R4", 256, 32, 32, 64),
]


#: the measurement knobs' builds (V6Knobs pv_at, page_ahead) beside the default (3, False), at d_c 512
V6_KNOB_BUILDS = [(name, pv_at, ahead) for name in ("C4R4", "C2R4") for pv_at in (1, 2, 3) for ahead in (False, True)
                  if (pv_at, ahead) != (3, False)]


#: the two-CTA cluster builds (QMLA_V6_PAIR): both content widths, and d_r 32 (one RoPE chunk a token: half the
#: lanes send RoPE bytes)
V6_PAIR_BUILDS = [("C4R4", 512, 64, 64, 64, 3, False, True), ("C2R4", 512, 64, 64, 64, 3, False, True),
                  ("C4R4", 256, 32, 64, 32, 3, False, True)]


#: the builds with and without a reference maximum that moves by more than V6_MAX_SLACK only and the RoPE scale
#: folded into the scores (V6Knobs slack, rope_fold; the default builds take V6_SLACK and fold by content bits):
#: (format, d_c, d_r, group, page, pv_at, page_ahead, pair, slack, fold)
V6_SLACK_FOLD_BUILDS = [(name, dc, dr, 64, page, 3, False, False, slack, fold)
                        for name, dc, dr, page in (("C4R4", 512, 64, 64), ("C2R4", 512, 64, 64), ("C4R4", 256, 32, 32))
                        for slack, fold in ((False, False), (True, False), (False, True), (True, True))]
#: bytes the folding builds at d_c 512 may spill (stack and stores, loads): the attender's second accumulator takes
#: them to 255 registers, and ptxas keeps two words in local memory (read once per tile in the attender's and the
#: protected loops; offline SASS of stop 31)
V6_FOLD_SPILL_BYTES = (8, 24)


#: the piece-table builds (QMLA_V6_PIECES: balanced plans): C2R4, which QUANTMLA_CUPY_V6_BALANCE=auto balances, C4R4,
#: which =1 may, and d_c 256: (format, d_c, d_r, group size, page size)
V6_PIECES_BUILDS = [("C2R4", 512, 64, 64, 64), ("C4R4", 512, 64, 64, 64), ("C2R4", 256, 32, 32, 64)]
#: bytes C4R4's piece-table build at d_c 512 may spill (stack and stores, loads): what the folding equal-splits build
#: may. Stop 35's build spilled 20 / 72 (ptxas kept words for the tile segments and the partial) and ran 1.7-5.2 %
#: slower on the H200 (its index arithmetic left the uniform datapath), so auto does not balance C4R4
#: (V6_BALANCE_CONTENT_BITS). Since stop 38's query prologue it spills nothing, at 248 registers, and its tile loops are
#: within 3 instructions of the equal-splits build's (offline SASS); not timed since
V6_PIECES_SPILL_BYTES = V6_FOLD_SPILL_BYTES


def _v6_knobs(v: tuple) -> tuple[qm.PackFormat, int, bool, bool, bool, bool | None]:
    """A build tuple's format and knobs (pv_at, page_ahead, pair, slack, fold; unnamed ones the defaults)."""
    name, dc, dr, gs, page, *knobs = v
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
    return (fmt, *(tuple(knobs) + (3, False, False, V6_SLACK, None)[len(knobs):]))


def _compile_v6(v: tuple) -> tuple[int, str, str]:
    fmt, pv_at, ahead, pair, slack, fold = _v6_knobs(v)
    return compile_cubin_and_ptx("attention_v6.cu", V4_WGMMA_ARCH,
                                 v6_defines(fmt, True, pv_at, ahead, pair=pair, slack=slack, rope_fold=fold))


#: ... and the other d_c 512 builds: two words ptxas stores before the query prologue (whose loads all go out before
#: their stores, stop 38: 72 registers a thread for a moment) and reads back in the epilogue, outside the tile loops
#: (test_cupy_sass.py's test_v6_tile_loops_within_budget pins that the loops have no local memory). The H200 ran C2R4
#: 1.5-1.8 % faster with this form than with cp.async copies that spill nothing (stop 38)
V6_PLAIN_SPILL_BYTES = (8, 12)


def _spill_allowance(v: tuple) -> tuple[int, int]:
    """What a build may spill: V6_FOLD_SPILL_BYTES where it folds the RoPE scale at d_c 512, V6_PLAIN_SPILL_BYTES at
    d_c 512 otherwise, nothing at d_c 256."""
    fmt, _pv_at, _ahead, pair, _slack, fold = _v6_knobs(v)
    if fmt.latent_dim != 512:
        return (0, 0)
    return V6_FOLD_SPILL_BYTES if v6_rope_fold(fmt, pair, fold) else V6_PLAIN_SPILL_BYTES


@lru_cache(maxsize=1)
def _compiled_v6() -> dict:
    knob_builds = [(name, 512, 64, 64, 64, pv_at, ahead) for name, pv_at, ahead in V6_KNOB_BUILDS]
    return compile_all(V6_BUILDS + knob_builds + V6_PAIR_BUILDS + V6_SLACK_FOLD_BUILDS, _compile_v6)


def _check_v6_build(build: tuple) -> None:
    rc, text, ptx = _compiled_v6()[build]
    assert rc == 0, f"nvcc failed for v6 {build}:\n{text[-4000:]}"
    assert "warning #" not in text, text
    use = ptxas_usage(text)
    print(f"v6 {build}: {use}")
    stored, loaded = _spill_allowance(build)
    assert use["spill_stores"] <= stored and use["stack"] <= stored and use["spill_loads"] <= loaded, \
        f"v6 {build} spills: {use}"
    assert "C7514" not in text and "C7515" not in text and "serialized" not in text, text
    _name, dc, dr = build[:3]
    qk = "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16"
    pv = f"wgmma.mma_async.sync.aligned.m64n{dc // 2}k16.f32.bf16.bf16"
    assert ptx.count(qk) == (dc + dr) // 16
    # one PV of 4 k-steps per warpgroup: inlined at the attender's and the dequantizer's two loops (packed tiles,
    # protected tiles)
    assert ptx.count(pv) == 3 * 4
    assert ptx.count("wgmma.commit_group.sync.aligned") == 4
    assert "ld.global.nc.v4.u32" in ptx and "mma.sync" not in ptx
    pair = len(build) > 7 and build[7]
    # cp.async only copies the protected bf16 rows (16-byte chunks, zero-filled outside the tile's tokens); pairs
    # send their half of a key tile to the peer by bulk copies
    assert set(re.findall(r"cp\.async[.\w]*", ptx)) == {"cp.async.cg.shared.global", "cp.async.commit_group",
                                                        "cp.async.wait_all"} | ({"cp.async.bulk.shared"} if pair else set())
    arrives = set(re.findall(r"bar(?:rier)?\.arrive(?:\.aligned)? (\S+), 256;", ptx))
    syncs = set(re.findall(r"bar(?:rier)?\.sync(?:\.aligned)? (\S+), 256;", ptx))
    assert arrives and syncs, "named barriers of 256 threads: one side arrives, the other waits"
    assert (".reqnctapercluster 2, 1, 1" in ptx) == pair


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V6_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v6_compiles_without_spills(build):
    """Every served build compiles for sm_90a without spills and without serialized wgmma; QK is
    (d_c + d_r) / 16 m64n64k16 from shared memory (one commit), PV 4 m64n256k16 (m64n128k16 at d_c 256)
    per warpgroup with the key tile read MN-major; the codes come from global memory into registers (no
    stage; cp.async only for the protected bf16 rows), and the six named barriers are used by arrive on one side and sync on the other."""
    _check_v6_build(build)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("knobs", V6_KNOB_BUILDS, ids=lambda v: f"{v[0]}-pv_at{v[1]}-ahead{int(v[2])}")
def test_v6_knob_builds_compile_without_spills(knobs):
    """The builds QUANTMLA_CUPY_V6_PV_AT / _PAGE_AHEAD select hold to the default build's rules."""
    name, pv_at, ahead = knobs
    _check_v6_build((name, 512, 64, 64, 64, pv_at, ahead))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V6_PAIR_BUILDS, ids=lambda v: "-".join(map(str, v[:5])))
def test_v6_pair_builds_compile_without_spills(build):
    """The two-CTA cluster build holds to the default build's rules; it is declared as clusters of 2 CTAs, sends
    its half of each key tile by bulk copies counted on the peer's mbarrier, and hands the key tiles over by
    mbarriers (FULL 4 arrivals with the peer's bytes expected, EMPTY 12) instead of the named barriers 1-4: only P's
    handoffs (5, 6) stay named barriers."""
    _check_v6_build(build)
    ptx = _compiled_v6()[build][2]
    assert "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes" in ptx and "st.async" not in ptx
    assert "mbarrier.arrive.expect_tx.shared::cluster.b64" in ptx and "mbarrier.try_wait.parity.shared::cta.b64" in ptx
    assert "mapa.shared::cluster.u32" in ptx and "barrier.cluster.arrive.release.aligned" in ptx
    consts = dict(re.findall(r"mov\.u32 \s*(%r\d+), (\d+);", ptx))  # the operands arrive in registers

    def values(pattern: str) -> list[int]:
        return sorted(int(consts.get(v, v)) for v in re.findall(pattern, ptx))

    assert values(r"mbarrier\.init\.shared::cta\.b64 \[%r\d+\], (%r\d+|\d+);") == [4, 4, 12, 12]
    assert set(values(r"bar(?:rier)?\.(?:arrive|sync)(?:\.aligned)? (%r\d+|\d+), 256;")) == {5, 6}


@lru_cache(maxsize=1)
def _compiled_v6_pieces() -> dict:
    def build(v: tuple) -> tuple[int, str, str]:
        fmt = _v6_knobs(v)[0]
        return compile_cubin_and_ptx("attention_v6.cu", V4_WGMMA_ARCH, v6_defines(fmt, pieces=True))

    return compile_all(V6_PIECES_BUILDS, build)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V6_PIECES_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v6_pieces_builds_compile(build):
    """The piece-table build compiles for sm_90a without serialized wgmma and within its spill allowance (none at
    d_c 256), reads its table entry twice with one 16-byte load each (at the start, and again for the
    partial, so that the entry does not live across the tiles), and differs from the equal-splits build."""
    rc, text, ptx = _compiled_v6_pieces()[build]
    assert rc == 0, f"nvcc failed for v6 pieces {build}:\n{text[-4000:]}"
    assert "warning #" not in text and "C7514" not in text and "C7515" not in text, text
    use = ptxas_usage(text)
    print(f"v6 pieces {build}: {use}")
    stored, loaded = {("C4R4", 512): V6_PIECES_SPILL_BYTES, ("C2R4", 512): V6_PLAIN_SPILL_BYTES}.get(build[:2], (0, 0))
    assert use["spill_stores"] <= stored and use["stack"] <= stored and use["spill_loads"] <= loaded, use
    assert ptx.count("ld.global.nc.v4.s32") == 2
    assert ptx != _compiled_v6()[build][2] and "ld.global.nc.v4.s32" not in _compiled_v6()[build][2]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V6_SLACK_FOLD_BUILDS, ids=lambda v: f"{v[0]}-{v[1]}-slack{int(v[8])}-fold{int(v[9])}")
def test_v6_slack_fold_builds_compile(build):
    """The slack and RoPE-fold builds hold to the default build's rules (the folding ones at d_c 512 within
    V6_FOLD_SPILL_BYTES of spills), each knob changes the code, and the default build is one of them. Folding keeps
    QK's (d_c + d_r) / 16 k-steps and converts the RoPE codes to exact (code - z) by one bf16x2 fma a pair instead of
    packing float32 products."""
    *shape, slack, fold = build
    _check_v6_build(build)
    ptx = _compiled_v6()[build][2]
    base = _compiled_v6()[(*shape, False, False)][2]
    assert (ptx != base) == (slack or fold)
    # the default build is the one of V6_SLACK and the content bits' fold
    fmt = _v6_knobs(build)[0]
    if (slack, fold) == (V6_SLACK, fmt.content_bits in V6_ROPE_FOLD_CONTENT_BITS):
        assert ptx == _compiled_v6()[tuple(shape[:5])][2]
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == (fmt.latent_dim + fmt.rope_dim) // 16
    # the RoPE chunk's float32 products a thread no longer packs (per inlined conversion site)
    cvt, base_cvt = ptx.count("cvt.rn.bf16x2.f32"), base.count("cvt.rn.bf16x2.f32")
    assert cvt < base_cvt if fold else cvt == base_cvt


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("name", ["C4R4", "C2R4"])
def test_v6_plain_loads_where_not_folding(name):
    """QMLA_V6_PLAIN_LOADS follows the fold: a build that does not fold looks a tile's page up once with 64-token pages
    (the three tokens a thread loads share it) and loads the codes without a guard, so it has fewer 4-byte global loads
    (the block-table reads) than the folding build, which keeps the per-token lookups and guarded loads (with the fold's
    second accumulator the plain loads spilled into the attender's loop: C4R4 3-4 % slower on the H200, stop 31)."""
    table = {}
    for fold in (False, True):
        ptx = _compiled_v6()[(name, 512, 64, 64, 64, 3, False, False, True, fold)][2]
        table[fold] = len(re.findall(r"ld\.global\.nc\.u32\s", ptx))
    assert 0 < table[False] < table[True], table


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
def test_v6_knob_builds_differ():
    """Each knob changes the code (a knob the preprocessor ignored would compile to the default PTX)."""
    base = _compiled_v6()[("C4R4", 512, 64, 64, 64)][2]
    for pv_at, ahead in ((1, False), (2, False), (3, True)):
        assert _compiled_v6()[("C4R4", 512, 64, 64, 64, pv_at, ahead)][2] != base, (pv_at, ahead)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
def test_v6_refuses_other_targets(arch):
    """Built for anything but sm_90a (the only target with wgmma), the
    source stops with wgmma.cuh's message instead of producing a kernel; the launcher never asks (v6 is
    served on compute capability 9.0 only, as sm_90a)."""
    rc, text = _nvcc_ptx("attention_v6.cu", v6_defines(qm.PackFormat.parse("C4R4")), arch)
    assert rc != 0 and "wgmma.cuh needs sm_90a" in text, text[-2000:]


def test_v6_smem_layout():
    # C4R4: two key tiles and the queries (9 column blocks x 64 rows x 128 B each), P 64 x 128 B, three
    # rows of 64 floats, 1 KB to align the base: just under the 227 KB an SM gives one block
    fmt = qm.PackFormat.parse("C4R4")
    tile = 9 * 64 * 128
    assert v6_smem_bytes(fmt) == 3 * tile + 64 * 128 + 3 * 64 * 4 + 1024 == 231_168 <= smem_per_block((9, 0))
    assert v6_smem_bytes(qm.PackFormat.parse("C2R4")) == v6_smem_bytes(fmt)
    small = qm.PackFormat.parse("C4R4", 256, 32)
    assert v6_smem_bytes(small) == 3 * 5 * 64 * 128 + 64 * 128 + 3 * 64 * 4 + 1024
    # pairs: four 8-byte mbarriers more, still inside one SM's 227 KB
    assert v6_smem_bytes(fmt, pair=True) == v6_smem_bytes(fmt) + 32 <= smem_per_block((9, 0))
    assert v6_defines(fmt, pair=True)["QMLA_V6_SMEM"] == v6_smem_bytes(fmt, pair=True)
    # the RoPE fold: both key tiles' token scales (float [2][64]) more, still inside; C4R4 folds by default, C2R4 not
    assert v6_smem_bytes(fmt, rope_fold=True) == v6_smem_bytes(fmt) + 512 <= smem_per_block((9, 0))
    assert v6_defines(fmt)["QMLA_V6_SMEM"] == v6_smem_bytes(fmt, rope_fold=True) == v6_defines(fmt, rope_fold=True)["QMLA_V6_SMEM"]
    assert v6_defines(fmt, rope_fold=False)["QMLA_V6_SMEM"] == v6_smem_bytes(fmt)
    c2 = qm.PackFormat.parse("C2R4")
    assert v6_defines(c2)["QMLA_V6_SMEM"] == v6_smem_bytes(c2) and v6_defines(c2)["QMLA_V6_ROPE_FOLD"] == 0
    with pytest.raises(ValueError, match="pair builds do not fold"):
        v6_defines(fmt, pair=True, rope_fold=True)


def test_v6_unsupported_reasons():
    c4 = qm.PackFormat.parse("C4R4")
    assert v6_unsupported_reasons(c4, (9, 0)) == []
    assert v6_unsupported_reasons(c4, (8, 0)) == ["v6 needs compute capability 9.0 (sm_90a wgmma), got 8.0"]
    assert v6_unsupported_reasons(c4, None) == ["v6 needs compute capability 9.0 (sm_90a wgmma), got an unknown GPU"]
    assert v6_unsupported_reasons(c4, (9, 0), nvrtc=(11, 8)) == ["v6 needs NVRTC 12.0+ to build for sm_90a, got 11.8"]
    assert v6_unsupported_reasons(c4, (9, 0), "float32") == ["v6 serves bfloat16 queries (got float32)"]
    for name in ("C8R8", "BF16"):
        why = v6_unsupported_reasons(qm.PackFormat.parse(name), (9, 0))
        assert len(why) == 1 and why[0].startswith("v6 serves 2/4-bit content")


def test_v6_auto_selection(monkeypatch):
    """auto runs v6 from V4_MIN_ROWS query rows over 2/4-bit pages on compute capability 9.0 (H200: 0.75-0.84x
    of v4's time), v4 over bf16 pages and where v6 cannot run, v5/v3/v2 for fewer rows as before."""
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    c4, c2 = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C2R4", 256, 32)
    for fmt in (c4, c2):
        assert select_variant(fmt, "bfloat16", (9, 0), 4096, 64) == ("v6", None)
        assert select_variant(fmt, "bfloat16", (9, 0), 1 << 20, 128) == ("v6", None)
        assert select_variant(fmt, "bfloat16", (9, 0), 1 << 20, 63)[0] == "v5"
    assert select_variant(qm.PackFormat.parse("BF16"), "bfloat16", (9, 0), 4096, 128) == ("v4", None)
    v, why = select_variant(c4, "bfloat16", (9, 0), 4096, 128, nvrtc=(11, 8))
    assert v == "v4" and "v6 needs NVRTC 12.0+" in why
    assert select_variant(c4, "bfloat16", (8, 0), 1 << 20, 128)[0] == "v3"  # neither v6 nor v4 fits an A100


def test_v6_forced_selection(monkeypatch):
    c4 = qm.PackFormat.parse("C4R4")
    monkeypatch.setenv(VARIANT_ENV, "v6")
    assert select_variant(c4, "bfloat16", (9, 0), 64, 128) == ("v6", None)
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20, 16) == ("v6", None)
    v, why = select_variant(c4, "bfloat16", (8, 0), 1 << 20, 128)
    assert v == "v2" and "compute capability 9.0" in why
    v, why = select_variant(qm.PackFormat.parse("C8R8"), "bfloat16", (9, 0), 1 << 20, 128)
    assert v == "v1" and "2/4-bit content" in why


@pytest.mark.parametrize("h,s_q,prot", [(128, 1, True), (64, 1, False), (20, 4, True), (1, 1, False)])
def test_v6_launches_match_kernel_signatures(monkeypatch, h, s_q, prot):
    """One v6 launch over 64-row chunks (256 threads, an sm_90a build), one partial per CTA (the sink and
    local tokens inside, no protected-only launch), then the combine (QUANTMLA_CUPY_V6_MERGE=0: the merging
    clusters' launches are tests/test_cupy_v6_merge.py's)."""
    launches, _kernels, fmt, b = _run_v2_stubbed(monkeypatch, h, s_q, prot, {"QUANTMLA_CUPY_V6_MERGE": "0"},
                                                 variant="v6", pages_per=9, length=500)
    params = _kernel_params("attention_v6.cu", "qmla_attn_v6")
    # the split kernels' argument list, then v6's piece table (null: equal splits), tiles per request and the output
    # pointers (written by the merging builds)
    assert params == _kernel_params("attention_v3.cu", "qmla_attn_v3") + [
        "const int4* __restrict__ pieces", "int unit_tiles", "u16* __restrict__ out", "float* __restrict__ lse"]
    (attn, grid, block, args, smem), _stream = launches.of("qmla_attn_v6")
    assert attn.source == "attention_v6.cu" and attn.arch == "sm_90a"
    assert len(args) == len(params)
    for a, p in zip(args, params):
        assert isinstance(a, np.uint64 if "*" in p else np.int32 if p.startswith("int ") else np.float32), p
    rows = s_q * h
    assert grid[0] == b * (-(-rows // 64)) and block == (256,)
    assert smem == v6_smem_bytes(fmt, rope_fold=v6_rope_fold(fmt)) == attn.defines["QMLA_V6_SMEM"]
    per = int(args[params.index("int tiles_per_split")])
    slots = int(args[params.index("int num_splits")])
    splits = grid[1]
    planned = 9 * fmt.page_size  # the table (V6_PLAN_PROTECTED: not the protected tiles)
    assert splits * per * 64 >= planned and (splits - 1) * per * 64 < planned
    kernels = [rec[0].kernel for rec in launches]
    assert kernels == ["qmla_attn_v6", "qmla_combine"] and slots == splits
    assert int(args[params.index("int sink")]) == (4 if prot else 0)
    assert int(args[params.index("int local")]) == (128 if prot else 0)
    assert int(args[params.index("const int4* __restrict__ pieces")]) == 0 and attn.defines["QMLA_V6_PIECES"] == 0
    assert int(args[params.index("int unit_tiles")]) == 9
    assert launches[-1][0].kernel == "qmla_combine" and int(launches[-1][3][-1]) == slots


@pytest.mark.parametrize("h,s_q,prot,length", [(128, 1, True, 500), (64, 1, False, 576), (20, 4, True, 300)])
def test_v6_balanced_launch(monkeypatch, h, s_q, prot, length):
    """QUANTMLA_CUPY_V6_BALANCE=1: the piece-table build, one CTA per piece and row chunk (a 1-D grid), the table
    the plan keeps passed by address, the combine over the plan's slots; under CUDA-graph capture (where the table
    cannot be uploaded) the equal splits, not cached, so that the next call plans the table."""
    launches, _kernels, fmt, b = _run_v2_stubbed(monkeypatch, h, s_q, prot, {"QUANTMLA_CUPY_V6_BALANCE": "1"},
                                                 variant="v6", pages_per=9, length=length)
    params = _kernel_params("attention_v6.cu", "qmla_attn_v6")
    (attn, grid, _block, args, _smem), _stream = launches.of("qmla_attn_v6")
    chunks = -(-(h * s_q) // 64)
    (plan,) = cupy_plans._PLANS.values()
    (table,) = plan.keep
    assert attn.defines["QMLA_V6_PIECES"] == 1 and grid == (table.shape[0] * chunks, 1)
    assert int(args[params.index("const int4* __restrict__ pieces")]) == table.data_ptr()
    assert int(args[params.index("int unit_tiles")]) == 9 and int(args[params.index("int num_splits")]) == plan.slots
    assert table.dtype == torch.int32 and table.shape[1] == 4
    assert sorted(int(x) for x in table[:, 0].unique()) == list(range(b))
    assert int(launches[-1][3][-1]) == plan.slots
    launches, *_ = _run_v2_stubbed(monkeypatch, h, s_q, prot, {"QUANTMLA_CUPY_V6_BALANCE": "1"}, variant="v6",
                                   pages_per=9, length=length, capturing=True)
    (attn, grid, _block, args, _smem), _stream = launches.of("qmla_attn_v6")
    assert attn.defines["QMLA_V6_PIECES"] == 0 and not cupy_plans._PLANS
    assert int(args[params.index("const int4* __restrict__ pieces")]) == 0
    assert int(args[params.index("int num_splits")]) == grid[1] and grid[0] == b * chunks  # equal splits


def test_v6_balance_auto_rule():
    """auto balances C2R4 only (stop 35: C4R4's piece-table build ran slower), and only where the pieces' simulated
    schedule beats equal splits: not at 4K tokens, yes at B32 L128K on 132 SMs; 0 never, 1 wherever allowed; pair
    and separate builds never."""
    c4, c2 = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C2R4")
    auto, force, off = V6Knobs(), V6Knobs(balance="1"), V6Knobs(balance="0")
    assert V6_BALANCE == "auto" and V6_BALANCE_CONTENT_BITS == (2,)
    assert v6_balanced(c2, auto, False, 32, 2, 2048, 132) is not None
    assert v6_balanced(c2, auto, False, 32, 2, 64, 132) is None
    assert v6_balanced(c4, auto, False, 32, 2, 2048, 132) is None
    assert v6_balanced(c4, force, False, 32, 2, 64, 132) is not None
    assert v6_balanced(c2, off, False, 32, 2, 2048, 132) is None
    assert v6_balanced(c2, force, True, 32, 2, 2048, 132) is None
    assert v6_balanced(c2, V6Knobs(separate=True, balance="1"), False, 32, 2, 2048, 132) is None
    with pytest.raises(ValueError, match="pieces=True needs pair=False"):
        v6_defines(c2, pair=True, pieces=True)


def test_v6_knobs(monkeypatch):
    assert V6Knobs.from_env() == V6Knobs() == V6Knobs(V2_MIN_TILES_PER_SPLIT, 3, False)
    monkeypatch.setenv("QUANTMLA_CUPY_V2_MIN_TILES", "4")
    assert V6Knobs.from_env() == V6Knobs(4)
    monkeypatch.setenv("QUANTMLA_CUPY_V6_PV_AT", "1")
    monkeypatch.setenv("QUANTMLA_CUPY_V6_PAGE_AHEAD", "1")
    assert V6Knobs.from_env() == V6Knobs(4, 1, True)
    monkeypatch.setenv("QUANTMLA_CUPY_V6_PROTECTED", "separate")
    assert V6Knobs.from_env() == V6Knobs(4, 1, True, True)
    monkeypatch.setenv("QUANTMLA_CUPY_V6_PAIR", "1")
    assert V6Knobs.from_env() == V6Knobs(4, 1, True, True, pair="1")
    monkeypatch.setenv("QUANTMLA_CUPY_V6_SLACK", str(int(not V6_SLACK)))
    monkeypatch.setenv("QUANTMLA_CUPY_V6_ROPE_FOLD", "0")
    assert V6Knobs.from_env() == V6Knobs(4, 1, True, True, pair="1", slack=not V6_SLACK, rope_fold=False)
    monkeypatch.setenv("QUANTMLA_CUPY_V6_ROPE_FOLD", "auto")
    assert V6Knobs.from_env().rope_fold is None
    monkeypatch.setenv("QUANTMLA_CUPY_V6_BALANCE", "1")
    assert V6Knobs.from_env().balance == "1"
    monkeypatch.delenv("QUANTMLA_CUPY_V6_BALANCE")
    for env, bad in (("QUANTMLA_CUPY_V2_MIN_TILES", "3"), ("QUANTMLA_CUPY_V6_PV_AT", "4"),
                     ("QUANTMLA_CUPY_V6_PAGE_AHEAD", "2"), ("QUANTMLA_CUPY_V6_PROTECTED", "in"),
                     ("QUANTMLA_CUPY_V6_PAIR", "2"), ("QUANTMLA_CUPY_V6_SLACK", "8"),
                     ("QUANTMLA_CUPY_V6_ROPE_FOLD", "yes"), ("QUANTMLA_CUPY_V6_BALANCE", "2")):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            V6Knobs.from_env()
        monkeypatch.delenv(env)


@pytest.mark.parametrize("env,pv_at,ahead,inline", [({}, 3, 0, 1), ({"QUANTMLA_CUPY_V6_PV_AT": "2"}, 2, 0, 1),
                                                    ({"QUANTMLA_CUPY_V6_PAGE_AHEAD": "1", "QUANTMLA_CUPY_V6_PV_AT": "1"}, 1, 1, 1),
                                                    ({"QUANTMLA_CUPY_V6_PROTECTED": "separate"}, 3, 0, 0)])
def test_v6_knobs_select_their_build(monkeypatch, env, pv_at, ahead, inline):
    """The call's knobs reach the kernel's -D defines (the default build without any set); with the protected
    tokens left to protected.cu (``separate``) its launch comes back, with its partial slots."""
    launches, _kernels, _fmt, _b = _run_v2_stubbed(monkeypatch, 128, 1, True, env, variant="v6", pages_per=9,
                                                   length=500)
    (attn, grid, _block, args, _smem), _stream = launches.of("qmla_attn_v6")
    assert (attn.defines["QMLA_V6_PV_AT"], attn.defines["QMLA_V6_PAGE_AHEAD"]) == (pv_at, ahead)
    assert attn.defines["QMLA_V6_PROTECTED"] == inline
    assert attn.defines["QMLA_V6_MAX_SLACK"] == (V6_MAX_SLACK if V6_SLACK else 0)
    assert attn.defines["QMLA_V6_ROPE_FOLD"] == int(_fmt.content_bits in V6_ROPE_FOLD_CONTENT_BITS)
    params = _kernel_params("attention_v6.cu", "qmla_attn_v6")
    slots = int(args[params.index("int num_splits")])
    kernels = [rec[0].kernel for rec in launches]
    if inline:
        assert "qmla_attn_protected" not in kernels and slots == grid[1]
    else:
        assert "qmla_attn_protected" in kernels and slots == grid[1] + protected_ctas(4, 128)


def test_v6_pairs_rule():
    """auto pairs only where the rows fill an even number of 64-row chunks (no CTA added), and only while
    V6_PAIR_AUTO holds; 1 always pairs, 0 never."""
    assert not v6_pairs("0", 128) and v6_pairs("1", 64) and v6_pairs("1", 128)
    for rows in (64, 80, 128, 192, 256):
        assert v6_pairs("auto", rows) == (V6_PAIR_AUTO and -(-rows // 64) % 2 == 0)


def test_v6_slack_fold_defaults():
    """The defaults follow the H200 A/B of stop 31 (RESULTS.md): the slack on for both content widths, the fold for
    4-bit content only (C2R4 ran 0.5-1.5 % slower with it); pair builds never fold, and forcing one is refused."""
    assert V6_SLACK and V6_MAX_SLACK == 8 and V6_ROPE_FOLD_CONTENT_BITS == (4,)
    assert V6Knobs().rope_fold is None
    c4, c2 = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C2R4", 256, 32)
    assert v6_rope_fold(c4) and not v6_rope_fold(c2) and v6_rope_fold(c2, rope_fold=True)
    assert not v6_rope_fold(c4, rope_fold=False) and not v6_rope_fold(c4, pair=True)
    assert v6_defines(c4)["QMLA_V6_MAX_SLACK"] == 8 and v6_defines(c4, slack=False)["QMLA_V6_MAX_SLACK"] == 0


@pytest.mark.parametrize("slack,fold", [(1, 0), (0, 1), (1, 1), (0, 0)])
def test_v6_slack_fold_knobs_select_their_build(monkeypatch, slack, fold):
    """QUANTMLA_CUPY_V6_SLACK / _ROPE_FOLD reach the kernel's defines and the folding build's shared memory; a pair
    build never folds (its kernel has no fold), whatever the knob says."""
    env = {"QUANTMLA_CUPY_V6_SLACK": str(slack), "QUANTMLA_CUPY_V6_ROPE_FOLD": str(fold)}
    launches, _kernels, fmt, _b = _run_v2_stubbed(monkeypatch, 128, 1, True, env, variant="v6", pages_per=9, length=500)
    (attn, _grid, _block, _args, smem), _stream = launches.of("qmla_attn_v6")
    assert attn.defines["QMLA_V6_MAX_SLACK"] == V6_MAX_SLACK * slack == (8 if slack else 0)
    assert attn.defines["QMLA_V6_ROPE_FOLD"] == fold
    assert smem == v6_smem_bytes(fmt, rope_fold=bool(fold)) == attn.defines["QMLA_V6_SMEM"]
    launches, _kernels, fmt, _b = _run_v2_stubbed(monkeypatch, 128, 1, True, {**env, "QUANTMLA_CUPY_V6_PAIR": "1"},
                                                  variant="v6", pages_per=9, length=500)
    (attn, _grid, _block, _args, smem), _stream = launches.of("qmla_attn_v6")
    assert attn.defines["QMLA_V6_PAIR"] == 1 and attn.defines["QMLA_V6_ROPE_FOLD"] == 0
    assert smem == v6_smem_bytes(fmt, pair=True)


@pytest.mark.parametrize("h,s_q", [(128, 1), (64, 1), (20, 4)])
def test_v6_pair_launch(monkeypatch, h, s_q):
    """QUANTMLA_CUPY_V6_PAIR=1 builds the cluster kernel and pads the row chunks to an even number (the kernel pads
    the same way), with the pair build's shared memory."""
    launches, _kernels, fmt, b = _run_v2_stubbed(monkeypatch, h, s_q, True, {"QUANTMLA_CUPY_V6_PAIR": "1"}, variant="v6",
                                                 pages_per=9, length=500)
    (attn, grid, _block, _args, smem), _stream = launches.of("qmla_attn_v6")
    chunks = -(-(h * s_q) // 64)
    assert attn.defines["QMLA_V6_PAIR"] == 1 and grid[0] == b * (chunks + chunks % 2)
    assert smem == v6_smem_bytes(fmt, pair=True) == attn.defines["QMLA_V6_SMEM"]


#: many-row cases beyond v4's: one tile (the dequantizer has no next tile), two tiles (one key buffer each),
#: three (a buffer reused), a split whose last tile is partial, 128-token pages (a tile mid-page), protected tiles
V6_CASES = [
    Case(qm.PackFormat.parse("C4R4"), (64, 128, 192), heads=128, s_q=1, sink=0, local=0, seed=960),
    Case(qm.PackFormat.parse("C2R4", page_size=128), (5000, 321), heads=64, s_q=1, sink=4, local=128, seed=961),
    Case(qm.PackFormat.parse("C4R4", 256, 32, group_size=128), (900, 2), heads=128, s_q=2, sink=4,
         local=128, seed=962),
    # protected tiles: two sink tiles, a local window over three tiles, short requests whose protected split
    # is one past their packed tokens, causal rows (S_q 2) inside the window
    Case(qm.PackFormat.parse("C2R4"), (70, 9000, 200), heads=64, s_q=2, sink=80, local=100, seed=963),
    # a one-token sink and ring: with S_q 2 the first new token comes from its packed copy
    Case(qm.PackFormat.parse("C4R4"), (7, 2, 200), heads=64, s_q=2, sink=1, local=1, seed=964),
]


def _check_v6_on_gpu(case: Case, monkeypatch, env: dict[str, str] | None = None) -> None:
    """Forced v6 with the knobs ``env`` against the reference (skipped but on compute capability 9.0)."""
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != (9, 0):
        pytest.skip(f"v6 is an sm_90a kernel: this GPU is compute capability {cap[0]}.{cap[1]}")
    monkeypatch.setenv(VARIANT_ENV, "v6")
    for k, v in (env or {}).items():
        monkeypatch.setenv(k, v)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V4_CASES + V6_CASES if c.fmt.quantized], ids=str)
def test_attention_v6_matches_reference(case, monkeypatch):
    _check_v6_on_gpu(case, monkeypatch)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pv_at,ahead,protected", [(1, 1, "inline"), (2, 0, "inline"), (3, 1, "inline"),
                                                   (3, 0, "separate")])
@pytest.mark.parametrize("case", V6_CASES, ids=str)
def test_attention_v6_knob_builds_match_reference(case, pv_at, ahead, protected, monkeypatch):
    """The measurement knobs' builds compute the same attention (RESULTS.md stop 24: all slower than the default)."""
    _check_v6_on_gpu(case, monkeypatch, {"QUANTMLA_CUPY_V6_PV_AT": str(pv_at), "QUANTMLA_CUPY_V6_PAGE_AHEAD": str(ahead),
                                         "QUANTMLA_CUPY_V6_PROTECTED": protected})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V4_CASES + V6_CASES if c.fmt.quantized], ids=str)
def test_attention_v6_pair_matches_reference(case, monkeypatch):
    """Two-CTA clusters sharing each key tile (QUANTMLA_CUPY_V6_PAIR=1) compute the same attention, also where the
    rows fill an odd number of 64-row chunks (one more CTA past the rows, which only dequantizes for its peer)."""
    _check_v6_on_gpu(case, monkeypatch, {"QUANTMLA_CUPY_V6_PAIR": "1"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V4_CASES + V6_CASES if c.fmt.quantized], ids=str)
def test_attention_v6_merge_matches_reference(case, monkeypatch):
    """QUANTMLA_CUPY_V6_MERGE=auto: where a row chunk's splits fit a cluster, its CTAs merge them and write the output
    themselves (tests/test_cupy_v6_merge.py: bit for bit against the combine); the same attention everywhere."""
    _check_v6_on_gpu(case, monkeypatch, {"QUANTMLA_CUPY_V6_MERGE": "auto"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("resident", [5, 14])
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V4_CASES + V6_CASES if c.fmt.quantized], ids=str)
def test_attention_v6_balanced_matches_reference(case, resident, monkeypatch):
    """Balanced plans (QUANTMLA_CUPY_V6_BALANCE=1) planned for a GPU that runs only ``resident`` CTAs at once, so that
    requests are cut into pieces mid-request, in launch orders other than the requests', with different numbers of
    partials per request (the unused slots marked empty), compute the same attention."""
    monkeypatch.setattr(cupy_plans, "resident_ctas", lambda *a, **k: resident)
    monkeypatch.setattr(cupy_plans, "_PLANS", {})
    _check_v6_on_gpu(case, monkeypatch, {"QUANTMLA_CUPY_V6_BALANCE": "1"})


#: (case, slack, fold): both knobs over every v6 case, each alone and neither over the many-row ones
V6_SLACK_FOLD_CASES = ([(c, 1, 1) for c in V2_CASES + BIG[:3] + V4_CASES + V6_CASES if c.fmt.quantized]
                       + [(c, slack, fold) for c in V6_CASES for slack, fold in ((1, 0), (0, 1), (0, 0))])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case,slack,fold", V6_SLACK_FOLD_CASES, ids=lambda v: str(v) if isinstance(v, Case) else None)
def test_attention_v6_slack_fold_match_reference(case, slack, fold, monkeypatch):
    """A reference maximum that moves by more than V6_MAX_SLACK only (P up to 2^8 before the division by the row
    sums) and the RoPE scale folded into the scores (QUANTMLA_CUPY_V6_SLACK / _ROPE_FOLD) compute the same attention
    within the reference's tolerances."""
    _check_v6_on_gpu(case, monkeypatch, {"QUANTMLA_CUPY_V6_SLACK": str(slack), "QUANTMLA_CUPY_V6_ROPE_FOLD": str(fold)})
