"""CuPy attention kernel v3 (tokens as the QK MMA M dimension, ``kernels/attention_v3.cu``).

CPU: the kernel compiles for sm_90 and sm_80 without spills at every served format, dims,
group and page size; its launcher picks it only when asked and says why it cannot serve; the
stubbed launch matches the kernel's signature and adds v2's protected-only launch for caches
with sink/local tokens. GPU: conformance against the reference on the v2 cases."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from conformance import check_attention_case
from quantmla_core.backends.cupy.builds import protected_smem_bytes, v3_defines, v3_smem_bytes
from quantmla_core.backends.cupy.variants import VARIANT_ENV, select_variant
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
from quantmla_core.testing import write_case

#: (arch, format, d_c, d_r, group size, page size[, stages[, warps]])
V3_BUILDS = [
    ("sm_90", "C4R4", 512, 64, 64, 64),
    ("sm_90", "C2R4", 512, 64, 64, 64),
    ("sm_90", "C4R4", 512, 64, 128, 16),
    ("sm_90", "C2R4", 512, 64, 128, 128),
    ("sm_90", "C4R4", 256, 32, 64, 32),
    ("sm_90", "C2R4", 256, 32, 128, 64),
    ("sm_90", "C4R4", 512, 64, 64, 64, 4),
    ("sm_80", "C4R4", 512, 64, 64, 64),
    ("sm_80", "C2R4", 256, 32, 64, 16),
    ("sm_90", "C4R4", 512, 64, 64, 64, 3, 8),
    ("sm_90", "C2R4", 512, 64, 128, 32, 3, 8),
    ("sm_90", "C4R4", 256, 32, 64, 64, 3, 8),
    ("sm_80", "C4R4", 512, 64, 128, 64, 3, 8),
]


def _compile_v3(v: tuple) -> tuple[int, str, str]:
    arch, name, dc, dr, gs, page = v[:6]
    stages = v[6] if len(v) > 6 else 3
    warps = v[7] if len(v) > 7 else 4
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
    return compile_cubin_and_ptx("attention_v3.cu", arch, v3_defines(fmt, stages, warps=warps))


@lru_cache(maxsize=1)
def _compiled_v3() -> dict:
    return compile_all(V3_BUILDS, _compile_v3)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("build", V3_BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_v3_compiles_without_spills(build):
    rc, text, ptx = _compiled_v3()[build]
    assert rc == 0, f"nvcc failed for v3 {build}:\n{text[-4000:]}"
    use = ptxas_usage(text)
    print(f"v3 {build}: {use}")
    if len(build) > 7 and build[7] == 8:  # 8 warps: at most 128 registers (two CTAs per SM), a few spilled bytes
        assert use["registers"] <= 128 and use["spill_stores"] <= 64, f"v3 {build}: {use}"
    else:
        assert use["spill_stores"] == 0 and use["spill_loads"] == 0 and use["stack"] == 0, f"v3 {build} spills: {use}"
    # P * s is stored transposed by stmatrix on sm_90 and by movmatrix + 32-bit stores before
    assert ("stmatrix.sync.aligned.m8n8.x4.trans" in ptx) == (build[0] == "sm_90")
    assert ("movmatrix.sync.aligned.m8n8.trans" in ptx) == (build[0] != "sm_90")
    assert ptx.count("mma.sync.aligned.m16n8k16") >= 3 and "ldmatrix.sync.aligned.m8n8.x4" in ptx


def test_v3_smem_fits_two_ctas_per_sm():
    # 3 stages of 64 x 317 B (float32 RoPE scale), the permuted query (36 k-steps x 512 B), 8 + 2 query sums
    # x 16 rows, P * s for 8 groups (8 x 2 KB) and 4 x 16 row maxima; 8 warps add both pair halves' partial
    # scores, 4 token groups x 2 x 32 lanes x 32 B
    fmt = qm.PackFormat.parse("C4R4")
    assert v3_smem_bytes(fmt) == 3 * 64 * 317 + 36 * 512 + 10 * 64 + 8 * 2048 + 256
    assert v3_smem_bytes(fmt, warps=8) == v3_smem_bytes(fmt) + 8192
    assert 2 * (v3_smem_bytes(fmt, warps=8) + 1024) <= 228 * 1024
    assert v3_smem_bytes(fmt, 4) > v3_smem_bytes(fmt)


def test_v3_selection(monkeypatch):
    from quantmla_core.backends.cupy.variants import V3_MIN_TOKENS

    c4 = qm.PackFormat.parse("C4R4")
    monkeypatch.delenv(VARIANT_ENV, raising=False)
    # auto (off compute capability 9.0, where v5 takes the long contexts): v3 from V3_MIN_TOKENS of
    # block-table capacity, v2 below (its fixed cost is lower), with the reason
    assert select_variant(c4, "bfloat16", (8, 0), V3_MIN_TOKENS) == ("v3", None)
    v, why = select_variant(c4, "bfloat16", (8, 0), V3_MIN_TOKENS - 64)
    assert v == "v2" and str(V3_MIN_TOKENS) in why
    assert select_variant(c4, "bfloat16")[0] == "v2"  # capacity unknown: the short-context choice
    assert select_variant(c4, "float32", (8, 0), 1 << 20)[0] == "v1"
    v, why = select_variant(qm.PackFormat.parse("C2R4", 256, 32, group_size=32), "bfloat16", (8, 0), 1 << 20)
    assert v == "v2" and "multiple of 64" in why
    monkeypatch.setenv(VARIANT_ENV, "v2")
    assert select_variant(c4, "bfloat16", (9, 0), 1 << 20) == ("v2", None)
    monkeypatch.setenv(VARIANT_ENV, "v3")
    assert select_variant(c4, "bfloat16") == ("v3", None)
    assert select_variant(qm.PackFormat.parse("C2R4", 256, 32, group_size=128), "bfloat16") == ("v3", None)
    # group 32 at d_c 256 C2R4 is served by v2 but not by v3 (64-channel QK sub-groups): v2, with the reason
    v, why = select_variant(qm.PackFormat.parse("C2R4", 256, 32, group_size=32), "bfloat16")
    assert v == "v2" and "multiple of 64" in why
    # what v2 cannot serve falls back to v1, with v2's reason
    v, why = select_variant(qm.PackFormat.parse("C8R8"), "bfloat16")
    assert v == "v1" and "C8R8" in why
    assert select_variant(c4, "float32")[0] == "v1"


def _run_v3_stubbed(monkeypatch, h: int, s_q: int, prot: bool):
    """A v3 call with the CUDA calls stubbed: 3 requests of 500 tokens over 9 pages each."""
    return _run_v2_stubbed(monkeypatch, h, s_q, prot, {}, variant="v3", pages_per=9, length=500)


@pytest.mark.parametrize("h,s_q,prot", [(16, 1, True), (128, 1, True), (20, 3, False)])
def test_v3_launches_match_kernel_signatures(monkeypatch, h, s_q, prot):
    launches, _kernels, fmt, b = _run_v3_stubbed(monkeypatch, h, s_q, prot)
    params = _kernel_params("attention_v3.cu", "qmla_attn_v3")
    assert params == _kernel_params("attention_v2.cu", "qmla_attn_v2")  # one argument list for both
    (attn, grid, block, args, smem), stream = launches.of("qmla_attn_v3")
    assert attn.source == "attention_v3.cu" and stream is None  # on the caller's stream
    assert len(args) == len(params)
    for a, p in zip(args, params):
        assert isinstance(a, np.uint64 if "*" in p else np.int32 if p.startswith("int ") else np.float32), p
    rows = s_q * h
    assert grid[0] == b * (-(-rows // 16)) and block == (128,)
    assert smem == v3_smem_bytes(fmt) == attn.defines["QMLA_V3_SMEM"]
    splits, per = grid[1], int(args[params.index("int tiles_per_split")])
    assert splits * per * 64 >= 9 * fmt.page_size and (splits - 1) * per * 64 < 9 * fmt.page_size
    slots = int(args[params.index("int num_splits")])
    if prot:  # the protected-only kernel adds the sink and the 128-token local window (5 tiles) as the last partials
        (prot_k, pgrid, pblock, pargs, psmem), pstream = launches.of("qmla_attn_protected")
        assert prot_k.source == "protected.cu" and pstream is None  # eager, short table: one stream
        assert launches[1][0] is prot_k  # one stream: after the split kernel (forked onto the side stream it goes first: test_v5_auto_on_long_tables)
        assert _kernel_params("protected.cu", "qmla_attn_protected") == params
        assert psmem == protected_smem_bytes(fmt) == prot_k.defines["QMLA_PROT_SMEM_EXPECTED"]
        assert pgrid == (grid[0], 6) and pblock == (128,) and pargs == args and slots == splits + 6
    else:
        assert len(launches) == 2 and slots == splits
    combine = launches[-1]
    assert combine[0].kernel == "qmla_combine" and int(combine[3][-1]) == slots


def test_v3_knobs(monkeypatch):
    from quantmla_core.backends.cupy.knobs import V3Knobs

    knobs = V3Knobs.from_env()
    assert (knobs.stages, knobs.minb, knobs.lazy, knobs.warps) == (3, None, True, 4)
    assert v3_defines(qm.PackFormat.parse("C4R4"))["QMLA_V3_MINB"] == 1
    assert v3_defines(qm.PackFormat.parse("C4R4"), warps=8)["QMLA_V3_MINB"] == 2  # <= 128 registers
    monkeypatch.setenv("QUANTMLA_CUPY_V3_WARPS", "8")
    monkeypatch.setenv("QUANTMLA_CUPY_V3_LAZY_RESCALE", "0")
    knobs = V3Knobs.from_env()
    assert knobs.warps == 8 and not knobs.lazy
    monkeypatch.setenv("QUANTMLA_CUPY_V3_STAGES", "4")
    assert V3Knobs.from_env().stages == 4
    monkeypatch.setenv("QUANTMLA_CUPY_V3_STAGES", "2")
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V3_STAGES"):
        V3Knobs.from_env()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V2_CASES + BIG[:3], ids=str)
def test_attention_v3_matches_reference(case, monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "v3")
    assert select_variant(case.fmt, "bfloat16", torch.cuda.get_device_capability()) == ("v3", None)
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


def test_v3_eight_warps_launch(monkeypatch):
    monkeypatch.setenv("QUANTMLA_CUPY_V3_WARPS", "8")
    launches, _kernels, fmt, _b = _run_v3_stubbed(monkeypatch, 16, 1, True)
    (attn, _grid, block, _args, smem), _ = launches.of("qmla_attn_v3")
    assert block == (256,) and attn.defines["QMLA_V3_NW"] == 8 and smem == v3_smem_bytes(fmt, warps=8)
    assert launches.of("qmla_attn_protected")[0][2] == (128,)  # the protected-only launch keeps its 4 warps


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", [c for c in V2_CASES + BIG[:3] if c.fmt.content_code_bytes >= 128], ids=str)
def test_attention_v3_eight_warps(case, monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "v3")
    monkeypatch.setenv("QUANTMLA_CUPY_V3_WARPS", "8")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("variant", ["v3", "v2-separate"])
@pytest.mark.parametrize("case", V2_CASES[5:8] + BIG[:2], ids=str)
def test_protected_launch_on_side_stream(case, variant, monkeypatch):
    """QUANTMLA_CUPY_PROTECTED_STREAM=1 forks the protected-only launch onto a second stream: the
    same partials and combine, so the result is bit-identical to the one-stream call."""
    monkeypatch.setenv(VARIANT_ENV, variant.split("-")[0])
    if variant == "v2-separate":
        monkeypatch.setenv("QUANTMLA_CUPY_V2_PROTECTED", "separate")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
    batch, args, cache = write_case(case, "cuda", "bfloat16", "cupy")

    def attend():
        return qm.attention(args["q_latent"], args["q_rope"], cache, block_table=args["block_table"],
                            seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                            softmax_scale=batch.softmax_scale, backend="cupy")

    same_stream = attend()
    monkeypatch.setenv("QUANTMLA_CUPY_PROTECTED_STREAM", "1")
    side_stream = attend()
    torch.cuda.synchronize()
    assert torch.equal(same_stream[0], side_stream[0]) and torch.equal(same_stream[1], side_stream[1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case", V2_CASES[5:8] + BIG[:1], ids=str)
def test_attention_v3_four_stages(case, monkeypatch):
    monkeypatch.setenv(VARIANT_ENV, "v3")
    monkeypatch.setenv("QUANTMLA_CUPY_V3_STAGES", "4")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
