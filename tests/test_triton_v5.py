"""Triton kernel v5 (Gluon, ``attention_v5_kernel.py``: few query rows, tokens as the wgmma M): the launcher's rules
on the CPU, conformance on an sm_90 GPU.

Gluon has no interpreter, so without a Hopper GPU only the host side runs here: where v5 is refused and why, how a
v5 call is planned (row blocks of 16 or 32 rows, kernel v3's split rule, v4's partials and merge) and its knobs. The
kernel compiles offline in ``test_triton_v4_offline.py``; on an H100/H200 the cases below run it against the float64
reference and against kernel v4 on the same cache.
"""

from __future__ import annotations

import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat
from quantmla_core.testing import Case, check_attention, edge_lengths, stub_triton_launcher, write_case

from conformance import check_poisoned_partials, reference_outputs

pytest.importorskip("triton")
from quantmla_core.backends.triton import attention as A  # noqa: E402
from quantmla_core.backends.triton.heuristics import (V5_AHEAD, V5_AHEAD_2A, V5_ATTENDERS,  # noqa: E402
                                                      V5_LOADER_WARPS, V5_LOADER_WARPS_2A, plan_v3, v5_block_r)

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
NEEDS_HOPPER = pytest.mark.skipif(not ON_HOPPER or A.GLUON_IMPORT_ERROR is not None,
                                  reason="kernel v5 runs on an sm_90 GPU with triton's Gluon (no interpreter)")


def _prepare(fmt: str = "C4R4", q_dtype=torch.bfloat16, batch: int = 2, heads: int = 16, tokens: int = 4096,
             variant: str = "v5", s_q: int = 1, latent_dim: int = 512, rope_dim: int = 64, page_size: int = 64,
             **kw):
    f = PackFormat.parse(fmt, latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size)
    pages = tokens // f.page_size
    cache = qm.MLACache.allocate(f, batch * pages, batch, 4, 128, device="cpu")
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return A.prepare(cache, table, lens, torch.arange(batch, dtype=torch.int32), batch, s_q, heads, q_dtype, 0.05,
                     variant=variant, **kw)


def _as_hopper(monkeypatch, major: int | None = 9) -> None:
    """The launcher's device checks answer as on a GPU of compute capability ``major`` (None: ROCm), kernels stubbed."""
    stub_triton_launcher(monkeypatch, sm_count=132)
    monkeypatch.setattr(A, "_not_nvidia", lambda device, needs, on_rocm: on_rocm if major is None else None)
    monkeypatch.setattr(A, "_nvidia_major", lambda index: major)
    monkeypatch.setattr(A, "GLUON_IMPORT_ERROR", None)


