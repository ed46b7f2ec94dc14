"""Triton kernel v4 (Gluon, ``attention_v4_kernel.py``): the launcher's rules on the CPU, conformance on an sm_90 GPU.

Gluon has no interpreter, so without a Hopper GPU only the host side runs here: where v4 is refused and why, and that
a v4 call is planned as kernel v3's (the same grid, partials, protected tiles and merge). The kernel itself compiles
offline in ``test_triton_v4_offline.py``; on an H100/H200 the conformance below runs it against the float64
reference and against kernel v3 on the same cache.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat
from quantmla_core.testing import Case, check_attention, edge_lengths, stub_triton_launcher, write_case

from conformance import check_poisoned_partials, reference_outputs

pytest.importorskip("triton")
from quantmla_core.backends.triton import attention as A  # noqa: E402
from quantmla_core.backends.triton.heuristics import (V4_CHANNEL_ORDER_MIN_PAGES, V4_INLINE_PROTECT,  # noqa: E402
                                                      V4_LOADER_WARPS, v4_channel_order)

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
NEEDS_HOPPER = pytest.mark.skipif(not ON_HOPPER or A.GLUON_IMPORT_ERROR is not None,
                                  reason="kernel v4 runs on an sm_90 GPU with triton's Gluon (no interpreter)")


def _prepare(fmt: str = "C4R4", q_dtype=torch.bfloat16, batch: int = 2, heads: int = 128, tokens: int = 4096,
             variant: str = "v4", latent_dim: int = 512, rope_dim: int = 64, page_size: int = 64,
             protect_dtype=torch.bfloat16, **kw):
    f = PackFormat.parse(fmt, latent_dim=latent_dim, rope_dim=rope_dim, page_size=page_size)
    pages = tokens // f.page_size
    cache = qm.MLACache.allocate(f, batch * pages, batch, 4, 128, device="cpu", protect_dtype=protect_dtype)
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return A.prepare(cache, table, lens, torch.arange(batch, dtype=torch.int32), batch, 1, heads, q_dtype, 0.05,
                     variant=variant, **kw)


def _as_hopper(monkeypatch, major: int | None = 9) -> None:
    """The launcher's device checks answer as on a GPU of compute capability ``major`` (None: ROCm), kernels stubbed."""
    stub_triton_launcher(monkeypatch, sm_count=132)
    monkeypatch.setattr(A, "_not_nvidia", lambda device, needs, on_rocm: on_rocm if major is None else None)
    monkeypatch.setattr(A, "_nvidia_major", lambda index: major)
    monkeypatch.setattr(A, "GLUON_IMPORT_ERROR", None)


def test_v4_is_refused_off_a_gpu_with_the_reason():
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_ATTENTION=v4: kernel v4 .*(NVIDIA GPUs|Gluon)"):
        _prepare()


@pytest.mark.parametrize("on", [False, True])
@pytest.mark.parametrize("fmt,heads,want", [("C4R4", 128, "v4"), ("C2R4", 64, "v4"), ("BF16", 128, "v4"),
                                            ("C4R8", 128, "v3"), ("C4R4", 16, "v2")])
def test_auto_runs_v4_where_it_would_run_v3(monkeypatch, on, fmt, heads, want):
    """``heuristics.V4_AUTO`` on: auto runs v4 in v3's place where v4 serves the call; off: never."""
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V4_AUTO", on)
    monkeypatch.setattr(A, "V4_MIN_ROWS", 64)  # below 64 rows v2 stays (the few-row rule: the test below)
    monkeypatch.setattr(A, "V5_AUTO", False)  # kernel v5's few-row rule: test_triton_v5.py
    monkeypatch.setattr(A, "V6_AUTO", False)  # kernel v6's: test_triton_v6.py
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    assert _prepare(fmt, heads=heads, variant="auto").variant == (want if on or want != "v4" else "v3")


@pytest.mark.parametrize("min_rows,fmt,heads,s_q,want", [
    (16, "C4R4", 16, 1, "v4"), (17, "C4R4", 16, 1, "v2"), (16, "C2R4", 8, 2, "v4"), (32, "C2R4", 8, 2, "v2"),
    (1, "C4R4", 1, 1, "v4"), (1, "BF16", 16, 1, "v1"), (1, "C4R8", 16, 1, "v2")])
