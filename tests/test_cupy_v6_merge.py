"""CuPy kernel v6 writing the output itself (``QUANTMLA_CUPY_V6_MERGE``): the splits of a row chunk as one cluster
that merges their partials through distributed shared memory, a single split normalizing its own.

CPU: the rule (:func:`~quantmla_core.backends.cupy.plans.v6_merge_reason`), what a stubbed call launches and passes
under each knob value, the refusals, and the merging builds' PTX (nvcc). GPU: merged against the combine, bit for
bit, at 1 to 8 splits, with empty splits and rows past the last 64-row chunk, eagerly and as a CUDA graph; and
against the reference.
"""

from __future__ import annotations

import re

import pytest
import torch
from conformance import Case, check_attention_case
from test_cupy_backend import NVCC, compile_cubin_and_ptx, gpu, ptxas_usage

import quantmla_core as qm
from quantmla_core.backends.cupy import plans as cupy_plans
from quantmla_core.backends.cupy.builds import V4_WGMMA_ARCH, V6_MERGE_MAX_SPLITS, v6_defines
from quantmla_core.backends.cupy.plans import v6_merge_reason
from quantmla_core.backends.cupy.variants import VARIANT_ENV
from quantmla_core.testing import allocate, build, capture_graph, patch_cupy_launcher, stub_cache, stub_cupy_launcher

MERGE_ENV = "QUANTMLA_CUPY_V6_MERGE"
#: the v6 knobs the refusal tests set beside it
KNOB_ENVS = ("QUANTMLA_CUPY_V6_PAIR", "QUANTMLA_CUPY_V6_PROTECTED", "QUANTMLA_CUPY_V6_BALANCE")


# ------------------------------------------------------------------ the rule
def test_merge_reason_rule():
    """One split needs no cluster; 2 to 8 merge where the driver's count of clusters holds the grid in as many waves
    as single CTAs; more than a portable cluster, an unknown count or no fitting cluster are reasons against."""
    assert v6_merge_reason(1, 500, 132, None) is None
    assert v6_merge_reason(8, 16, 132, 16) is None
    assert v6_merge_reason(2, 64, 132, 66) is None
    assert "2 waves" in v6_merge_reason(8, 16, 132, 15)
    # two waves either way: the clusters may take two too
    assert v6_merge_reason(4, 60, 132, 33) is None
    assert "more than a cluster of 8" in v6_merge_reason(V6_MERGE_MAX_SPLITS + 1, 2, 132, 100)
    assert "cannot say" in v6_merge_reason(2, 2, 132, None)
    assert "no cluster of 4" in v6_merge_reason(4, 2, 132, 0)