def _set_env(monkeypatch, name: str, value: str | None) -> None:
    """``name`` set to ``value``, or unset for None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def test_v5_is_refused_off_a_gpu_with_the_reason():
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_ATTENTION=v5: kernel v5 .*(NVIDIA GPUs|Gluon)"):
        _prepare()


@pytest.mark.parametrize("kwargs,why", [
    ({"q_dtype": torch.float32}, "kernel v5 takes bfloat16 queries, got torch.float32"),
    ({"fmt": "C4R8"}, "kernel v5 reads pages of BF16/C4R4/C2R4, got C4R8"),
    ({"latent_dim": 256, "rope_dim": 32}, r"kernel v5 is built for \(d_c, d_r\) = \(512, 64\), got \(256, 32\)"),
    ({"page_size": 32}, "kernel v5 reads 64-token pages, got page_size=32"),
], ids=str)
def test_v5_names_what_it_cannot_serve(monkeypatch, kwargs, why):
    _as_hopper(monkeypatch)
    with pytest.raises(ValueError, match=why):
        _prepare(**kwargs)


@pytest.mark.parametrize("major,why", [(8, r"kernel v5 needs compute capability 9.x \(Hopper\), cpu is 8.x"),
                                       (None, r"kernel v5 \(Gluon\) is built for NVIDIA Hopper, not ROCm")])
def test_v5_needs_hopper(monkeypatch, major, why):
    _as_hopper(monkeypatch, major)
    with pytest.raises(ValueError, match=why):
        _prepare()


@pytest.mark.parametrize("max_rows,fmt,heads,s_q,want", [
    (16, "C4R4", 16, 1, "v5"), (16, "C4R4", 1, 1, "v5"), (16, "C2R4", 8, 2, "v5"), (15, "C4R4", 16, 1, "v4"),
    (16, "C2R4", 16, 2, "v4"), (32, "C2R4", 16, 2, "v5"), (16, "C2R4", 40, 1, "v4"), (16, "BF16", 16, 1, "v1"),
    (16, "C4R8", 16, 1, "v2"), (63, "C4R4", 64, 1, "v4"), (64, "C4R4", 128, 1, "v4")])
def test_auto_runs_v5_up_to_v5_max_rows(monkeypatch, max_rows, fmt, heads, s_q, want):
    """With ``heuristics.V5_AUTO`` on, auto runs v5 in kernel v2's place over packed pages v5 reads up to
    ``heuristics.V5_MAX_ROWS`` query rows (S_q x H), and v4 above them (from ``V4_MIN_ROWS``); BF16 pages keep v1,
    formats neither reads keep v2, and from 64 rows v4 runs in v3's place (kernel v6's rule off: see
    ``test_triton_v6``)."""
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V5_AUTO", True)
    monkeypatch.setattr(A, "V6_AUTO", False)
    monkeypatch.setattr(A, "V5_MAX_ROWS", max_rows)
    monkeypatch.setattr(A, "V4_MIN_ROWS", 1)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    assert _prepare(fmt, heads=heads, s_q=s_q, variant="auto").variant == want


@pytest.mark.parametrize("tokens,one_block", [(32768, "v6"), (4096, "v5")])
def test_defaults_run_v6_or_v5_to_16_rows_v5_to_32_and_v4_above(monkeypatch, tokens, one_block):
    """The shipped rule (stops 65 and 67, H100 timings): one request's 16 rows v6 over long block tables (v5 over short
    ones), 32 rows v5 (H16 S_q 2, one program of 32 rows), 48 v4."""
    _as_hopper(monkeypatch)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    monkeypatch.delenv(A.V5_BLOCK_R_ENV, raising=False)
    for s_q, variant, block_r in ((1, one_block, 16), (2, "v5", 32), (3, "v4", None)):
        call = _prepare("C2R4", heads=16, s_q=s_q, variant="auto", tokens=tokens)
        assert call.variant == variant and (block_r is None or call.plan.block_r == block_r), (s_q, call.plan)


def test_auto_keeps_v2_without_v5_auto(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V5_AUTO", False)
    monkeypatch.setattr(A, "V6_AUTO", False)
    monkeypatch.setattr(A, "V4_MIN_ROWS", 64)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    assert _prepare("C4R4", heads=16, variant="auto").variant == "v2"


@pytest.mark.parametrize("block_r", [None, "16", "32"])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (16, 2), (40, 1), (1, 3)])
@pytest.mark.parametrize("batch,tokens", [(32, 32768), (8, 4096)])
def test_v5_plan(monkeypatch, block_r, heads, s_q, batch, tokens):
    """Row blocks of ``QUANTMLA_TRITON_V5_BLOCK_R`` rows (default :func:`heuristics.v5_block_r`), the splits kernel
    v3 takes for as many programs (one an SM), v4's partials and merge."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V5_BLOCK_R_ENV, block_r)
    call = _prepare("C4R4", batch=batch, heads=heads, s_q=s_q, tokens=tokens)
    rows, br = heads * s_q, int(block_r or v5_block_r(heads * s_q))
    pl = call.plan
    assert call.variant == "v5" and pl.block_r == br and pl.row_blocks == -(-rows // br) and pl.block_n == 128
    assert call.split_grid == (pl.num_splits, batch, pl.row_blocks)
    v3 = plan_v3(batch, 64 * pl.row_blocks, 512, 64, tokens, 132)  # as many programs before the split
    assert pl.num_splits == v3.num_splits and v3.row_blocks == pl.row_blocks
    assert call.partial_specs[:2] == (((batch, pl.num_splits, rows, 512), torch.float32),
                                      ((batch, pl.num_splits, rows), torch.float32))
    assert call.split_consts["BLOCK_R"] == br and call.split_consts["LOADER_WARPS"] == V5_LOADER_WARPS
    assert call.split_dims["num_warps"] == 4


@pytest.mark.parametrize("attenders", ["1", "2"])
@pytest.mark.parametrize("value", [None, "1", "2"])
def test_v5_ahead_is_a_knob(monkeypatch, value, attenders):
    """Pages ahead: the knob's, else :data:`heuristics.V5_AHEAD` beside one attender and ``V5_AHEAD_2A`` beside two."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V5_AHEAD_ENV, value)
    monkeypatch.setenv(A.V5_ATTENDERS_ENV, attenders)
    want = int(value) if value else (V5_AHEAD if attenders == "1" else V5_AHEAD_2A)
    assert _prepare().split_consts["AHEAD"] == want


@pytest.mark.parametrize("attenders,block_r,warps,want", [
    (None, None, None, (V5_ATTENDERS, V5_LOADER_WARPS if V5_ATTENDERS == 1 else V5_LOADER_WARPS_2A)),
    ("1", None, None, (1, V5_LOADER_WARPS)), ("2", None, None, (2, V5_LOADER_WARPS_2A)), ("2", "16", "8", (2, 8)),
    ("1", "32", "4", (1, 4)), (None, "32", None, (1, V5_LOADER_WARPS))])
def test_v5_attenders_and_converter_warps_are_knobs(monkeypatch, attenders, block_r, warps, want):
    """Two attending warpgroups at 16 rows a program (one at 32 by default), the converter's warps by their count."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V5_ATTENDERS_ENV, attenders)
    _set_env(monkeypatch, A.V5_BLOCK_R_ENV, block_r)
    _set_env(monkeypatch, A.V5_LOADER_WARPS_ENV, warps)
    consts = _prepare().split_consts
    assert (consts["ATTENDERS"], consts["LOADER_WARPS"]) == want


def test_two_attenders_refuse_32_rows(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V5_ATTENDERS_ENV, "2")
    monkeypatch.setenv(A.V5_BLOCK_R_ENV, "32")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_V5_ATTENDERS=2: kernel v5's two attenders take 16 query rows "
                                         r"a program, the call has 32 \(QUANTMLA_TRITON_V5_BLOCK_R, or unset: 32 above"):
        _prepare()
    monkeypatch.delenv(A.V5_BLOCK_R_ENV)
    with pytest.raises(ValueError, match="two attenders take 16 query rows a program, the call has 32"):
        _prepare(s_q=2)