def test_auto_runs_v4_below_64_rows_from_v4_min_rows(monkeypatch, min_rows, fmt, heads, s_q, want):
    """Below v3's 64 rows auto runs v4 in v2's place over packed pages from ``heuristics.V4_MIN_ROWS`` query rows
    (S_q x H) where v4 serves the call; BF16 pages keep v1, formats v4 does not read keep v2."""
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V4_AUTO", True)
    monkeypatch.setattr(A, "V4_MIN_ROWS", min_rows)
    monkeypatch.setattr(A, "V5_AUTO", False)
    monkeypatch.setattr(A, "V6_AUTO", False)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    f = PackFormat.parse(fmt)
    cache = qm.MLACache.allocate(f, 4 * 64, 4, 4, 128, device="cpu")
    table = torch.arange(4 * 64, dtype=torch.int32).view(4, 64)
    lens = torch.full((4,), 4096, dtype=torch.int32)
    call = A.prepare(cache, table, lens, torch.arange(4 * s_q, dtype=torch.int32) // s_q, 4, s_q, heads,
                     torch.bfloat16, 0.05, variant="auto")
    assert call.variant == want


def test_auto_keeps_v2_below_64_rows_without_v4_auto(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V4_AUTO", False)
    monkeypatch.setattr(A, "V4_MIN_ROWS", 1)
    monkeypatch.setattr(A, "V5_AUTO", False)
    monkeypatch.setattr(A, "V6_AUTO", False)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    assert _prepare("C4R4", heads=16, variant="auto").variant == "v2"


def test_auto_keeps_v3_off_hopper_and_in_the_interpreter(monkeypatch):
    monkeypatch.setattr(A, "V4_AUTO", True)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    stub_triton_launcher(monkeypatch, sm_count=132)  # a CPU cache: v4 says "runs on NVIDIA GPUs"
    assert _prepare(variant="auto").variant == "v3"


@pytest.mark.parametrize("kwargs,why", [
    ({"q_dtype": torch.float32}, "bfloat16 queries, got torch.float32"),
    ({"fmt": "C4R8"}, "BF16/C4R4/C2R4, got C4R8"),
    ({"fmt": "C8R8"}, "BF16/C4R4/C2R4, got C8R8"),
    ({"latent_dim": 256, "rope_dim": 32}, r"\(512, 64\), got \(256, 32\)"),
    ({"page_size": 32}, "64-token pages, got page_size=32"),
], ids=str)
def test_v4_names_what_it_cannot_serve(monkeypatch, kwargs, why):
    _as_hopper(monkeypatch)
    with pytest.raises(ValueError, match=why):
        _prepare(**kwargs)


@pytest.mark.parametrize("major,why", [(8, r"compute capability 9.x \(Hopper\), cpu is 8.x"),
                                       (10, "cpu is 10.x"), (None, "not ROCm")])
def test_v4_needs_hopper(monkeypatch, major, why):
    _as_hopper(monkeypatch, major)
    with pytest.raises(ValueError, match=why):
        _prepare()


def test_v4_needs_gluon(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "GLUON_IMPORT_ERROR", "no module named 'triton.experimental.gluon'")
    with pytest.raises(ValueError, match="needs triton's Gluon: no module named"):
        _prepare()


@pytest.mark.parametrize("fmt", ["BF16", "C4R4", "C2R4"])
@pytest.mark.parametrize("batch,heads,tokens", [(32, 128, 32768), (8, 128, 4096), (3, 64, 700)])
def test_v4_is_planned_as_v3(monkeypatch, fmt, batch, heads, tokens):
    """With the protected-tile kernel (inline protection off) and the plain channel order v4 writes v3's partials:
    the same grid, splits, protected parts and merge, v3's constexprs, 4 warps."""
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, "0")
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, "0")
    v4 = _prepare(fmt, batch=batch, heads=heads, tokens=tokens)
    v3 = _prepare(fmt, batch=batch, heads=heads, tokens=tokens, variant="v3")
    assert v4.variant == "v4" and v3.variant == "v3"
    for field in ("split_grid", "partial_specs", "protect_grid", "protect_tiles", "merge_grid", "merge_consts"):
        assert getattr(v4, field) == getattr(v3, field), field
    assert {k: v for k, v in v4.split_consts.items() if k not in ("PIPELINE", "LOADER_WARPS")} == dict(v3.split_consts)
    # PDL (stubbed as available): v3 launches its protected tiles after itself (mode 2), v4 signals no dependents
    assert (v4.pdl, v3.pdl) == (1, 2)
    assert {**v4.protect_consts, "PDL": True} == dict(v3.protect_consts)
    assert v4.split_dims["num_warps"] == 4 and v3.split_dims["num_warps"] == 8
    assert v4.plan.block_n == 128 and v4.plan.block_r == 64


