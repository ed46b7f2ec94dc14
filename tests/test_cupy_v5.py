"""CuPy attention kernel v5 (few query rows on Hopper: tokens as the wgmma M dimension, ``kernels/attention_v5.cu``).

CPU: the sm_90a build compiles without spills at every served format, dims, group and page size,
runs both matmuls as m64n16k16 warpgroup MMAs (no mma.sync, no ptxas serialization), and its
shared-memory layout matches the launcher's; auto picks it for few-row requests with long block
tables on compute capability 9.0 with an NVRTC that builds sm_90a, and says why elsewhere; the
stubbed launch matches the kernel's signature, gives each worker warpgroup its own partial slot and
adds the protected-only launch. GPU: conformance against the reference (edge lengths, several
requests, S_q > 1, row counts that do not fill a 16-row chunk, every page size, d_c 256)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from conformance import Case, check_attention_case
from quantmla_core.backends.cupy.builds import (
    ROPE_FOLD_CONTENT_BITS,
    V5_PACKED_GROUPS,
    V5_QUAD_LOADS,
    V5_ZFOLD,
    V5_HALVES_CHOICES,
    V5_WORKER_CHOICES,
    V4_WGMMA_ARCH,
    protected_ctas,
    protected_smem_bytes,
    smem_per_block,
    v5_defines,
    v5_build_reasons,
    v5_quad_loads,
    v5_rope_fold,
    v5_smem_bytes,
    v5_zfold,
)
from quantmla_core.backends.cupy.knobs import V5Knobs
from quantmla_core.backends.cupy.variants import (
    V3_MIN_TOKENS,
    V4_MIN_ROWS,
    V5_MIN_BATCH_TOKENS,
    VARIANT_ENV,
    select_variant,
    v5_unsupported_reasons,
)
from test_cupy_backend import (
    compile_all,
    BIG,
    NVCC,
    V2_CASES,
    _kernel_params,
    _run_v2_stubbed,
    compile_cubin_and_ptx,
    gpu,
    ptxas_usage,
)

import quantmla_core as qm

#: (format, d_c, d_r, group size, page size)
V5_BUILDS = [
    ("C4R4", 512, 64, 64, 64),
    ("C2R4", 512, 64, 64, 64),
    ("C4R4", 512, 64, 128, 16),
    ("C2R4", 512, 64, 128, 128),
    ("C4R4", 256, 32, 64, 32),
    ("C2R4", 256, 32, 32, 64),
]
#: the builds QUANTMLA_CUPY_V5_HALVES=2 serves (d_c 512 / d_r 64) and those QUANTMLA_CUPY_V5_WORKERS=4 serves (d_c 256)
def _build_format(v: tuple) -> qm.PackFormat:
    name, dc, dr, gs, page = v
    return qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)


def _v5_builds(workers: int = 2, halves: int = 1) -> list[tuple]:
    """The builds of V5_BUILDS that v5 builds with ``workers`` workers of ``halves`` warpgroups (v5_build_reasons)."""
    return [b for b in V5_BUILDS if not v5_build_reasons(_build_format(b), workers, halves)]


V5_HALVES_BUILDS = _v5_builds(halves=2)
V5_FOUR_BUILDS = _v5_builds(workers=4)


@lru_cache(maxsize=None)
def _compiled_v5(workers: int = 2, halves: int = 1) -> dict:
    """{build: (nvcc's return code, ptxas's report, PTX)} of every build with ``workers`` and ``halves`` (nvcc runs in
    parallel, once per setting)."""
    def compile_one(v: tuple) -> tuple[int, str, str]:
        return compile_cubin_and_ptx("attention_v5.cu", V4_WGMMA_ARCH,
                                     v5_defines(_build_format(v), workers=workers, halves=halves))

    return compile_all(_v5_builds(workers, halves), compile_one)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V5_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v5_compiles_without_spills(build):
    """Every served build compiles for sm_90a (its static_asserts hold, among them the launcher's
    shared-memory size) without spills; QK is (d_c + d_r) / 16 m64n16k16 wgmma with A from registers,
    committed in chunks of 4 k-steps (8 for 2-bit content) of which one may stay in flight, PV d_c / 64 x 4 from shared memory
    (A, the key tile, read MN-major) with one commit; the content fragments go to the key tile by
    stmatrix, P^T by stmatrix.trans; ptxas serializes no wgmma. The tile's code is there twice: for the
    packed tiles (A dequantized from codes) and the protected ones (A loaded as bf16 pairs)."""
    rc, text, ptx = _compiled_v5()[build]
    assert rc == 0, f"nvcc failed for v5 {build}:\n{text[-4000:]}"
    assert "warning #" not in text, text  # e.g. #549-D, a variable read in its own initializer (stop 21)
    use = ptxas_usage(text)
    print(f"v5 {build}: {use}")
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v5 {build} spills: {use}"
    _name, dc, dr = build[:3]
    wgmma = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    ksteps, bodies = (dc + dr) // 16, 2  # the tile's code for packed and for protected tiles
    zf = int(v5_zfold(_build_format(build)))  # the fold's 2 QK k-steps and PV block (test_v5_zfold_builds_compile)
    ksteps, blocks = ksteps + 2 * zf, dc // 64 + zf
    assert ptx.count(wgmma) == bodies * (ksteps + blocks * 4)
    assert ptx.count("p, 1, 1, 1, 0;") == bodies * blocks * 4  # PV: A (the key tile) read MN-major
    assert ptx.count("p, 1, 1, 0; }") == bodies * ksteps  # QK: A from registers
    chunks = -(-(ksteps - 2 * zf) // 4)  # QMLA_V5_KCHUNK: 4 k-steps (two workers)
    assert ptx.count("wgmma.commit_group.sync.aligned") == bodies * (chunks + 1 + zf)
    assert ptx.count("wgmma.wait_group.sync.aligned 1") == bodies * (chunks - 2)
    # per body QK's and the previous tile's PV (deferred to the next tile), then the last PV after the loops
    assert ptx.count("wgmma.wait_group.sync.aligned 0") == 2 * bodies + 1
    # no stage: the lanes load their codes from global memory into registers (16-byte loads of content codes),
    # and a protected tile's bf16 pairs (4-byte loads)
    assert "cp.async" not in ptx and "ld.global.nc.v4.u32" in ptx and "ld.global.nc.u32" in ptx
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == bodies * (dc // 16 + zf)  # one per content k-step
    assert "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx and "fence.proxy.async.shared::cta" in ptx
    assert "mma.sync" not in ptx and "ldmatrix" not in ptx and "fma.rn.bf16x2" in ptx
    assert "C7515" not in text and "serialized" not in text, text  # ptxas: "wgmma ... serialized"


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("name, knobs", [("C4R4", {"quad_loads": False}), ("C4R4", {"quad_loads": True, "rope_fold": False}),
                                         ("C2R4", {"packed_groups": False})], ids=str)
def test_v5_load_knob_builds_compile(name, knobs):
    """The builds the load knobs force away from the default (at d_c 512: 4-bit without quad loads, and with them but
    without the fold; 2-bit without packed zero points) compile without spills and differ from the default build."""
    fmt = qm.PackFormat.parse(name)
    rc, text, ptx = compile_cubin_and_ptx("attention_v5.cu", V4_WGMMA_ARCH, v5_defines(fmt, **knobs))
    assert rc == 0, text[-4000:]
    use = ptxas_usage(text)
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v5 {name} {knobs}: {use}"
    assert ptx != _compiled_v5()[(name, 512, 64, 64, 64)][2]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("name", ["C4R4", "C2R4"])
def test_v5_zfold_builds_compile(name):
    """QMLA_V5_ZFOLD (d_c 512): no spills, no serialized wgmma; per tile body two more QK k-steps (A from registers)
    and one more PV block of 4 (A from the key tile), the zero points' columns stored with the content's; and no
    zero-point subtraction left in the content dequantization (one fma a pair where there were two)."""
    fmt = qm.PackFormat.parse(name)
    rc, text, ptx = compile_cubin_and_ptx("attention_v5.cu", V4_WGMMA_ARCH, v5_defines(fmt, zfold=True))
    assert rc == 0, text[-4000:]
    use = ptxas_usage(text)
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v5 {name} zfold: {use}"
    assert "C7515" not in text and "serialized" not in text, text
    ksteps, bodies, blocks = 576 // 16, 2, 512 // 64 + 1
    wgmma = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    assert ptx.count(wgmma) == bodies * (ksteps + 2 + blocks * 4)
    assert ptx.count("p, 1, 1, 1, 0;") == bodies * blocks * 4 and ptx.count("p, 1, 1, 0; }") == bodies * (ksteps + 2)
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == bodies * (512 // 16 + 1)
    rc, text, plain = compile_cubin_and_ptx("attention_v5.cu", V4_WGMMA_ARCH, v5_defines(fmt, zfold=False))
    assert rc == 0, text[-4000:]
    # per tile the dequantization's fma.rn.bf16x2: two a content pair without the fold, one with it (plus the RoPE's
    # and 3 a token for the zero-point fragment's s z)
    assert ptx.count("fma.rn.bf16x2") < plain.count("fma.rn.bf16x2") - 100


def test_v5_zfold_choice():
    """Where v5 can fold the zero points: d_c 512 builds that load a token's 8 groups together (quad loads, packed
    groups) with one warpgroup a worker; there the knob, else V5_ZFOLD; the shared memory grows by a key-tile block
    and the group sums per worker and a query block."""
    c4, c2, small = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C2R4"), qm.PackFormat.parse("C4R4", 256, 32)
    assert v5_zfold(c4, zfold=True) and v5_zfold(c2, zfold=True) and not v5_zfold(small, zfold=True)
    assert not v5_zfold(c4, zfold=False) and v5_zfold(c4) == v5_zfold(c2) == V5_ZFOLD
    assert not v5_zfold(c4, 3, zfold=True) and not v5_zfold(c4, 2, 2, zfold=True)
    assert not v5_zfold(c4, zfold=True, quad_loads=False) and not v5_zfold(c2, zfold=True, packed_groups=False)
    worker = -(-(9 * 64 * 128 + 16 * 128 + 4 * 16 * 4 + 16 + 8 * 16 * 4) // 1024) * 1024
    assert v5_smem_bytes(c4, zfold=True) == 2 * worker + 10 * 16 * 128 + 1024 <= smem_per_block((9, 0))
    assert v5_defines(c4, zfold=True)["QMLA_V5_SMEM"] == v5_smem_bytes(c4, zfold=True)
    assert v5_defines(c4, zfold=True)["QMLA_V5_ZFOLD"] == 1 and v5_defines(small, zfold=True)["QMLA_V5_ZFOLD"] == 0


def test_v5_zfold_knob(monkeypatch):
    """QUANTMLA_CUPY_V5_ZFOLD (auto, 0, 1) reaches the C4R4 build as QMLA_V5_ZFOLD and its shared memory."""
    for value, want in (("0", 0), ("1", 1), ("auto", int(V5_ZFOLD))):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_ZFOLD", value)
        assert V5Knobs.from_env() == V5Knobs(True, zfold=None if value == "auto" else bool(want))
        launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name="C4R4")
        d = launches.of("qmla_attn_v5")[0][0].defines
        assert d["QMLA_V5_ZFOLD"] == want and d["QMLA_V5_SMEM"] == v5_smem_bytes(qm.PackFormat.parse("C4R4"),
                                                                                  zfold=bool(want)), value
    monkeypatch.setenv("QUANTMLA_CUPY_V5_ZFOLD", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_ZFOLD"):
        V5Knobs.from_env()


def test_v5_probe_knob(monkeypatch):
    """QUANTMLA_CUPY_V5_PROBE (0-7: the stages of V5_PROBE_BITS a measurement build skips) reaches the build as
    QMLA_V5_PROBE; 0 by default; anything else is refused by name."""
    assert V5Knobs.from_env().probe == 0 and v5_defines(qm.PackFormat.parse("C4R4"))["QMLA_V5_PROBE"] == 0
    for value in ("1", "6"):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_PROBE", value)
        launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name="C4R4")
        assert launches.of("qmla_attn_v5")[0][0].defines["QMLA_V5_PROBE"] == int(value)
    monkeypatch.setenv("QUANTMLA_CUPY_V5_PROBE", "8")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_PROBE"):
        V5Knobs.from_env()
    with pytest.raises(ValueError, match="probe: expected a sum of"):
        v5_defines(qm.PackFormat.parse("C4R4"), probe=9)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
def test_v5_probe_builds_skip_their_stages():
    """Each probe build drops exactly its stage from the packed and protected tiles: bit 1 PV's d_c / 64 x 4 wgmma,
    bit 2 the key tile's stmatrix (one a content k-step), bit 4 the content dequantization's fma."""
    fmt = qm.PackFormat.parse("C4R4")
    ptx = {}
    for probe in (0, 1, 2, 4):
        rc, text, ptx[probe] = compile_cubin_and_ptx("attention_v5.cu", V4_WGMMA_ARCH,
                                                     v5_defines(fmt, zfold=False, probe=probe))
        assert rc == 0, text[-4000:]
    wgmma, stsm, fma = "wgmma.mma_async", "stmatrix.sync.aligned.m8n8.x4.shared.b16", "fma.rn.bf16x2"
    assert ptx[0].count(wgmma) - ptx[1].count(wgmma) == 2 * 512 // 64 * 4
    assert ptx[0].count(stsm) - ptx[2].count(stsm) == 2 * 512 // 16 and ptx[2].count(wgmma) == ptx[0].count(wgmma)
    assert ptx[4].count(fma) < ptx[0].count(fma) - 100 and ptx[4].count(stsm) == ptx[0].count(stsm)


def _checked_build(label: str, build: tuple, compiled: tuple[int, str, str], max_registers: int,
                   max_spill: int) -> str:
    """The PTX of a v5 ``build`` that nvcc compiled within ``max_registers`` a thread and ``max_spill`` spilled bytes,
    with no wgmma serialized by ptxas."""
    rc, text, ptx = compiled
    assert rc == 0, f"nvcc failed for v5 {label} {build}:\n{text[-4000:]}"
    use = ptxas_usage(text)
    print(f"v5 {label} {build}: {use}")
    assert use["registers"] <= max_registers and use["spill_stores"] <= max_spill, use
    assert "C7515" not in text and "C7514" not in text and "serialized" not in text, text
    return ptx


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V5_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v5_three_workers_compile(build):
    """QUANTMLA_CUPY_V5_WORKERS=3 (384 threads, 168 registers a thread): the loads go after QK into the
    registers QK read (no second set) and QK runs in chunks of 2 k-steps, so every build fits with at most
    48 bytes spilled (d_c 512, where the protected tiles' code took it from 16-24 B to 20-36 B; none at
    d_c 256) and no serialized wgmma."""
    ptx = _checked_build("x3", build, _compiled_v5(workers=3)[build], 168, 48 if build[1] == 512 else 0)
    ksteps = (build[1] + build[2]) // 16
    assert ptx.count("wgmma.commit_group.sync.aligned") == 2 * (-(-ksteps // 2) + 1)  # packed and protected tiles
    assert v5_defines(qm.PackFormat.parse(build[0]), workers=3)["QMLA_V5_WORKERS"] == 3
    with pytest.raises(ValueError, match="workers: expected one of"):
        v5_defines(qm.PackFormat.parse(build[0]), workers=5)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V5_FOUR_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v5_four_workers_compile(build):
    """QUANTMLA_CUPY_V5_WORKERS=4 at d_c 256 (512 threads, 128 registers a thread: the occupancy of the halves without
    their exchange): QK in chunks of 2 k-steps, loads after QK, no RoPE fold; at most 20 bytes spilled (2-bit content;
    4 for 4-bit; nvcc 13, stop 41); the queries staged in 4.5 pairs a thread (the last round masked)."""
    ptx = _checked_build("x4", build, _compiled_v5(workers=4)[build], 128, 4 if build[0] == "C4R4" else 20)
    ksteps = (build[1] + build[2]) // 16
    assert ptx.count("wgmma.commit_group.sync.aligned") == 2 * (-(-ksteps // 2) + 1)
    assert v5_defines(qm.PackFormat.parse(build[0], 256, 32), workers=4)["QMLA_V5_SMEM"] <= smem_per_block((9, 0))


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V5_HALVES_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v5_halves_compile(build):
    """QUANTMLA_CUPY_V5_HALVES=2 (two workers of two warpgroups, 512 threads at 128 registers a thread): each half
    runs QK over (d_c + d_r) / 32 k-steps in chunks of 2 and PV over d_c / 128 m-blocks, with the loads after QK and
    neither the RoPE fold nor quad loads. 4-bit content fits without spills, 2-bit with at most 16 bytes (stop 41,
    nvcc 13: one local load a tile); half 1 hands its scores over by bar.arrive and waits for P^T by bar.sync."""
    ptx = _checked_build("halves", build, _compiled_v5(halves=2)[build], 128, 0 if build[0] == "C4R4" else 16)
    _name, dc, dr = build[:3]
    ksteps, bodies = (dc + dr) // 32, 2
    wgmma = "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16"
    assert ptx.count(wgmma) == bodies * (ksteps + dc // 128 * 4)
    assert ptx.count("wgmma.commit_group.sync.aligned") == bodies * (-(-ksteps // 2) + 1)
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == bodies * dc // 32  # one per content k-step
    assert "bar.arrive" in ptx and ", 256;" in ptx


def test_v5_build_reasons():
    c4, small = qm.PackFormat.parse("C4R4"), qm.PackFormat.parse("C2R4", 256, 32)
    assert V5_HALVES_CHOICES == (1, 2) and V5_WORKER_CHOICES == (2, 3, 4)
    assert v5_build_reasons(c4, 2, 2) == [] and v5_build_reasons(c4, 3, 1) == [] and v5_build_reasons(small, 4) == []
    assert v5_build_reasons(c4, 3, 2) == ["two halves need two workers, got 3"]
    assert v5_build_reasons(small, 2, 2) == ["two halves need d_c 512 / d_r 64, got 256 / 32"]
    assert v5_build_reasons(c4, 4) == ["four workers need d_c 256, got 512"]
    assert v5_build_reasons(c4, 2, 4) == ["halves: expected one of (1, 2), got 4"]
    assert v5_build_reasons(c4, 5, 1) == ["workers: expected one of (2, 3, 4), got 5"]
    with pytest.raises(ValueError, match="v5 cannot build .* with 3 workers of 2 warpgroups: two halves need two workers"):
        v5_defines(c4, workers=3, halves=2)
    d = v5_defines(c4, halves=2, rope_fold=True, quad_loads=True)  # neither fits four warpgroups' registers
    knobs = ("QMLA_V5_HALVES", "QMLA_V5_ROPE_FOLD", "QMLA_V5_QUAD_LOADS", "QMLA_V5_PACKED_GROUPS")
    assert [d[k] for k in knobs] == [2, 0, 0, 0]
    assert v5_defines(c4)["QMLA_V5_HALVES"] == 1


def test_v5_smem_layout():
    # C4R4: per worker the key tile (the 8 content column blocks of 64 rows x 128 B), P^T 16 x 128 B, the
    # column statistics 4 x 16 floats and 16 bytes of new-maximum flags, rounded to 1 KB; the queries
    # 9 x 16 x 128 B; 1 KB to align the base. No stage (the lanes load their codes into registers), so
    # every format takes the same and the block stays far below the 227 KB an SM has for one
    fmt = qm.PackFormat.parse("C4R4")
    worker = -(-(8 * 64 * 128 + 16 * 128 + 4 * 16 * 4 + 16) // 1024) * 1024
    assert v5_smem_bytes(fmt) == 2 * worker + 9 * 16 * 128 + 1024 == 156672 <= smem_per_block((9, 0))
    assert v5_smem_bytes(qm.PackFormat.parse("C2R4")) == v5_smem_bytes(fmt)
    assert v5_defines(fmt, zfold=False)["QMLA_V5_SMEM"] == v5_smem_bytes(fmt)
    assert v5_defines(fmt)["QMLA_V5_SMEM"] == v5_smem_bytes(fmt, zfold=v5_zfold(fmt))
    assert v5_defines(fmt)["QMLA_V5_LAZY_RESCALE"] == 1
    assert v5_defines(fmt, lazy_rescale=False)["QMLA_V5_LAZY_RESCALE"] == 0
    assert "QMLA_V5_STAGES" not in v5_defines(fmt)
    small = qm.PackFormat.parse("C2R4", 256, 32)
    assert v5_smem_bytes(small) == 2 * 35 * 1024 + 5 * 16 * 128 + 1024 < v5_smem_bytes(fmt)
    # three workers (QUANTMLA_CUPY_V5_WORKERS=3): one more worker area, still one block per SM
    assert v5_smem_bytes(fmt, 3) == 3 * worker + 9 * 16 * 128 + 1024 <= smem_per_block((9, 0))
    assert v5_defines(fmt, workers=3)["QMLA_V5_SMEM"] == v5_smem_bytes(fmt, 3)
    # two halves (QUANTMLA_CUPY_V5_HALVES=2): four areas, each a half's key tile (4 column blocks), P^T, statistics,
    # flags and 4 KB of scores (8 floats a thread) to hand over; each half's queries in 5 column blocks (288 channels)
    half = -(-(4 * 64 * 128 + 16 * 128 + 4 * 16 * 4 + 16 + 128 * 32) // 1024) * 1024
    assert v5_smem_bytes(fmt, 2, 2) == 4 * half + 2 * 5 * 16 * 128 + 1024 == 181248 <= smem_per_block((9, 0))
    assert v5_defines(fmt, halves=2)["QMLA_V5_SMEM"] == v5_smem_bytes(fmt, 2, 2)


def test_v5_unsupported_reasons():
    c4 = qm.PackFormat.parse("C4R4")
    assert v5_unsupported_reasons(c4, (9, 0)) == [] and v5_unsupported_reasons(c4, (9, 0), nvrtc=(13, 0)) == []
    for cap, got in (((8, 0), "got 8.0"), ((10, 0), "got 10.0"), (None, "got an unknown GPU")):
        assert v5_unsupported_reasons(c4, cap) == [f"v5 needs compute capability 9.0 (sm_90a wgmma), {got}"]
    assert v5_unsupported_reasons(c4, (9, 0), nvrtc=(11, 8)) == ["v5 needs NVRTC 12.0+ to build for sm_90a, got 11.8"]
    assert v5_unsupported_reasons(c4, (9, 0), "float32") == ["v5 serves bfloat16 queries (got float32)"]
    for name in ("C8R8", "BF16"):
        why = v5_unsupported_reasons(qm.PackFormat.parse(name), (9, 0))
        assert len(why) == 1 and why[0].startswith("v5 serves 2/4-bit content")
    why = v5_unsupported_reasons(qm.PackFormat.parse("C2R4", group_size=32), (9, 0))
    assert why == ["v5 needs one RoPE group per token"]


def test_v5_selection(monkeypatch):
    c4 = qm.PackFormat.parse("C4R4")
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    # auto: v5 for fewer than V4_MIN_ROWS rows with a long block table on compute capability 9.0
    assert select_variant(c4, "bfloat16", (9, 0), V3_MIN_TOKENS, 16) == ("v5", None)
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20, V4_MIN_ROWS - 1) == ("v5", None)
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20) == ("v5", None)  # rows unknown: few
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20, V4_MIN_ROWS) == ("v6", None)  # many rows: test_cupy_v6
    assert select_variant(c4, "bfloat16", (9, 0), V3_MIN_TOKENS - 64, 16)[0] == "v2"  # short: v2 as before
    # elsewhere v3, as before; on an H200 whose NVRTC cannot build sm_90a, saying so
    assert select_variant(c4, "bfloat16", (8, 0), 1 << 20, 16) == ("v3", None)
    assert select_variant(c4, "bfloat16", None, 1 << 20, 16) == ("v3", None)
    v, why = select_variant(c4, "bfloat16", (9, 0), 1 << 20, 16, nvrtc=(11, 8))
    assert v == "v3" and why == "v5 needs NVRTC 12.0+ to build for sm_90a, got 11.8"
    assert select_variant(c4, "float32", (9, 0), 1 << 20, 16)[0] == "v1"
    # forced: any length and row count where it serves, else v2 with the reasons
    monkeypatch.setenv(VARIANT_ENV, "v5")
    assert select_variant(c4, "bfloat16", (9, 0), 64, 128) == ("v5", None)
    v, why = select_variant(c4, "bfloat16", (8, 0), 1 << 20, 16)
    assert v == "v2" and "compute capability 9.0" in why
    v, why = select_variant(qm.PackFormat.parse("C8R8"), "bfloat16", (9, 0), 1 << 20, 16)
    assert v == "v1" and "2/4-bit content" in why


def _run_v5_stubbed(monkeypatch, h: int, s_q: int, prot: bool, length: int = 500, pages_per: int = 9):
    """A v5 call with the CUDA calls stubbed: 3 requests of ``length`` tokens over ``pages_per`` pages each."""
    return _run_v2_stubbed(monkeypatch, h, s_q, prot, {}, variant="v5", pages_per=pages_per, length=length)


@pytest.mark.parametrize("separate", [False, True], ids=["inline", "separate"])
@pytest.mark.parametrize("h,s_q,prot", [(16, 1, True), (16, 1, False), (8, 3, True), (1, 1, False), (20, 16, True)])
def test_v5_launches_match_kernel_signatures(monkeypatch, h, s_q, prot, separate):
    """One v5 launch over 16-row chunks (two workers of 128 threads, an sm_90a build), each CTA
    writing one partial per worker (the sink and local tokens inside), then the combine; with
    QUANTMLA_CUPY_V5_PROTECTED=separate a packed-only build and protected.cu's partials (on the same
    stream: an eager call over a short table) before the combine."""
    if separate:
        monkeypatch.setenv("QUANTMLA_CUPY_V5_PROTECTED", "separate")
    launches, _kernels, fmt, b = _run_v5_stubbed(monkeypatch, h, s_q, prot)
    params = _kernel_params("attention_v5.cu", "qmla_attn_v5")
    assert params == _kernel_params("attention_v3.cu", "qmla_attn_v3")  # one argument list for all split kernels
    (attn, grid, block, args, smem), stream = launches.of("qmla_attn_v5")
    assert attn.source == "attention_v5.cu" and attn.arch == "sm_90a" and stream is None
    assert len(args) == len(params)
    for a, p in zip(args, params):
        assert isinstance(a, np.uint64 if "*" in p else np.int32 if p.startswith("int ") else np.float32), p
    rows = s_q * h
    assert grid[0] == b * (-(-rows // 16)) and block == (256,)
    assert smem == v5_smem_bytes(fmt, zfold=v5_zfold(fmt)) == attn.defines["QMLA_V5_SMEM"]
    assert attn.defines["QMLA_V5_LAZY_RESCALE"] == 1 and attn.defines["QMLA_V5_ZFOLD"] == int(v5_zfold(fmt))
    assert attn.defines["QMLA_V5_PROTECTED"] == (0 if separate else 1)
    assert int(args[params.index("int sink")]) == (4 if prot else 0)
    assert int(args[params.index("int local")]) == (128 if prot else 0)
    per = int(args[params.index("int tiles_per_split")])
    slots = int(args[params.index("int num_splits")])
    splits = grid[1]
    # the plan covers the table and, where the kernel attends to them itself, its protected tiles (1 sink + 3 local)
    planned = 9 * fmt.page_size + (protected_ctas(4, 128, 64) * 64 if prot and not separate else 0)
    assert splits * per * 64 >= planned and (splits - 1) * per * 64 < planned
    kernels = [rec[0].kernel for rec in launches]
    if prot and separate:
        (prot_k, pgrid, _pblock, pargs, psmem), pstream = launches.of("qmla_attn_protected")
        assert prot_k.source == "protected.cu" and pstream is None and pargs == args  # eager, short table
        assert psmem == protected_smem_bytes(fmt) and pgrid == (b * (-(-rows // 16)), protected_ctas(4, 128))
        assert slots == 2 * splits + protected_ctas(4, 128)
    else:
        assert kernels == ["qmla_attn_v5", "qmla_combine"] and slots == 2 * splits
    combine = launches[-1]
    assert combine[0].kernel == "qmla_combine" and int(combine[3][-1]) == slots


@pytest.mark.parametrize("variant,heads,default", [("v5", 16, "1"), ("v6", 128, "0")])
def test_split_plan_counts_own_protected_tiles(monkeypatch, variant, heads, default):
    """v5 and v6 plan their splits over the table plus the sink/local tiles they append to one split
    with QUANTMLA_CUPY_PLAN_PROTECTED=1 (v5's default), over the table alone with 0 (v6's)."""
    params = _kernel_params(f"attention_{variant}.cu", f"qmla_attn_{variant}")

    def covered(env):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        launches, _k, fmt, _b = _run_v2_stubbed(monkeypatch, heads, 1, True, {}, variant=variant, pages_per=9,
                                                length=500)
        (_attn, grid, _block, args, _smem), _ = launches.of(f"qmla_attn_{variant}")
        return grid[1], int(args[params.index("int tiles_per_split")]) * 64, fmt.page_size

    assert covered({}) == covered({"QUANTMLA_CUPY_PLAN_PROTECTED": default})
    splits, per, page = covered({"QUANTMLA_CUPY_PLAN_PROTECTED": "1"})
    assert splits * per >= 9 * page + 4 * 64 > (splits - 1) * per
    splits, per, page = covered({"QUANTMLA_CUPY_PLAN_PROTECTED": "0"})
    assert splits * per >= 9 * page > (splits - 1) * per
    monkeypatch.setenv("QUANTMLA_CUPY_PLAN_PROTECTED", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_PLAN_PROTECTED"):
        covered({})


def test_v5_auto_on_long_tables(monkeypatch):
    """auto runs v5 for 16 rows over a block table of >= V3_MIN_TOKENS tokens on the stubbed H200
    (NVRTC 13.0), and v3 where NVRTC is older than 12.0."""
    long_pages = V3_MIN_TOKENS // 64
    launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="auto", pages_per=long_pages, length=3000)
    assert [rec[0].kernel for rec in launches] == ["qmla_attn_v5", "qmla_combine"]  # the protected tiles inside
    launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="auto", pages_per=long_pages, length=3000,
                                   nvrtc=(11, 8))
    assert launches[1][0].kernel == "qmla_attn_v3"


def test_v5_auto_on_large_batches(monkeypatch):
    """auto runs v5 over shorter tables once the batch holds V5_MIN_BATCH_TOKENS tokens of capacity
    (measured faster than v2 from 64K tokens), v2 below and where v5 cannot run (v3 is slower than
    v2 there)."""
    c4 = qm.PackFormat.parse("C4R4")
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    per = V5_MIN_BATCH_TOKENS // 16
    assert select_variant(c4, "bfloat16", (9, 0), per, 16, batch=16) == ("v5", None)
    assert select_variant(c4, "bfloat16", (9, 0), 2048, 16, batch=V5_MIN_BATCH_TOKENS // 2048) == ("v5", None)
    v, why = select_variant(c4, "bfloat16", (9, 0), per, 16, batch=15)
    assert v == "v2" and f"from {V3_MIN_TOKENS} tokens" in why
    assert select_variant(c4, "bfloat16", (9, 0), per, 16)[0] == "v2"  # batch unknown: few
    assert select_variant(c4, "bfloat16", (8, 0), per, 16, batch=1024)[0] == "v2"
    assert select_variant(c4, "bfloat16", (9, 0), per, 16, nvrtc=(11, 8), batch=1024)[0] == "v2"
    assert select_variant(c4, "bfloat16", (9, 0), per, V4_MIN_ROWS, batch=1024) == ("v6", None)
    # the launcher asks with its batch size
    from quantmla_core.backends.cupy import attention as A

    asked = []
    monkeypatch.setattr(A, "select_variant", lambda *a, **k: asked.append((a, k)) or select_variant(*a, **k))
    _run_v2_stubbed(monkeypatch, 16, 1, False, {}, variant="auto", pages_per=9)
    assert asked[-1][0][3:5] == (9 * 64, 16) and asked[-1][0][6] == 3


@pytest.mark.parametrize("variant,heads", [("v2", 16), ("v3", 16), ("v4", 128), ("v5", 16)])
def test_protected_side_stream_rule(monkeypatch, variant, heads):
    """The protected-only launch forks onto the side stream under CUDA-graph capture (every variant)
    and in eager v3/v4/v5 calls over tables of >= V3_MIN_TOKENS tokens; shorter eager calls, host-bound,
    keep one stream (the fork costs host time). v5 has that launch only with QUANTMLA_CUPY_V5_PROTECTED=separate."""
    long_pages = V3_MIN_TOKENS // 64
    monkeypatch.setenv("QUANTMLA_CUPY_V5_PROTECTED", "separate")

    def stream_of_protected(pages_per, capturing):
        launches, *_ = _run_v2_stubbed(monkeypatch, heads, 1, True, {}, variant=variant, pages_per=pages_per,
                                       length=3000, capturing=capturing)
        return launches.of("qmla_attn_protected")[1]

    assert stream_of_protected(9, capturing=False) is None
    assert stream_of_protected(9, capturing=True) == "side"
    assert stream_of_protected(long_pages, capturing=False) == (None if variant == "v2" else "side")


def test_v5_plans_splits_with_its_own_overhead(monkeypatch):
    """v5's split plan counts V5_CTA_OVERHEAD_TILES of fixed work per CTA (two workers, two partials),
    v3's the planner's default."""
    from quantmla_core.backends.cupy import plans
    from quantmla_core.backends.splits import CTA_OVERHEAD_TILES

    seen = []
    real = plans.plan_kv_splits
    monkeypatch.setattr(plans, "plan_kv_splits", lambda *a: seen.append(a) or real(*a))
    _run_v5_stubbed(monkeypatch, 16, 1, False)
    assert seen[-1][-1] == plans.V5_CTA_OVERHEAD_TILES == 2.0
    _run_v2_stubbed(monkeypatch, 16, 1, False, {}, variant="v3", pages_per=9)
    assert seen[-1][-1] == CTA_OVERHEAD_TILES == 1.0


def test_v5_knobs(monkeypatch):
    assert V5Knobs.from_env() == V5Knobs(True) == V5Knobs(True, separate=False)
    monkeypatch.setenv("QUANTMLA_CUPY_V5_PROTECTED", "separate")
    assert V5Knobs.from_env() == V5Knobs(True, separate=True)
    monkeypatch.setenv("QUANTMLA_CUPY_V5_PROTECTED", "in")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_PROTECTED"):
        V5Knobs.from_env()
    monkeypatch.delenv("QUANTMLA_CUPY_V5_PROTECTED")
    launches, *_ = _run_v5_stubbed(monkeypatch, 16, 1, True)
    (attn, *_), _ = launches.of("qmla_attn_v5")
    assert attn.defines["QMLA_V5_PROT_VEC"] == 1 and attn.defines["QMLA_V5_PROTECTED"] == 1  # vec loads by default
    assert V5Knobs.from_env().prot_vec is True
    for value, vec in (("vec", True), ("pairs", False)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_PROT_LOADS", value)
        assert V5Knobs.from_env() == V5Knobs(True, prot_vec=vec)
    assert attn.defines["QMLA_CODES_IN_PLACE"] == 0  # the stub's format has 4-bit content: nothing to convert
    assert V5Knobs.from_env().codes_in_place is True  # on by default (CODES_IN_PLACE)
    monkeypatch.setenv("QUANTMLA_CUPY_CODES_IN_PLACE", "0")
    assert V5Knobs.from_env() == V5Knobs(True, prot_vec=False, codes_in_place=False)
    assert v5_defines(qm.PackFormat.parse("C2R4"), codes_in_place=True)["QMLA_CODES_IN_PLACE"] == 1
    assert v5_defines(qm.PackFormat.parse("C4R4"), codes_in_place=True)["QMLA_CODES_IN_PLACE"] == 0  # 2-bit only
    monkeypatch.delenv("QUANTMLA_CUPY_CODES_IN_PLACE")
    launches, *_ = _run_v5_stubbed(monkeypatch, 16, 1, True)
    (attn, *_), _ = launches.of("qmla_attn_v5")
    assert attn.defines["QMLA_V5_PROT_VEC"] == 0 and attn.defines["QMLA_V5_PROTECTED"] == 1
    launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name="C2R4")
    assert launches.of("qmla_attn_v5")[0][0].defines["QMLA_CODES_IN_PLACE"] == 1  # 2-bit content: on by default
    assert launches.of("qmla_attn_v5")[0][0].defines["QMLA_V5_ROPE_FOLD"] == 1  # 2-bit content: on by default

    monkeypatch.setenv("QUANTMLA_CUPY_V5_PROT_LOADS", "wide")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_PROT_LOADS"):
        V5Knobs.from_env()
    monkeypatch.delenv("QUANTMLA_CUPY_V5_PROT_LOADS")
    monkeypatch.setenv("QUANTMLA_CUPY_V5_WORKERS", "3")
    assert V5Knobs.from_env() == V5Knobs(True, workers=3)
    launches, *_ = _run_v5_stubbed(monkeypatch, 16, 1, False)
    (attn, grid, block, args, smem), _ = launches.of("qmla_attn_v5")
    assert attn.defines["QMLA_V5_WORKERS"] == 3 and block == (384,) and smem == attn.defines["QMLA_V5_SMEM"]
    params = _kernel_params("attention_v5.cu", "qmla_attn_v5")
    assert int(args[params.index("int num_splits")]) == 3 * grid[1]  # one partial per worker
    monkeypatch.setenv("QUANTMLA_CUPY_V5_HALVES", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_HALVES=2 cannot serve this call: two halves need two workers"):
        _run_v5_stubbed(monkeypatch, 16, 1, False)
    monkeypatch.delenv("QUANTMLA_CUPY_V5_HALVES")
    monkeypatch.setenv("QUANTMLA_CUPY_V5_WORKERS", "4")  # the stub's cache is d_c 512
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_WORKERS=4 .* four workers need d_c 256, got 512"):
        _run_v5_stubbed(monkeypatch, 16, 1, False)
    monkeypatch.setenv("QUANTMLA_CUPY_V5_HALVES", "2")
    monkeypatch.setenv("QUANTMLA_CUPY_V5_WORKERS", "5")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_WORKERS"):
        V5Knobs.from_env()
    monkeypatch.delenv("QUANTMLA_CUPY_V5_WORKERS")
    assert V5Knobs.from_env() == V5Knobs(True, halves=2)
    launches, *_ = _run_v5_stubbed(monkeypatch, 16, 1, False)
    (attn, grid, block, args, smem), _ = launches.of("qmla_attn_v5")
    assert attn.defines["QMLA_V5_HALVES"] == 2 and block == (512,) and smem == attn.defines["QMLA_V5_SMEM"]
    assert int(args[params.index("int num_splits")]) == 2 * grid[1]  # one partial per worker, not per warpgroup
    monkeypatch.setenv("QUANTMLA_CUPY_V5_HALVES", "3")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_HALVES"):
        V5Knobs.from_env()
    monkeypatch.delenv("QUANTMLA_CUPY_V5_HALVES")
    monkeypatch.setenv("QUANTMLA_CUPY_V5_LAZY_RESCALE", "0")
    assert V5Knobs.from_env() == V5Knobs(False)
    launches, *_ = _run_v5_stubbed(monkeypatch, 16, 1, False)
    (attn, *_), _ = launches.of("qmla_attn_v5")
    assert attn.defines["QMLA_V5_LAZY_RESCALE"] == 0
    monkeypatch.setenv("QUANTMLA_CUPY_V5_LAZY_RESCALE", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_LAZY_RESCALE"):
        V5Knobs.from_env()


#: few-row cases: one full 16-row chunk and partial ones (H 1, 8, 20 x S_q), S_q > 1 (causal), lengths at
#: tile and page edges, an odd number of tiles per split (the second worker idle at the end), d_c 256
#: with groups of 128, no protection, a sink of two tiles, 128-token pages
V5_CASES = [
    Case(qm.PackFormat.parse("C4R4"), (64, 65, 4097, 128), heads=16, s_q=1, sink=4, local=128, seed=990),
    Case(qm.PackFormat.parse("C2R4", page_size=32), (1000, 129, 192), heads=16, s_q=1, sink=4, local=128, seed=991),
    Case(qm.PackFormat.parse("C4R4", 256, 32, group_size=128), (700, 63), heads=8, s_q=3, sink=0, local=0, seed=992),
    Case(qm.PackFormat.parse("C2R4", page_size=16), (300, 17), heads=20, s_q=2, sink=4, local=16, seed=993),
    Case(qm.PackFormat.parse("C4R4", page_size=128), (6000, 3000), heads=16, s_q=1, sink=0, local=0, seed=994),
    Case(qm.PackFormat.parse("C2R4"), (300, 70, 5), heads=1, s_q=1, sink=100, local=40, seed=995),
    # 128-token pages: a tile starts mid-page
    Case(qm.PackFormat.parse("C2R4", page_size=128), (5000, 321), heads=16, s_q=1, sink=4, local=128, seed=996),
    # protected tiles with S_q 4 (four 16-row chunks, causal limits inside the local window), a request of S_q tokens
    # (its sink tile only) and one whose protected split is past its packed tokens
    Case(qm.PackFormat.parse("C4R4"), (2000, 4, 150), heads=16, s_q=4, sink=4, local=128, seed=997),
    # a one-token sink and ring: with S_q 2 the first new token comes from its packed copy
    Case(qm.PackFormat.parse("C2R4"), (7, 2, 200), heads=16, s_q=2, sink=1, local=1, seed=998),
]


def test_v5_rope_fold_knob(monkeypatch):
    """QUANTMLA_CUPY_V5_ROPE_FOLD (``auto``: 2-bit content, ROPE_FOLD_CONTENT_BITS, and builds with quad loads;
    ``0``/``1`` force it) reaches the build as QMLA_V5_ROPE_FOLD, for two workers only."""
    assert ROPE_FOLD_CONTENT_BITS == (2,) and V5Knobs.from_env().rope_fold is None
    c2, c4 = qm.PackFormat.parse("C2R4"), qm.PackFormat.parse("C4R4")
    c4_256 = qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32)
    assert v5_defines(c2)["QMLA_V5_ROPE_FOLD"] == 1 and v5_defines(c4)["QMLA_V5_ROPE_FOLD"] == 1
    assert v5_defines(c4, quad_loads=False)["QMLA_V5_ROPE_FOLD"] == 0 and v5_defines(c4_256)["QMLA_V5_ROPE_FOLD"] == 0
    assert v5_defines(c4, rope_fold=False)["QMLA_V5_ROPE_FOLD"] == 0
    assert v5_defines(c4, rope_fold=True, quad_loads=False)["QMLA_V5_ROPE_FOLD"] == 1
    assert v5_defines(c2, rope_fold=False)["QMLA_V5_ROPE_FOLD"] == 0
    assert v5_defines(c2, workers=3)["QMLA_V5_ROPE_FOLD"] == 0  # no registers for the second accumulator
    for value, fold in (("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_ROPE_FOLD", value)
        assert V5Knobs.from_env() == V5Knobs(True, rope_fold=fold)
    for fmt_name, value, want in (("C2R4", "0", 0), ("C4R4", "0", 0), ("C4R4", "auto", 1)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_ROPE_FOLD", value)
        launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name=fmt_name)
        assert launches.of("qmla_attn_v5")[0][0].defines["QMLA_V5_ROPE_FOLD"] == want, (fmt_name, value)
    monkeypatch.setenv("QUANTMLA_CUPY_V5_ROPE_FOLD", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_ROPE_FOLD"):
        V5Knobs.from_env()


def test_v5_packed_groups_knob(monkeypatch):
    """QUANTMLA_CUPY_V5_PACKED_GROUPS (0/1, default V5_PACKED_GROUPS) reaches the build as QMLA_V5_PACKED_GROUPS, only
    for 2-bit d_c 512 content with 64-channel groups and two workers."""
    c2 = qm.PackFormat.parse("C2R4")
    assert V5_PACKED_GROUPS and V5Knobs.from_env().packed_groups
    assert v5_defines(c2)["QMLA_V5_PACKED_GROUPS"] == 1 and v5_defines(c2, packed_groups=False)["QMLA_V5_PACKED_GROUPS"] == 0
    for fmt, kw in ((qm.PackFormat.parse("C4R4"), {}), (qm.PackFormat.parse("C2R4", latent_dim=256, rope_dim=32), {}),
                    (qm.PackFormat.parse("C2R4", group_size=128), {}), (c2, {"workers": 3})):
        assert v5_defines(fmt, packed_groups=True, **kw)["QMLA_V5_PACKED_GROUPS"] == 0, (fmt, kw)
    for value, want in (("0", 0), ("1", 1)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_PACKED_GROUPS", value)
        assert V5Knobs.from_env() == V5Knobs(True, packed_groups=bool(want))
        launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name="C2R4")
        assert launches.of("qmla_attn_v5")[0][0].defines["QMLA_V5_PACKED_GROUPS"] == want, value
    monkeypatch.setenv("QUANTMLA_CUPY_V5_PACKED_GROUPS", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_PACKED_GROUPS"):
        V5Knobs.from_env()


def test_v5_quad_loads_knob(monkeypatch):
    """QUANTMLA_CUPY_V5_QUAD_LOADS (``auto``: V5_QUAD_LOADS; ``0``/``1`` force it) reaches the build as
    QMLA_V5_QUAD_LOADS, only for 4-bit d_c 512 content with 64-channel groups and two workers; forcing it off takes
    the RoPE fold's default with it."""
    c2, c4 = qm.PackFormat.parse("C2R4"), qm.PackFormat.parse("C4R4")
    assert V5_QUAD_LOADS and V5Knobs.from_env().quad_loads is None
    assert v5_defines(c4)["QMLA_V5_QUAD_LOADS"] == 1 and v5_defines(c4, quad_loads=False)["QMLA_V5_QUAD_LOADS"] == 0
    for fmt, kw in ((c2, {}), (qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32), {}),
                    (qm.PackFormat.parse("C4R4", group_size=128), {}), (c4, {"workers": 3})):
        assert v5_defines(fmt, quad_loads=True, **kw)["QMLA_V5_QUAD_LOADS"] == 0, (fmt, kw)
    for value, quad in (("auto", None), ("0", False), ("1", True)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_QUAD_LOADS", value)
        assert V5Knobs.from_env() == V5Knobs(True, quad_loads=quad)
    for value, want in (("0", (0, 0)), ("1", (1, 1)), ("auto", (1, 1))):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_QUAD_LOADS", value)
        launches, *_ = _run_v2_stubbed(monkeypatch, 16, 1, True, {}, variant="v5", fmt_name="C4R4")
        d = launches.of("qmla_attn_v5")[0][0].defines
        assert (d["QMLA_V5_QUAD_LOADS"], d["QMLA_V5_ROPE_FOLD"]) == want, value
    monkeypatch.setenv("QUANTMLA_CUPY_V5_QUAD_LOADS", "yes")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_QUAD_LOADS"):
        V5Knobs.from_env()


def _check_v5(case: Case, monkeypatch, env: dict[str, str]) -> None:
    """``case`` through v5 on the H200 with the variables ``env`` set (skipped on other GPUs)."""
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != (9, 0):
        pytest.skip(f"v5 is an sm_90a kernel: this GPU is compute capability {cap[0]}.{cap[1]}")
    monkeypatch.setenv(VARIANT_ENV, "v5")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case, workers", [(c, w) for c in [c for c in V2_CASES + BIG[:3] if c.fmt.quantized] + V5_CASES
                                           for w in V5_WORKER_CHOICES if not v5_build_reasons(c.fmt, w)],
                         ids=lambda v: str(v))