@pytest.mark.parametrize("value", ["1", "2"])
def test_v5_probe_builds_warn_that_their_outputs_are_wrong(monkeypatch, value):
    """Every run of a v5 measurement build warns (kernels stubbed); unset or 0, no probe constexpr."""
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V5_PROBE_ENV, value)
    call = _prepare(batch=2)
    assert call.split_consts["PROBE"] == int(value)
    cache = qm.MLACache.allocate(PackFormat.parse("C4R4"), 2 * 64, 2, 4, 128, device="cpu")
    q, r = torch.randn((2, 1, 16, 512)).bfloat16(), torch.randn((2, 1, 16, 64)).bfloat16()
    with pytest.warns(RuntimeWarning, match=f"QUANTMLA_TRITON_V5_PROBE={value}: a measurement build of kernel v5"):
        call.run(q, r, cache)
    monkeypatch.setenv(A.V5_PROBE_ENV, "0")
    assert "PROBE" not in _prepare().split_consts


@pytest.mark.parametrize("name,value", [("V5_AHEAD_ENV", "3"), ("V5_BLOCK_R_ENV", "64"), ("V5_BLOCK_R_ENV", "x"),
                                        ("V5_ATTENDERS_ENV", "3"), ("V5_LOADER_WARPS_ENV", "6"),
                                        ("V5_PROBE_ENV", "3")])
def test_malformed_v5_knobs_are_refused(monkeypatch, name, value):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(getattr(A, name), value)
    with pytest.raises(ValueError, match=getattr(A, name)):
        _prepare()


@pytest.mark.parametrize("inline,order", [("0", "0"), ("1", "1")])
def test_v5_takes_v4s_protection_and_channel_order_knobs(monkeypatch, inline, order):
    """The protected tokens inline (no protected-tile kernel) and the channel order follow v4's knobs."""
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, inline)
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, order)
    call = _prepare()
    assert bool(call.split_consts.get("INLINE_PROT")) == (inline == "1")
    assert bool(call.split_consts.get("CHANNEL_ORDER")) == (order == "1") == call.merge_consts["CHANNEL_ORDER"]
    assert (call.protect_grid is None) == (inline == "1")


def test_v5_takes_no_probe_switch(monkeypatch):
    _as_hopper(monkeypatch)
    with pytest.raises(ValueError, match="'skip_pv' is a switch of kernels v1-v3, the call runs v5"):
        _prepare(overrides={"skip_pv": True})