def _set_env(monkeypatch, name: str, value: str | None) -> None:
    """``name`` set to ``value``, or unset for None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("fmt", ["BF16", "C4R4", "C2R4"])
@pytest.mark.parametrize("value,want", [(None, None), ("0", 0), ("1", 1), ("2", 2), ("3", 3), ("4", 4)])
def test_pipelined_build_is_a_knob(monkeypatch, fmt, value, want):
    """Unset: the format's measured default (BF16 pages build 2, C4R4 build 1, C2R4 build 4); set: that build (4 is
    refused over BF16 pages)."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V4_PIPELINE_ENV, value)
    if fmt == "BF16" and value == "4":
        with pytest.raises(ValueError, match="QUANTMLA_TRITON_V4_PIPELINE=4: kernel v4's build 4 reads packed pages, "
                                             "the cache holds BF16"):
            _prepare(fmt)
        return
    assert _prepare(fmt).split_consts["PIPELINE"] == (want if value else {"BF16": 2, "C4R4": 1, "C2R4": 4}[fmt])
    assert "PIPELINE" not in _prepare(variant="v3").split_consts


@pytest.mark.parametrize("value", ["1", "2", "3", "4"])
def test_probe_builds_warn_that_their_outputs_are_wrong(monkeypatch, value):
    """Every call of a measurement build warns, each run of one prepared call too (kernels stubbed)."""
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_PROBE_ENV, value)
    call = _prepare()
    assert call.split_consts["PROBE"] == int(value)
    cache = qm.MLACache.allocate(PackFormat.parse("C4R4"), 2 * 64, 2, 4, 128, device="cpu")
    q, r = torch.randn((2, 1, 128, 512)).bfloat16(), torch.randn((2, 1, 128, 64)).bfloat16()
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match=f"QUANTMLA_TRITON_V4_PROBE={value}: .* outputs are wrong"):
            call.run(q, r, cache)


@pytest.mark.parametrize("value", [None, "0"])
def test_no_probe_build_by_default(monkeypatch, value):
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V4_PROBE_ENV, value)
    assert "PROBE" not in _prepare().split_consts


@pytest.mark.parametrize("fmt", ["BF16", "C4R4", "C2R4"])
@pytest.mark.parametrize("value,want", [(None, None), ("4", 4), ("8", 8)])
def test_loader_warps_are_a_knob(monkeypatch, fmt, value, want):
    """Unset: the format's default (``heuristics.V4_LOADER_WARPS``); set: 4 or 8; v3 takes no such constexpr."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V4_LOADER_WARPS_ENV, value)
    assert _prepare(fmt).split_consts["LOADER_WARPS"] == (want or V4_LOADER_WARPS[fmt])
    assert "LOADER_WARPS" not in _prepare(variant="v3").split_consts


@pytest.mark.parametrize("value,want", [(None, None), ("0", False), ("1", True)])
def test_inline_protection_is_a_knob(monkeypatch, value, want):
    """Inline: the split kernel takes ``INLINE_PROT`` and no protected-tile kernel or partial is planned; else v3's
    protected parts."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V4_INLINE_PROTECT_ENV, value)
    want = V4_INLINE_PROTECT if value is None else want
    call = _prepare("C4R4")
    assert call.split_consts.get("INLINE_PROT", False) == want
    assert (call.protect_grid is None) == want
    assert (call.partial_specs[2][0][1] == 0) == want


def test_inline_protection_needs_bfloat16_protection(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, "1")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_V4_INLINE_PROTECT=1: kernel v4 reads bfloat16 protected "
                                         "tokens, the cache keeps torch.float32"):
        _prepare("C4R4", protect_dtype=torch.float32)


@pytest.mark.parametrize("fmt", ["BF16", "C4R4", "C2R4"])
@pytest.mark.parametrize("value", [None, "0", "1"])
@pytest.mark.parametrize("batch,tokens", [(32, 32768), (8, 4096)])
def test_channel_order_is_a_knob(monkeypatch, fmt, value, batch, tokens):
    """Packed pages: unset, the order follows the pages a split reads (B32 L32K: 256 a split, on; B8 L4K: 8, off);
    set, the knob. The split kernel and the merge kernel get the same order. BF16 pages: always plain."""
    _as_hopper(monkeypatch)
    _set_env(monkeypatch, A.V4_CHANNEL_ORDER_ENV, value)
    call = _prepare(fmt, batch=batch, tokens=tokens)
    want = (batch == 32) if value is None else value == "1"
    want = want and fmt != "BF16"
    assert call.split_consts.get("CHANNEL_ORDER", False) == want
    assert call.merge_consts["CHANNEL_ORDER"] == want
    assert _prepare(fmt, batch=batch, tokens=tokens, variant="v3").merge_consts["CHANNEL_ORDER"] is False


