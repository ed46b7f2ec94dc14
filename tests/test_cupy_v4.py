"""CuPy attention kernel v4 (64 query rows per CTA share one dequantized tile, ``kernels/attention_v4.cu``).

CPU: the kernel compiles for sm_90 and sm_80 without spills at every served format, dims,
group and page size, and its shared-memory layout matches the launcher's; auto picks it for
requests with many query rows and says why where it cannot; the stubbed launch matches the
kernel's signature, covers every row in 64-row chunks and adds the protected-only launch for
caches with sink/local tokens. GPU: conformance against the reference on v2's cases and on
many-row cases (H = 64 / 96 / 128, S_q > 1, rows that do not fill the last chunk)."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from conformance import Case, check_attention_case
from quantmla_core.backends.cupy.builds import (
    protected_ctas,
    protected_smem_bytes,
    smem_per_block,
    stage_bytes,
    v4_defines,
    v4_smem_bytes,
    v4_uses_wgmma,
)
from quantmla_core.backends.cupy.knobs import V4Knobs
from quantmla_core.backends.cupy.variants import V4_MIN_ROWS, VARIANT_ENV, select_variant, v4_unsupported_reasons
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

#: (arch, format, d_c, d_r, group size, page size, stages[, "prot": the build whose own CTAs take the protected
#: tiles][, "wgmma": the sm_90a build whose matmuls are warpgroup MMAs])
V4_BUILDS = [
    ("sm_90", "C4R4", 512, 64, 64, 64, 2),
    ("sm_90", "C2R4", 512, 64, 64, 64, 2),
    ("sm_90", "C4R4", 512, 64, 128, 16, 2),
    ("sm_90", "C2R4", 512, 64, 128, 128, 2),
    ("sm_90", "C4R4", 256, 32, 64, 32, 2),
    ("sm_90", "C2R4", 256, 32, 32, 64, 3),
    ("sm_80", "C4R4", 256, 32, 64, 64, 2),
    ("sm_80", "C2R4", 256, 32, 128, 16, 2),
    ("sm_90", "C4R4", 512, 64, 64, 64, 2, "prot"),
    ("sm_90", "C4R4", 512, 64, 128, 16, 2, "prot"),
    ("sm_90", "C2R4", 256, 32, 64, 32, 2, "prot"),
    ("sm_90a", "C4R4", 512, 64, 64, 64, 2, "wgmma"),
    ("sm_90a", "C2R4", 512, 64, 128, 16, 2, "wgmma"),
    ("sm_90a", "C4R4", 256, 32, 64, 32, 2, "wgmma"),
    ("sm_90a", "C2R4", 256, 32, 32, 64, 3, "wgmma"),
    ("sm_90a", "C4R4", 512, 64, 64, 64, 2, "prot", "wgmma"),
    # bf16 pages: rows copied into the key tile
    ("sm_90a", "BF16", 512, 64, 64, 64, 2, "wgmma"),
    ("sm_90a", "BF16", 256, 32, 64, 16, 2, "prot", "wgmma"),
    ("sm_90", "BF16", 512, 64, 64, 16, 2),
    ("sm_80", "BF16", 256, 32, 64, 32, 2),
]


def _compile_v4(v: tuple) -> tuple[int, str, str]:
    arch, name, dc, dr, gs, page, stages = v[:7]
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
    defines = v4_defines(fmt, stages, protected="prot" in v[7:], wgmma="wgmma" in v[7:])
    return compile_cubin_and_ptx("attention_v4.cu", arch, defines)


@lru_cache(maxsize=1)
def _compiled_v4() -> dict:
    return compile_all(V4_BUILDS, _compile_v4)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V4_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v4_compiles_without_spills(build):
    """Every served build compiles (its static_asserts hold, among them the launcher's shared-memory
    size), keeps the 128 PV accumulators of a thread in registers, and runs both matmuls on the
    tensor cores: mma.sync with the value rows read transposed by ldmatrix, or (the sm_90a build)
    wgmma from shared memory, with no MMA serialized by ptxas."""
    rc, text, ptx = _compiled_v4()[build]
    assert rc == 0, f"nvcc failed for v4 {build}:\n{text[-4000:]}"
    use = ptxas_usage(text)
    print(f"v4 {build}: {use}")
    assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v4 {build} spills: {use}"
    dc = build[2]
    if "wgmma" in build[7:]:
        # QK: (d_c + d_r) / 32 k-steps of a channel half, m64n64k16; PV: 4 k-steps of 16 tokens over d_c / 2
        # channels; one commit and one wait for each
        assert ptx.count("wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16") == (dc + build[3]) // 32
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{dc // 2}k16.f32.bf16.bf16") == 4
        assert ptx.count("wgmma.commit_group.sync.aligned") == 2 and ptx.count("wgmma.wait_group.sync.aligned 0") == 2
        assert "mma.sync" not in ptx and "ldmatrix" not in ptx and "fence.proxy.async.shared::cta" in ptx
        assert "C7515" not in text and "serialized" not in text, text  # ptxas: "wgmma ... serialized"
        _check_tile_source(build[1], ptx)
        return
    # QK: (d_c + d_r) / 32 k-steps (a channel half) x 8 n-tiles (64 tokens); PV: 4 k-steps x 2 m-tiles x
    # d_c / 32 n-tiles (a quarter of d_c / 8); both unrolled
    assert ptx.count("mma.sync.aligned.m16n8k16") == (dc + build[3]) // 32 * 8 + 4 * 2 * dc // 32
    assert "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16" in ptx
    _check_tile_source(build[1], ptx)


def _check_tile_source(fmt_name: str, ptx: str) -> None:
    """Packed builds dequantize with bf16x2 FMAs; bf16-page builds copy rows and prefetch the next tile."""
    if fmt_name == "BF16":
        assert "fma.rn.bf16x2" not in ptx and "prefetch.global.L2" in ptx and "cp.async.cg.shared.global" in ptx
    else:
        assert "fma.rn.bf16x2" in ptx and "prefetch.global.L2" not in ptx


@pytest.mark.parametrize("capability, kib", [((8, 0), 163), ((8, 6), 99), ((8, 7), 163), ((8, 9), 99), ((9, 0), 227),
                                             ((10, 0), 227), ((10, 3), 227), ((11, 0), 227), ((12, 0), 99),
                                             ((12, 1), 99), (None, 227)])
def test_smem_per_block_by_compute_capability(capability, kib):
    """Consumer Blackwell (sm_120/121) gives a block 99 KB like sm_86/89, not Hopper's 227 KB: v4's plan checks
    against it."""
    assert smem_per_block(capability) == kib * 1024


def test_v4_smem_layout():
    # C4R4, 2 stages of 64 x 317 B, K and queries 64 rows x (576 x 2 + 16) B, P 64 x (128 + 16) B, the
    # score exchange 8 warps x 4 n-tiles x 32 lanes x 16 B, four float rows of 64 row statistics
    fmt = qm.PackFormat.parse("C4R4")
    assert v4_smem_bytes(fmt) == 2 * 64 * 317 + 2 * 64 * 1168 + 64 * 144 + 8 * 4 * 32 * 16 + 4 * 256
    assert v4_smem_bytes(fmt, 3) == v4_smem_bytes(fmt) + stage_bytes(fmt, 64, False)
    assert v4_smem_bytes(fmt) <= smem_per_block((9, 0)) < v4_smem_bytes(fmt, 3)  # 3 stages only at d_c 256
    assert v4_smem_bytes(qm.PackFormat.parse("C4R4", 256, 32), 3) <= smem_per_block((9, 0))
    assert v4_defines(fmt)["QMLA_V4_SMEM"] == v4_smem_bytes(fmt)
    # wgmma build: stages rounded to 1 KB, K and queries as 9 column blocks of 64 rows x 128 B, P 64 x 128 B,
    # the same exchange and statistics, 1 KB to align the base
    wg = -(-2 * 64 * 317 // 1024) * 1024 + 2 * 9 * 64 * 128 + 64 * 128 + 8 * 4 * 32 * 16 + 4 * 256 + 1024
    assert v4_smem_bytes(fmt, 2, wgmma=True) == wg <= smem_per_block((9, 0))
    assert v4_defines(fmt, wgmma=True)["QMLA_V4_SMEM"] == wg and v4_defines(fmt, wgmma=True)["QMLA_V4_WGMMA"] == 1
    # bf16 pages are copied straight into the key tile: no stages
    bf = qm.PackFormat.parse("BF16")
    assert v4_smem_bytes(bf) == v4_smem_bytes(fmt) - 2 * 64 * 317
    assert v4_smem_bytes(bf, 2, wgmma=True) == wg - 40 * 1024
    assert v4_unsupported_reasons(bf, (9, 0)) == [] and v4_unsupported_reasons(qm.PackFormat.parse("BF16", 256, 32), (8, 0)) == []
    why = v4_unsupported_reasons(bf, (8, 0))
    assert len(why) == 1 and "shared memory" in why[0]
    assert v4_unsupported_reasons(bf, (9, 0), "float32") == ["v4 serves bfloat16 queries (got float32)"]
    why = v4_unsupported_reasons(qm.PackFormat.parse("C8R8"), (9, 0))
    assert why and all(w.startswith("v4 ") for w in why) and "2/4-bit content" in why[0]
    # the 512-wide latent needs Hopper's 227 KB; the 256-wide one fits an A100's 163 KB
    assert v4_unsupported_reasons(fmt, (9, 0)) == []
    why = v4_unsupported_reasons(fmt, (8, 0))
    assert len(why) == 1 and str(v4_smem_bytes(fmt)) in why[0] and "8.0" in why[0]
    assert v4_unsupported_reasons(qm.PackFormat.parse("C4R4", 256, 32), (8, 0)) == []
    assert v4_unsupported_reasons(qm.PackFormat.parse("C4R4", 256, 32), (8, 6))  # 99 KB parts
    # one RoPE scale per token is staged: groups of 32 serve d_r 32, not d_r 64
    assert v4_unsupported_reasons(qm.PackFormat.parse("C2R4", 256, 32, group_size=32), (9, 0)) == []
    why = v4_unsupported_reasons(qm.PackFormat.parse("C2R4", group_size=32), (9, 0))
    assert len(why) == 1 and "one RoPE group" in why[0]


def test_v4_selection(monkeypatch):
    c4 = qm.PackFormat.parse("C4R4")
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    # auto: from V4_MIN_ROWS query rows per request, whatever the context length, v6 over packed pages on
    # an H200 (test_cupy_v6), else v4: on an H200 whose NVRTC cannot build sm_90a v4 runs mma.sync, saying why
    assert select_variant(c4, "bfloat16", (9, 0), 4096, V4_MIN_ROWS) == ("v6", None)
    v, why = select_variant(c4, "bfloat16", (9, 0), 1 << 20, 128, nvrtc=(11, 8))
    assert v == "v4" and why == "v6 needs NVRTC 12.0+ to build for sm_90a, got 11.8"
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20, V4_MIN_ROWS - 1) == ("v5", None)
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20) == ("v5", None)  # rows unknown: few
    # on an A100 the 512-wide v4 does not fit: auto keeps v3/v2's rule
    assert select_variant(c4, "bfloat16", (8, 0), 1 << 20, 128) == ("v3", None)
    assert select_variant(c4, "float32", (9, 0), 1 << 20, 128)[0] == "v1"
    assert select_variant(qm.PackFormat.parse("C8R8"), "bfloat16", (9, 0), 1 << 20, 128)[0] == "v1"
    # bf16 pages: v4 from V4_MIN_ROWS rows (bfloat16 queries), else v1, saying why
    bf = qm.PackFormat.parse("BF16")
    assert select_variant(bf, "bfloat16", (9, 0), 4096, 128) == ("v4", None)
    v, why = select_variant(bf, "bfloat16", (9, 0), 1 << 20, 16)
    assert v == "v1" and f"from {V4_MIN_ROWS} query rows" in why
    v, why = select_variant(bf, "float32", (9, 0), 1 << 20, 128)
    assert v == "v1" and "bfloat16 queries" in why
    assert select_variant(bf, "bfloat16", (8, 0), 1 << 20, 128)[0] == "v1"  # 512-wide v4 needs sm_90's 227 KB
    monkeypatch.setenv(VARIANT_ENV, "v4")
    assert select_variant(c4, "bfloat16", (9, 0)) == ("v4", None)  # asked for: any row count
    assert select_variant(bf, "bfloat16", (9, 0)) == ("v4", None)
    v, why = select_variant(bf, "bfloat16", (8, 0), 1 << 20, 128)
    assert v == "v1" and "shared memory" in why
    v, why = select_variant(c4, "bfloat16", (8, 0), 1 << 20, 128)
    assert v == "v2" and "shared memory" in why
    monkeypatch.setenv(VARIANT_ENV, "v3")
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20, 128) == ("v3", None)


def _run_v4_stubbed(monkeypatch, h: int, s_q: int, prot: bool):
    """A v4 call with the CUDA calls stubbed: 3 requests of 500 tokens over 9 pages each."""
    return _run_v2_stubbed(monkeypatch, h, s_q, prot, {}, variant="v4", pages_per=9, length=500)


@pytest.mark.parametrize("h,s_q,prot,in_grid", [(128, 1, True, False), (96, 1, True, True), (16, 5, False, False),
                                                 (1, 1, True, False), (128, 2, True, True), (64, 1, False, True)])
def test_v4_launches_match_kernel_signatures(monkeypatch, h, s_q, prot, in_grid):
    """One v4 launch over 64-row chunks and the combine. A cache with sink/local tokens adds, for
    splits of >= V4_INGRID_MIN_TILES tiles (patched here to choose), one CTA per protected 64-token
    tile to the same launch (the protected build), else v2/v3's protected-only kernel."""
    from quantmla_core.backends.cupy import plans

    monkeypatch.setattr(plans, "V4_INGRID_MIN_TILES", 1 if in_grid else 1 << 30)
    launches, _kernels, fmt, b = _run_v4_stubbed(monkeypatch, h, s_q, prot)
    params = _kernel_params("attention_v4.cu", "qmla_attn_v4")
    assert params == _kernel_params("attention_v3.cu", "qmla_attn_v3")  # one argument list for all split kernels
    (attn, grid, block, args, smem), stream = launches.of("qmla_attn_v4")
    assert attn.source == "attention_v4.cu" and stream is None  # on the caller's stream
    assert len(args) == len(params)
    for a, p in zip(args, params):
        assert isinstance(a, np.uint64 if "*" in p else np.int32 if p.startswith("int ") else np.float32), p
    rows = s_q * h
    assert grid[0] == b * (-(-rows // 64)) and block == (256,)
    # the stubbed GPU is an sm_90: auto runs the wgmma build, compiled for sm_90a
    assert smem == v4_smem_bytes(fmt, 2, wgmma=True) == attn.defines["QMLA_V4_SMEM"]
    assert attn.defines["QMLA_V4_WGMMA"] == 1 and attn.arch == "sm_90a"
    assert attn.defines["QMLA_V4_STAGES"] == 2 and attn.defines["QMLA_V4_LAZY_RESCALE"] == 1
    assert attn.defines["QMLA_V4_PROTECTED"] == int(prot and in_grid)
    per = int(args[params.index("int tiles_per_split")])
    slots = int(args[params.index("int num_splits")])
    kernels = [rec[0].kernel for rec in launches]
    if prot and in_grid:  # the 4 sink tokens' tile and the three tiles a 128-token window can touch
        assert kernels == ["qmla_attn_v4", "qmla_combine"]
        splits = grid[1] - protected_ctas(4, 128, 64)
        assert protected_ctas(4, 128, 64) == 4 and slots == grid[1]
    elif prot:  # protected.cu (16-row chunks, 32-token tiles) adds the last 6 partials, on the side stream
        (prot_k, pgrid, _pblock, pargs, psmem), pstream = launches.of("qmla_attn_protected")
        assert prot_k.source == "protected.cu" and pstream is None and pargs == args  # eager, short table
        assert psmem == protected_smem_bytes(fmt) and pgrid == (b * (-(-rows // 16)), 6)
        splits = grid[1]
        assert slots == splits + 6
    else:
        assert kernels == ["qmla_attn_v4", "qmla_combine"]
        splits = grid[1]
        assert slots == splits
    assert splits * per * 64 >= 9 * fmt.page_size and (splits - 1) * per * 64 < 9 * fmt.page_size
    combine = launches[-1]
    assert combine[0].kernel == "qmla_combine" and int(combine[3][-1]) == slots


@pytest.mark.parametrize("variant", ["auto", "v4"])
def test_v4_serves_bf16_pages(monkeypatch, variant):
    """bf16 pages with 128 query rows run v4 (auto and forced): its bf16-page build (QMLA_QUANT 0,
    no stages in its shared memory), wgmma on the stubbed sm_90, then the combine."""
    launches, _kernels, fmt, b = _run_v2_stubbed(monkeypatch, 128, 1, False, {}, variant=variant, pages_per=9,
                                                 length=500, fmt_name="BF16")
    (attn, grid, block, _args, smem), _ = launches.of("qmla_attn_v4")
    assert attn.defines["QMLA_QUANT"] == 0 and attn.defines["QMLA_CBITS"] == 16 and attn.arch == "sm_90a"
    assert smem == v4_smem_bytes(fmt, 2, wgmma=True) == attn.defines["QMLA_V4_SMEM"] and block == (256,)
    assert grid[0] == b * 2 and [rec[0].kernel for rec in launches] == ["qmla_attn_v4", "qmla_combine"]


def test_v4_knobs(monkeypatch):
    assert V4Knobs.from_env() == V4Knobs(2, True)
    monkeypatch.setenv("QUANTMLA_CUPY_V4_STAGES", "3")
    monkeypatch.setenv("QUANTMLA_CUPY_V4_LAZY_RESCALE", "0")
    assert V4Knobs.from_env() == V4Knobs(3, False)
    # 3 stages of C4R4 at d_c 512 do not fit a block: the plan says so, naming the knob
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V4_STAGES: 3 stages need"):
        _run_v4_stubbed(monkeypatch, 128, 1, False)
    monkeypatch.setenv("QUANTMLA_CUPY_V4_STAGES", "2")
    launches, _kernels, fmt, _b = _run_v4_stubbed(monkeypatch, 128, 1, False)
    (attn, _grid, _block, _args, smem), _ = launches.of("qmla_attn_v4")
    assert attn.defines["QMLA_V4_STAGES"] == 2 and attn.defines["QMLA_V4_LAZY_RESCALE"] == 0
    assert smem == v4_smem_bytes(fmt, 2, wgmma=True)
    monkeypatch.setenv("QUANTMLA_CUPY_V4_STAGES", "4")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V4_STAGES"):
        V4Knobs.from_env()


@pytest.mark.parametrize("mma,capability,nvrtc,wgmma", [
    ("auto", (9, 0), (13, 0), True), ("auto", (9, 0), (12, 0), True), ("auto", (9, 0), (11, 8), False),
    ("auto", (8, 0), (13, 0), False), ("auto", (10, 0), (13, 0), False), ("mma", (9, 0), (13, 0), False),
    ("wgmma", (9, 0), (12, 4), True), ("auto", None, (13, 0), False)])
def test_v4_mma_choice(mma, capability, nvrtc, wgmma):
    """QUANTMLA_CUPY_V4_MMA: auto runs wgmma on compute capability 9.0 only (an sm_90a instruction)
    and with an NVRTC that builds sm_90a (12.0+); forcing it elsewhere is an error that names the variable."""
    assert v4_uses_wgmma(mma, capability, nvrtc) is wgmma


def test_v4_mma_knob(monkeypatch):
    monkeypatch.setenv("QUANTMLA_CUPY_V4_MMA", "mma")
    assert V4Knobs.from_env().mma == "mma"
    launches, _kernels, fmt, _b = _run_v4_stubbed(monkeypatch, 128, 1, False)
    (attn, _grid, _block, _args, smem), _ = launches.of("qmla_attn_v4")
    assert attn.defines["QMLA_V4_WGMMA"] == 0 and attn.arch is None and smem == v4_smem_bytes(fmt)
    monkeypatch.setenv("QUANTMLA_CUPY_V4_MMA", "tensor")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V4_MMA"):
        V4Knobs.from_env()
    for capability, nvrtc in (((8, 0), (13, 0)), (None, (13, 0)), ((9, 0), (11, 8))):
        with pytest.raises(ValueError, match=r"QUANTMLA_CUPY_V4_MMA: wgmma needs compute capability 9.0 \(sm_90a\) "
                                             r"and NVRTC 12.0\+, got .* and NVRTC"):
            v4_uses_wgmma("wgmma", capability, nvrtc)
    # an NVRTC older than 12.0: auto builds mma.sync
    monkeypatch.setenv("QUANTMLA_CUPY_V4_MMA", "auto")
    launches, _kernels, fmt, _b = _run_v2_stubbed(monkeypatch, 128, 1, False, {}, variant="v4", pages_per=9,
                                                  length=500, nvrtc=(11, 8))
    (attn, _grid, _block, _args, _smem), _ = launches.of("qmla_attn_v4")
    assert attn.defines["QMLA_V4_WGMMA"] == 0 and attn.arch is None


#: many-row cases: rows filling one or two chunks exactly or partly, S_q > 1 (causal), lengths at
#: tile and page edges, d_c 256 with groups of 128, no protection, sink only, a sink of two tiles
V4_CASES = [
    Case(qm.PackFormat.parse("C4R4"), (64, 65, 4097), heads=128, s_q=1, sink=4, local=128, seed=970),
    Case(qm.PackFormat.parse("C2R4", page_size=32), (1000, 129), heads=64, s_q=1, sink=4, local=128, seed=971),
    Case(qm.PackFormat.parse("C4R4", 256, 32, group_size=128), (700, 63), heads=96, s_q=1, sink=0, local=0, seed=972),
    Case(qm.PackFormat.parse("C2R4", page_size=16), (300, 17), heads=32, s_q=3, sink=4, local=16, seed=973),
    Case(qm.PackFormat.parse("C4R4", group_size=128), (2100,), heads=128, s_q=2, sink=36, local=0, seed=974),
    # two sink tiles, requests shorter than the sink and windows that start inside it
    Case(qm.PackFormat.parse("C2R4"), (300, 70, 5), heads=64, s_q=1, sink=100, local=40, seed=975),
    # bf16 pages: page and tile edges, 16-token pages with S_q > 1, d_c 256 with a local window
    Case(qm.PackFormat.parse("BF16"), (64, 65, 4097), heads=128, s_q=1, sink=4, local=128, seed=976),
    Case(qm.PackFormat.parse("BF16", page_size=16), (300, 17, 1000), heads=64, s_q=2, sink=0, local=0, seed=977),
    Case(qm.PackFormat.parse("BF16", 256, 32, page_size=32), (700, 63), heads=96, s_q=1, sink=4, local=16, seed=978),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V2_CASES + BIG[:3] + V4_CASES, ids=str)
def test_attention_v4_matches_reference(case, monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "v4")
    assert select_variant(case.fmt, "bfloat16", torch.cuda.get_device_capability()) == ("v4", None)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] + V4_CASES if c.sink or c.local], ids=str)
def test_attention_v4_protected_in_grid(case, monkeypatch):
    """The build whose own CTAs attend to the protected tiles (chosen for long splits) passes the
    same cases; here it is forced for every split length."""
    from quantmla_core.backends.cupy import plans

    monkeypatch.setenv(VARIANT_ENV, "v4")
    monkeypatch.setattr(plans, "V4_INGRID_MIN_TILES", 1)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V4_CASES[:3] + BIG[1:2], ids=str)
def test_attention_v4_auto_and_knobs(case, monkeypatch):
    """auto runs v4 for these many-row requests where v6 cannot (v6 on compute capability 9.0 over packed
    pages, test_cupy_v6); forced v4 passes with the eager rescale (and 3 stages where they fit) too (the
    lazy rescale skips only multiplications by exactly 1)."""
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    cap = torch.cuda.get_device_capability()
    auto = "v6" if tuple(cap) == (9, 0) and case.fmt.quantized else "v4"
    assert select_variant(case.fmt, "bfloat16", cap, None, case.s_q * case.heads)[0] == auto
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
    monkeypatch.setenv(VARIANT_ENV, "v4")
    if v4_smem_bytes(case.fmt, 3) <= smem_per_block(cap):
        monkeypatch.setenv("QUANTMLA_CUPY_V4_STAGES", "3")
    monkeypatch.setenv("QUANTMLA_CUPY_V4_LAZY_RESCALE", "0")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