# ---------------------------------------------------------------- on an sm_90 GPU


def _gpu_cases() -> list[tuple[Case, int | None]]:
    """(case, forced splits): every format v5 reads at H 16 (S_q 1 and 2) over the edge lengths (one token, P-1/P/P+1,
    inside the sink and the window, beyond both), H 40 (a row block part-filled) over 3 splits, one head with S_q 3
    over 8 splits of two tiles (splits without packed pages), no sink or window, a long request beside short ones."""
    out, seed = [], 6000
    for name in ("BF16", "C4R4", "C2R4"):
        fmt = PackFormat.parse(name)
        for lens in edge_lengths(fmt, 4, 128):
            for s_q in (1, 2):
                seed += 1
                lens_q = tuple(max(n, s_q) for n in lens)  # every query sees a token (else the reference is NaN)
                out.append((Case(fmt, lens_q, heads=16, s_q=s_q, sink=4, local=128, seed=seed), None))
        out.append((Case(fmt, (777, 2000), heads=40, sink=4, local=128, seed=seed + 1), 3))
        out.append((Case(fmt, (300, 5), heads=1, s_q=3, sink=4, local=128, seed=seed + 2), 8))
        out.append((Case(fmt, (1000, 130, 4099), heads=16, sink=0, local=0, seed=seed + 3), 5))
        out.append((Case(fmt, (20000, 5, 9000), heads=16, sink=4, local=128, seed=seed + 4), None))
        seed += 10
    return out


#: kernel v5's builds on the GPU: "a1" / "a2" (``QUANTMLA_TRITON_V5_AHEAD``), "r32" for 32 rows a program
#: (``QUANTMLA_TRITON_V5_BLOCK_R``; else 16), "p" for the protected tokens in the split kernel, "c" for packed pages in
#: channel_of order (v4's knobs; the others plain), "t2" for two attenders (else one), "w8" for 8 converter warps
#: (else the default for the attenders)
GPU_BUILDS = ["a1", "a1p", "a1pc", "a2pc", "a1r32pc", "a2r32", "a1t2", "a1pct2", "a1pct2w8"]


def _set_build(monkeypatch, build: str) -> None:
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, "1" if "c" in build else "0")
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, "1" if "p" in build else "0")
    monkeypatch.setenv(A.V5_AHEAD_ENV, build[1])
    monkeypatch.setenv(A.V5_BLOCK_R_ENV, "32" if "r32" in build else "16")
    monkeypatch.setenv(A.V5_ATTENDERS_ENV, "2" if "t2" in build else "1")
    _set_env(monkeypatch, A.V5_LOADER_WARPS_ENV, "8" if "w8" in build else None)


def _attend(cache, args, batch, variant: str, num_splits: int | None):
    return A.attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                       args["attn_seq_ids"], batch.softmax_scale, num_splits=num_splits, variant=variant)


@NEEDS_HOPPER
@pytest.mark.parametrize("build", GPU_BUILDS)
@pytest.mark.parametrize("case,splits", _gpu_cases(), ids=lambda x: str(x))
def test_v5_matches_reference_and_v4(case, splits, build, monkeypatch):
    """Against the float64 reference (bfloat16 tolerance) and against kernel v4 on the same cache and queries (both
    round the dequantized keys to bfloat16 once; they differ in summation order and in P's bfloat16 rounding)."""
    _set_build(monkeypatch, build)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    out_v4, lse_v4 = _attend(cache, args, batch, "v4", splits)
    out, lse = _attend(cache, args, batch, "v5", splits)
    assert A.LAST_LAUNCH["variant"] == "v5"
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, "bfloat16")
    torch.testing.assert_close(out.float(), out_v4.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_v4, rtol=1e-3, atol=1e-3)


@NEEDS_HOPPER
@pytest.mark.parametrize("build", GPU_BUILDS)
def test_v5_overwrites_poisoned_partials(monkeypatch, build):
    """Every partial a v5 split owns is written, empty splits included: with the partials' memory and the outputs
    NaN-filled, the outputs come back finite (and still match the reference)."""
    _set_build(monkeypatch, build)
    case = Case(PackFormat.parse("C4R4"), (3000, 64, 129), heads=16, s_q=2, seed=6999)
    check_poisoned_partials(monkeypatch, A, case, 6, "v5")