def test_channel_order_rule():
    """On from :data:`V4_CHANNEL_ORDER_MIN_PAGES` table pages a split (rounded up) on."""
    for splits in (1, 2, 7):
        assert v4_channel_order(V4_CHANNEL_ORDER_MIN_PAGES * splits, splits)
        assert v4_channel_order(V4_CHANNEL_ORDER_MIN_PAGES * splits - splits + 1, splits)
        assert not v4_channel_order((V4_CHANNEL_ORDER_MIN_PAGES - 1) * splits, splits)


def test_a_malformed_channel_order_knob_is_refused(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, "on")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_V4_CHANNEL_ORDER: expected one of 0, 1, got 'on'"):
        _prepare()


def test_a_malformed_loader_warps_knob_is_refused(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_LOADER_WARPS_ENV, "6")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_V4_LOADER_WARPS: expected one of 4, 8, got '6'"):
        _prepare()


def test_a_malformed_pipeline_knob_is_refused(monkeypatch):
    _as_hopper(monkeypatch)
    monkeypatch.setenv(A.V4_PIPELINE_ENV, "yes")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_V4_PIPELINE: expected one of 0, 1, 2, 3, 4, got 'yes'"):
        _prepare()


def test_v4_takes_no_probe_switch(monkeypatch):
    _as_hopper(monkeypatch)
    with pytest.raises(ValueError, match="'skip_pv' is a switch of kernels v1-v3, the call runs v4"):
        _prepare(overrides={"skip_pv": True})
    with pytest.raises(ValueError, match="'word_lanes' is a kernel-v3 switch, the call runs v4"):
        _prepare(overrides={"word_lanes": 4})


# ---------------------------------------------------------------- on an sm_90 GPU


def _gpu_cases() -> list[tuple[Case, int | None]]:
    """(case, forced splits): every format v4 reads at H 128 and 64, S_q 1 and 2, the edge lengths (one token,
    P-1/P/P+1, inside the sink and the window, beyond both), no sink or window, several splits over few tiles."""
    out, seed = [], 4000
    for name in ("BF16", "C4R4", "C2R4"):
        fmt = PackFormat.parse(name)
        for lens in edge_lengths(fmt, 4, 128):
            for heads, s_q in ((128, 1), (64, 2)):
                seed += 1
                lens_q = tuple(max(n, s_q) for n in lens)  # every query sees a token (else the reference is NaN)
                out.append((Case(fmt, lens_q, heads=heads, s_q=s_q, sink=4, local=128, seed=seed), None))
        out.append((Case(fmt, (1000, 130, 4099), heads=128, sink=0, local=0, seed=seed + 1), 5))
        out.append((Case(fmt, (777, 2000), heads=64, s_q=2, sink=4, local=128, seed=seed + 2), 3))
        out.append((Case(fmt, (20000, 5, 9000), heads=128, sink=4, local=128, seed=seed + 3), None))
        # 8 splits over 2 tiles: the last splits hold no packed page (with the protected tokens inline, the last one
        # attends to them alone)
        out.append((Case(fmt, (300, 5), heads=128, sink=4, local=128, seed=seed + 4), 8))
        seed += 10
    return out + _few_row_cases()


def _few_row_cases() -> list[tuple[Case, int | None]]:
    """(case, forced splits) with fewer query rows than v4's 64-row block (the rows past S_q x H masked): H 16 at the
    edge lengths, H 40 (rows not a multiple of 16) over several splits, one head over splits without packed pages."""
    out, seed = [], 4500
    for name in ("BF16", "C4R4", "C2R4"):
        fmt = PackFormat.parse(name)
        for lens in edge_lengths(fmt, 4, 128):
            seed += 1
            out.append((Case(fmt, lens, heads=16, sink=4, local=128, seed=seed), None))
        out.append((Case(fmt, (777, 2000), heads=40, sink=4, local=128, seed=seed + 1), 3))
        out.append((Case(fmt, (300, 5), heads=1, s_q=3, sink=4, local=128, seed=seed + 2), 8))
        seed += 10
    return out