def test_attention_v5_matches_reference(case, workers, monkeypatch):
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_WORKERS": str(workers)})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V5_CASES
                                  if c.fmt.quantized and (c.fmt.latent_dim, c.fmt.rope_dim) == (512, 64)], ids=str)
def test_attention_v5_halves_match_reference(case, monkeypatch):
    """Two warpgroups a worker, each over half of every tile's channels (``QUANTMLA_CUPY_V5_HALVES=2``): the same
    attention as the reference."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_HALVES": "2"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V5_CASES if c.fmt.content_bits == 2], ids=str)
def test_attention_v5_codes_shifted_match_reference(case, monkeypatch):
    """2-bit codes shifted to bit 0 before conversion (``QUANTMLA_CUPY_CODES_IN_PLACE=0``; the default converts them
    where they lie in their byte: attention.py's CODES_IN_PLACE) compute the same attention."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_CODES_IN_PLACE": "0"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", BIG[:3] + V5_CASES, ids=str)
def test_attention_v5_rope_fold_flipped_match_reference(case, monkeypatch):
    """Each format's other RoPE build (``QUANTMLA_CUPY_V5_ROPE_FOLD``; by default 2-bit content and builds with quad
    loads multiply each score's RoPE part by the token's scale once, others dequantize each RoPE value) computes the
    same attention."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_ROPE_FOLD": "0" if v5_rope_fold(case.fmt, 2) else "1"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in BIG[:3] + V5_CASES if v5_quad_loads(c.fmt, 2, True)], ids=str)
def test_attention_v5_quad_loads_flipped_match_reference(case, monkeypatch):
    """The other code-load build (``QUANTMLA_CUPY_V5_QUAD_LOADS``: a quad of lanes loads a token's 4-bit d_c 512 codes
    together, each lane's share then spanning every scale group) computes the same attention, sink and local tokens
    included (their bf16 rows follow the same channel order)."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_QUAD_LOADS": "0" if v5_quad_loads(case.fmt) else "1"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in BIG[:3] + V5_CASES if v5_defines(c.fmt, packed_groups=True)
                                  ["QMLA_V5_PACKED_GROUPS"]], ids=str)