# ------------------------------------------------------------------ the launcher, stubbed
def _stubbed_v6(monkeypatch, env: dict[str, str], batch: int = 3, heads: int = 128, length: int = 300,
                resident: int | None = None, cluster_ctas: int | None = None, want_lse: bool = True):
    """One forced-v6 C4R4 call on the CPU (compilation and launches stubbed) under ``env``; ``resident``: the CTAs
    the stubbed GPU runs at once (default 264), ``cluster_ctas``: as clusters. Returns (launches, out, lse)."""
    from quantmla_core.backends.cupy import attention as A

    _kernels, launches = stub_cupy_launcher(monkeypatch, cluster_ctas=cluster_ctas)
    if resident is not None:
        patch_cupy_launcher(monkeypatch, resident_ctas=lambda fn, threads, smem, dev, sms: resident)
    monkeypatch.setenv(VARIANT_ENV, "v6")
    for k in (MERGE_ENV, *KNOB_ENVS):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    pages = -(-length // 64)
    q, r = torch.randn((batch, heads, 512)).bfloat16(), torch.randn((batch, heads, 64)).bfloat16()
    out, lse = A.attention(q, r, stub_cache(qm.PackFormat.parse("C4R4"), batch, pages),
                           torch.arange(batch * pages, dtype=torch.int32).view(batch, pages),
                           torch.full((batch,), length), torch.arange(batch), 0.05, want_lse=want_lse)
    return launches, out, lse


@pytest.mark.parametrize("resident", [6, 12, 18, 30, 48])
def test_auto_merges_equal_splits_without_a_combine(monkeypatch, resident):
    """``auto``: a v6 call of at most 8 splits a row chunk is one launch of the build that merges them (its cluster
    the grid's splits) with the output and lse pointers last among its arguments; no combine runs."""
    launches, out, lse = _stubbed_v6(monkeypatch, {MERGE_ENV: "auto"}, length=8192, resident=resident)
    assert [rec[0].kernel for rec in launches] == ["qmla_attn_v6"]
    fn, grid, _block, args, _smem = launches[0]
    assert grid == (6, resident // 6)  # 3 requests x 2 row chunks, the splits the plan gives one wave
    assert fn.defines["QMLA_V6_MERGE"] == grid[1]
    assert [int(a) for a in args[-2:]] == [out.data_ptr(), lse.data_ptr()]


@pytest.mark.parametrize("env", [{MERGE_ENV: "0"}, {}], ids=["0", "unset"])
def test_merge_off_launches_the_combine(monkeypatch, env):
    """``0`` (the default, knobs.V6_MERGE): the build without a merge writes partials and the combine merges them;
    the split kernel still takes the output pointers (every v6 build has them), and the combine gets the same ones."""
    launches, out, lse = _stubbed_v6(monkeypatch, env, length=8192, resident=24)
    assert [rec[0].kernel for rec in launches] == ["qmla_attn_v6", "qmla_combine"]
    assert launches[0][0].defines["QMLA_V6_MERGE"] == 0
    assert [int(a) for a in launches[0][3][-2:]] == [out.data_ptr(), lse.data_ptr()]
    assert [int(a) for a in launches[1][3][2:4]] == [out.data_ptr(), lse.data_ptr()]


def test_merge_without_lse_writes_it_to_the_scratch(monkeypatch):
    """With ``want_lse`` False the merging kernel still gets an lse pointer (to scratch), not the output's."""
    launches, out, lse = _stubbed_v6(monkeypatch, {MERGE_ENV: "auto"}, length=8192, resident=24, want_lse=False)
    assert lse is None
    out_ptr, lse_ptr = (int(a) for a in launches[0][3][-2:])
    assert out_ptr == out.data_ptr() and lse_ptr not in (0, out_ptr)


def test_auto_keeps_the_combine_where_clusters_take_more_waves(monkeypatch):
    """Where the GPU holds fewer clusters than the grid needs in one wave, ``auto`` keeps the combine and ``1``
    refuses the call with the reason; more than 8 splits likewise."""
    launches = _stubbed_v6(monkeypatch, {MERGE_ENV: "auto"}, length=8192, resident=48, cluster_ctas=40)[0]
    assert [rec[0].kernel for rec in launches] == ["qmla_attn_v6", "qmla_combine"]
    with pytest.raises(ValueError, match=r"QUANTMLA_CUPY_V6_MERGE=1: .*6 clusters of 8 CTAs take 2 waves"):
        _stubbed_v6(monkeypatch, {MERGE_ENV: "1"}, length=8192, resident=48, cluster_ctas=40)
    launches = _stubbed_v6(monkeypatch, {MERGE_ENV: "auto"}, length=8192, resident=60)[0]
    assert launches[0][1][1] > V6_MERGE_MAX_SPLITS and launches[-1][0].kernel == "qmla_combine"
    with pytest.raises(ValueError, match="more than a cluster of 8"):
        _stubbed_v6(monkeypatch, {MERGE_ENV: "1"}, length=8192, resident=60)


@pytest.mark.parametrize("env", [{"QUANTMLA_CUPY_V6_PAIR": "1"}, {"QUANTMLA_CUPY_V6_PROTECTED": "separate"},
                                 {"QUANTMLA_CUPY_V6_BALANCE": "1"}], ids=["pair", "separate", "balance"])
def test_merge_forced_with_a_plan_it_cannot_serve_is_refused(monkeypatch, env):
    """``1`` beside a knob that needs the partials (pairs, the protected-only launch, a balanced plan) is an error
    naming both, not a silent choice of one."""
    with pytest.raises(ValueError, match="QUANTMLA_CUPY_V6_MERGE=1 merges equal splits"):
        _stubbed_v6(monkeypatch, {MERGE_ENV: "1", **env})
    launches = _stubbed_v6(monkeypatch, {MERGE_ENV: "auto", **env})[0]  # auto: those plans keep their combine
    assert launches[-1][0].kernel == "qmla_combine"


def test_merge_defines_are_validated():
    fmt = qm.PackFormat.parse("C4R4")
    assert v6_defines(fmt)["QMLA_V6_MERGE"] == 0 and v6_defines(fmt, merge=8)["QMLA_V6_MERGE"] == 8
    with pytest.raises(ValueError, match="0 or 1 to 8 splits a cluster, got 9"):
        v6_defines(fmt, merge=9)
    with pytest.raises(ValueError, match="pair=True"):
        v6_defines(fmt, pair=True, merge=2)
    with pytest.raises(ValueError, match="protected=False"):
        v6_defines(fmt, protected=False, merge=2)


# ------------------------------------------------------------------ the builds (nvcc)
@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("name,dc,dr,merge", [("C4R4", 512, 64, 1), ("C4R4", 512, 64, 8), ("C2R4", 512, 64, 3),
                                              ("C4R4", 256, 32, 5)])
def test_merging_builds_compile(name, dc, dr, merge):
    """A merging build compiles for sm_90a spilling at most a word more than the build with the combine; with more
    than one split it is declared as a cluster of the splits, reads its peers' partials through distributed shared
    memory (two statistics a split and every 16-byte chunk a thread merges, a batch in flight at once) between two
    cluster barriers; it stores
    bf16 outputs (8 bytes a thread and row) and the lse, and none of the partials' 16-byte rows."""
    fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=64 if dc == 512 else 128)
    rc, text, ptx = compile_cubin_and_ptx("attention_v6.cu", V4_WGMMA_ARCH, v6_defines(fmt, merge=merge))
    rc0, text0, ptx0 = compile_cubin_and_ptx("attention_v6.cu", V4_WGMMA_ARCH, v6_defines(fmt))
    assert rc == 0 and rc0 == 0, text[-3000:] + text0[-3000:]
    use, base = ptxas_usage(text), ptxas_usage(text0)
    # C2R4 sits at 255 registers: the epilogue's loads move ptxas's spills by a word either way
    assert use["spill_stores"] <= base["spill_stores"] + 4, (use, base)
    assert use["spill_loads"] <= base["spill_loads"] + 4, (use, base)
    assert "C7514" not in text and "C7515" not in text
    clustered = merge > 1
    assert (f".reqnctapercluster 1, {merge}, 1" in ptx) is clustered
    assert ptx.count("ld.shared::cluster.f32") == 2 * merge * clustered
    # one pass: a row per 256 / rows' threads (rows rounded up to a power of two), each thread every such chunk of it
    rows = -(-64 // merge)
    per_thread = dc // 4 // (256 // (1 << (rows - 1).bit_length()))
    loads = [m.start() for m in re.finditer(r"ld\.shared::cluster\.v4\.f32", ptx)]
    assert len(loads) == merge * per_thread * clustered
    if clustered:  # the first batch's loads (up to 32 chunks) all go out before the first exponential
        batch = merge * (1 << (min(per_thread, max(1, 32 // merge)).bit_length() - 1))
        assert "ex2.approx" not in ptx[loads[0]:loads[batch - 1]]
    assert len(re.findall(r"barrier\.cluster\.arrive", ptx)) == 2 * clustered
    assert "st.global.v4.u32" in ptx0 and "st.global.v4.u32" not in ptx
    assert set(re.findall(r"st\.global[.\w]*", ptx)) == {"st.global.v2.u32", "st.global.f32"}


# ------------------------------------------------------------------ GPU
def _v6_gpu_only() -> None:
    cap = torch.cuda.get_device_capability()
    if tuple(cap) != (9, 0):
        pytest.skip(f"v6 is an sm_90a kernel: this GPU is compute capability {cap[0]}.{cap[1]}")


#: (case, resident CTAs the planner is told of): splits 1 to 8 a row chunk; a short request beside a long one leaves
#: its later splits empty; H 72 x S_q 2 fills 3 chunks of 64 rows, the last one partly
MERGE_CASES = [
    (Case(qm.PackFormat.parse("C4R4"), (8192, 300), heads=128, s_q=1, sink=4, local=128, seed=971), res)
    for res in (4, 8, 12, 20, 28, 32)
] + [
    (Case(qm.PackFormat.parse("C2R4"), (4000, 70, 2500), heads=72, s_q=2, sink=4, local=16, seed=972), 27),
    (Case(qm.PackFormat.parse("C4R4", 256, 32, group_size=128), (3000, 5), heads=128, s_q=1, sink=80, local=100,
          seed=973), 16),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("case,resident", MERGE_CASES, ids=lambda v: str(v) if isinstance(v, Case) else f"res{v}")
def test_merged_equals_the_combine_bit_for_bit(monkeypatch, case, resident):
    """The merging clusters write what the partials and the combine write, bit for bit (the same sums in the same
    order), eagerly and replayed as a CUDA graph after the queries change; and the reference's attention."""
    from quantmla_core.backends.cupy import attention as A

    _v6_gpu_only()
    monkeypatch.setattr(cupy_plans, "resident_ctas", lambda *a, **k: resident)
    monkeypatch.setattr(cupy_plans, "_PLANS", {})
    monkeypatch.setattr(A, "_PREPARED", {}, raising=False)
    monkeypatch.setenv(VARIANT_ENV, "v6")
    batch = build(case)
    args = batch.to("cuda", "bfloat16")
    cache = allocate(case, batch, "cuda")
    qm.write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
             positions=args["positions"], seq_lens=args["seq_lens"], backend="cupy")
    table = args["block_table"].to(torch.int32).contiguous()
    lens, ids = args["attn_seq_lens"].to(torch.int64).contiguous(), args["attn_seq_ids"].to(torch.int64).contiguous()
    kw = dict(block_table=table, seq_lens=lens, seq_ids=ids, softmax_scale=batch.softmax_scale, backend="cupy",
              validate=False)
    q, r = args["q_latent"].clone(), args["q_rope"].clone()
    monkeypatch.setenv(MERGE_ENV, "1")
    call = A.prepare(cache, table, lens, ids, q.shape[0], case.s_q, case.heads, q.dtype, batch.softmax_scale)
    assert call.plan.combine is None and call.plan.launches[0][1][1] == resident // call.plan.launches[0][1][0]
    merged = [t.clone() for t in qm.attention(q, r, cache, **kw)]
    monkeypatch.setenv(MERGE_ENV, "0")
    combined = qm.attention(q, r, cache, **kw)
    torch.cuda.synchronize()
    assert torch.equal(merged[0], combined[0]) and torch.equal(merged[1], combined[1])
    monkeypatch.setenv(MERGE_ENV, "1")
    graph, (out, lse) = capture_graph(lambda: qm.attention(q, r, cache, **kw))
    out.fill_(float("nan"))  # poisoned: the replay must write every element
    lse.fill_(float("nan"))
    q.mul_(-0.5)
    graph.replay()
    monkeypatch.setenv(MERGE_ENV, "0")
    want, want_lse = qm.attention(q, r, cache, **kw)
    torch.cuda.synchronize()
    assert not torch.equal(want, combined[0])
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    monkeypatch.setenv(MERGE_ENV, "1")
    check_attention_case(case, "cupy", "cupy", "cuda", "bfloat16")