def _attend(case: Case, cache, args, batch, variant: str, num_splits: int | None):
    return A.attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                       args["attn_seq_ids"], batch.softmax_scale, num_splits=num_splits, variant=variant)


#: kernel v4's builds on the GPU: ``QUANTMLA_TRITON_V4_PIPELINE``, then "w8" for 8 loader warps, "p" for the
#: protected tokens in the split kernel (``QUANTMLA_TRITON_V4_INLINE_PROTECT``), "c" for packed pages in channel_of
#: order (``QUANTMLA_TRITON_V4_CHANNEL_ORDER``; the others plain). Build 4 reads packed pages only
GPU_BUILDS = ["0", "1", "2", "3", "1w8", "2w8", "3w8", "1p", "1w8p", "2w8p", "1w8c", "1w8pc", "2w8pc", "4w8p", "4w8pc"]


def _set_build(monkeypatch, build: str) -> None:
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, "1" if build.endswith("c") else "0")
    build = build.rstrip("c")
    inline = build.endswith("p")
    pipeline, _, warps = build.rstrip("p").partition("w")
    monkeypatch.setenv(A.V4_PIPELINE_ENV, pipeline)
    monkeypatch.setenv(A.V4_LOADER_WARPS_ENV, warps or "4")
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, "1" if inline else "0")


@NEEDS_HOPPER
@pytest.mark.parametrize("build", GPU_BUILDS)
@pytest.mark.parametrize("case,splits", _gpu_cases(), ids=lambda x: str(x))
def test_v4_matches_reference_and_v3(case, splits, build, monkeypatch):
    """Against the float64 reference (bfloat16 tolerance) and against kernel v3 on the same cache and queries: both
    round the dequantized keys to bfloat16 once, so they differ only in summation order. Every build of v4
    (``QUANTMLA_TRITON_V4_PIPELINE``), with a loader of 4 and of 8 warps."""
    if build.startswith("4") and not case.fmt.quantized:
        pytest.skip("build 4 reads packed pages (refused over BF16 pages: test_pipelined_build_is_a_knob)")
    _set_build(monkeypatch, build)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    out_v3, lse_v3 = _attend(case, cache, args, batch, "v3", splits)
    out, lse = _attend(case, cache, args, batch, "v4", splits)
    assert A.LAST_LAUNCH["variant"] == "v4"
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, "bfloat16")
    torch.testing.assert_close(out.float(), out_v3.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_v3, rtol=1e-3, atol=1e-3)


@NEEDS_HOPPER
@pytest.mark.parametrize("build", GPU_BUILDS)
def test_v4_overwrites_poisoned_partials(monkeypatch, build):
    """Every partial a v4 split owns is written, empty splits included: with the partials' memory and the outputs
    NaN-filled, the outputs come back finite (and still match the reference)."""
    _set_build(monkeypatch, build)
    case = Case(PackFormat.parse("C4R4"), (3000, 64, 129), heads=128, seed=4999)
    check_poisoned_partials(monkeypatch, A, case, 4, "v4")


@NEEDS_HOPPER
@pytest.mark.parametrize("build", ["0", "1", "2", "1w8", "4w8"])
@pytest.mark.parametrize("probe", ["1", "2", "3", "4"])
def test_probe_builds_keep_the_handoffs(monkeypatch, build, probe):
    """The measurement builds run to the end (their barriers still pair up). Without the loader's output product
    (bit 1) the attender's channels ``[0, d_c/2)`` and the log-sum-exp still match the reference and the other half
    does not: the probe skips what it says. With made-up words (bit 2) the keys, so the outputs, are wrong."""
    _set_build(monkeypatch, build)
    monkeypatch.setenv(A.V4_PROBE_ENV, probe)
    case = Case(PackFormat.parse("C2R4"), (3000, 700), heads=128, seed=5003)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    with pytest.warns(RuntimeWarning, match="outputs are wrong"):
        out, lse = _attend(case, cache, args, batch, "v4", 4)
    torch.cuda.synchronize()
    if probe not in ("2", "4"):
        return
    want_out, want_lse = reference_outputs(batch, args, cache)
    if probe == "4":
        assert not np.allclose(out.float().cpu().numpy(), want_out, rtol=0.1, atol=0.1)
        return
    half = case.fmt.latent_dim // 2
    check_attention(out[..., :half], lse, want_out[..., :half], want_lse, "bfloat16")  # the reference is NumPy
    assert not np.allclose(out[..., half:].float().cpu().numpy(), want_out[..., half:], rtol=0.1, atol=0.1)