def test_attention_v5_packed_groups_flipped_match_reference(case, monkeypatch):
    """The other zero-point load build (``QUANTMLA_CUPY_V5_PACKED_GROUPS``: a token's 2-bit d_c 512 zero points and
    scales in one load each, the lane's groups picked once a tile) computes the same attention."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_PACKED_GROUPS": "0" if V5_PACKED_GROUPS else "1"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V5_CASES if v5_zfold(c.fmt, zfold=True)], ids=str)
def test_attention_v5_zfold_flipped_match_reference(case, monkeypatch):
    """The other zero-point build (``QUANTMLA_CUPY_V5_ZFOLD``: keys as bf16(s code), the zero points' share added back
    through two more QK k-steps and one more PV block) computes the same attention, sink and local tiles included."""
    _check_v5(case, monkeypatch, {"QUANTMLA_CUPY_V5_ZFOLD": "0" if V5_ZFOLD else "1"})


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("env", [("QUANTMLA_CUPY_V5_PROTECTED", "separate"), ("QUANTMLA_CUPY_V5_PROT_LOADS", "pairs")],
                         ids=lambda e: f"{e[0]}={e[1]}")
@pytest.mark.parametrize("case", [c for c in V5_CASES if c.sink or c.local], ids=str)
def test_attention_v5_protected_modes_match_reference(case, env, monkeypatch):
    """The other ways to the sink and local tokens pass the same check as the default build: protected.cu's
    launch beside a packed-only v5 (``separate``), and a protected tile's bf16 pairs loaded one by one
    (``pairs``; the default loads them in loads of up to 16 bytes)."""
    _check_v5(case, monkeypatch, dict([env]))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V5_CASES[:2] + V5_CASES[4:5], ids=str)
def test_attention_v5_auto_and_eager_rescale(case, monkeypatch):
    """auto picks v5 for these few-row requests over a long block table on this GPU, and the eager
    rescale (QUANTMLA_CUPY_V5_LAZY_RESCALE=0) passes the same check."""
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != (9, 0):
        pytest.skip(f"v5 is an sm_90a kernel: this GPU is compute capability {cap[0]}.{cap[1]}")
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    assert select_variant(case.fmt, "bfloat16", cap, 1 << 20, case.s_q * case.heads)[0] == "v5"
    monkeypatch.setenv(VARIANT_ENV, "v5")
    monkeypatch.setenv("QUANTMLA_CUPY_V5_LAZY_RESCALE", "0")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


def test_v5_workers_rule(monkeypatch):
    """``QUANTMLA_CUPY_V5_WORKERS`` unset or ``auto``: four workers at d_c 256 from V5_FOUR_WORKERS_MIN_TOKENS of batch x
    block-table capacity (where they build), else two; a set value wins; the plan launches what the rule says."""
    from quantmla_core.backends.cupy import plans
    from quantmla_core.backends.cupy.builds import V5_FOUR_WORKERS_MIN_TOKENS, v5_workers
    from quantmla_core.testing import stub_cupy_launcher

    small, c4 = qm.PackFormat.parse("C4R4", 256, 32), qm.PackFormat.parse("C4R4")
    assert V5_FOUR_WORKERS_MIN_TOKENS == 1 << 22
    assert v5_workers(small, 128, 32768) == 4 and v5_workers(small, 32, 131072) == 4
    assert v5_workers(small, 32, 32768) == 2 and v5_workers(small, 8, 4096) == 2
    assert v5_workers(c4, 128, 131072) == 2  # four workers build at d_c 256 only
    assert v5_workers(small, 128, 32768, workers=2) == 2 and v5_workers(small, 8, 4096, workers=4) == 4
    for raw, want in (("", None), ("auto", None), ("3", 3)):
        monkeypatch.setenv("QUANTMLA_CUPY_V5_WORKERS", raw)
        assert V5Knobs.from_env().workers == want
    monkeypatch.setenv("QUANTMLA_CUPY_V5_WORKERS", "many")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V5_WORKERS: expected one of"):
        V5Knobs.from_env()
    stub_cupy_launcher(monkeypatch)
    for batch, pages, knobs, threads in ((128, 512, V5Knobs(), 512), (32, 512, V5Knobs(), 256),
                                         (128, 512, V5Knobs(workers=2), 256)):
        plan = plans.v5_plan(small, 0, 132, batch, 16, pages, True, knobs)
        (attn, _grid, block, smem), = plan.launches
        assert block == (threads,) and attn.defines["QMLA_V5_WORKERS"] == threads // 128, (batch, knobs)
        assert smem == attn.defines["QMLA_V5_SMEM"]
