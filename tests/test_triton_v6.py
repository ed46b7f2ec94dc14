"""Triton kernel v6 (Gluon, ``attention_v6_kernel.py``: QK's keys dequantized straight into registers, two programs
an SM): its channel map and conversion mirrored in NumPy, offline sm_90a builds, the launcher's rules on the CPU,
conformance on an sm_90 GPU.

Gluon has no interpreter: without a Hopper GPU the relabelling of converted code words into QK's A operand is checked
by a NumPy mirror against the reference's decoded pages (bit for bit), the builds offline (``offline_v4``), and the
launcher's refusals, plan and knob on stubbed kernels. On an H100/H200 the cases below run v6 against the float64
reference and kernel v5 on the same cache.
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat
from quantmla_core.reference.quantize import bits_to_bf16
from quantmla_core.testing import Case, check_attention, edge_lengths, write_case

from conformance import check_poisoned_partials, reference_outputs

pytest.importorskip("triton")
from quantmla_core.backends.triton import attention as A  # noqa: E402
from quantmla_core.backends.triton import attention_v6_kernel as v6  # noqa: E402
from quantmla_core.backends.triton import heuristics as HR  # noqa: E402
from quantmla_core.backends.triton.heuristics import V6_AHEAD, V6_CTAS_PER_SM, plan_v3  # noqa: E402

from test_triton_v5 import _as_hopper, _prepare as prepare_v5  # noqa: E402
from test_triton_v4_offline import (SMEM_LIMIT, _needs_gluon, _needs_ptxas, _oracle, _plane, _rows,  # noqa: E402
                                    _same_bits, _written_page)

ON_HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
NEEDS_HOPPER = pytest.mark.skipif(not ON_HOPPER or A.GLUON_IMPORT_ERROR is not None,
                                  reason="kernel v6 runs on an sm_90 GPU with triton's Gluon (no interpreter)")


# ---------------------------------------------------------------- the relabelling, mirrored in NumPy


def _relabelled(k: np.ndarray) -> np.ndarray:
    """``_relabel``: ``[64, W]`` viewed as ``[64, 2, ..., 2]``, permuted by ``RELABEL_ORDER[W]``, reshaped back."""
    n, w = k.shape
    bits = w.bit_length() - 1
    return k.reshape(n, *([2] * bits)).transpose(v6.RELABEL_ORDER[w]).reshape(n, w)


@pytest.mark.parametrize("width", [64, 32])
def test_a_channel_is_the_relabelling(width):
    """Position ``k`` of a relabelled chunk holds byte ``a_channel(k)``, a permutation of the chunk's bytes."""
    moved = _relabelled(np.arange(width)[None, :])[0]
    assert [v6.a_channel(k, width) for k in range(width)] == moved.tolist()
    assert sorted(moved.tolist()) == list(range(width))
    assert moved.tolist() != list(range(width))  # a real reordering: the queries must follow it


def test_relabel_orders_are_the_kernels():
    """The kernel spells the permutations out (Gluon's permute takes no constexpr tuple): they are RELABEL_ORDER's."""
    src = inspect.getsource(v6)
    found = re.findall(r"gl\.permute\(gl\.reshape\(k, \[64(?:, 2)+\]\), (\([0-9, ]+\))\)", src)
    assert [ast.literal_eval(x) for x in found] == [v6.RELABEL_ORDER[64], v6.RELABEL_ORDER[32]]


def _a_tiles(fmt: PackFormat, page: np.ndarray) -> tuple[dict, list, np.ndarray]:
    """Kernel v6's A tiles of one page as ``_page_bytes`` loads the words and ``_a_tile`` converts and relabels them:
    content tiles by group ``g`` (``[64, 64]``, bfloat16 ``s * (code - z)``), the two RoPE planes (``[64, 32]``, exact
    ``code - z``: the fold) and the RoPE scales that multiply their scores."""
    secs = {k: v[0] for k, v in fmt.sections.items()}
    cbytes, planes = fmt.latent_dim * fmt.content_bits // 8, 8 // fmt.content_bits
    words = _rows(page, secs["content_codes"], cbytes // 4, "<u4")
    scales = bits_to_bf16(_rows(page, secs["content_scales"], fmt.latent_dim // 64, "<u2"))
    zeros = _rows(page, secs["content_zeros"], fmt.latent_dim // 64, np.uint8)
    tiles = {}
    for c in range(cbytes // 64):
        for pl in range(planes):
            g = pl * cbytes // 64 + c
            zb = bits_to_bf16(zeros[:, g].astype(np.uint16) | 0x4300)
            k = _plane(words[:, 16 * c: 16 * c + 16], pl, fmt.content_bits, zb, scales[:, g], False, False)
            tiles[g] = _relabelled(k)
    rw = _rows(page, secs["rope_codes"], fmt.rope_dim * fmt.rope_bits // 32, "<u4")
    rs = _rows(page, secs["rope_scales"], 1, "<f4")[:, 0]
    rzb = bits_to_bf16(_rows(page, secs["rope_zeros"], 1, np.uint8)[:, 0].astype(np.uint16) | 0x4300)
    one = np.ones_like(rs)
    rope = [_relabelled(_plane(rw, pl, fmt.rope_bits, rzb, one, True, False)) for pl in range(2)]
    return tiles, rope, rs


@pytest.mark.parametrize("name", ["C4R4", "C2R4"])
def test_a_tiles_hold_the_reference_channels_a_channel_names(name):
    """Each relabelled content tile of group ``g`` holds, at position ``k``, channel ``64 g + a_channel(k, 64)`` of
    the reference's decoded page (bfloat16, bit for bit), and RoPE plane ``pl`` times each token's scale channel
    ``32 pl + a_channel(k, 32)`` (float64, exact: the RoPE fold): the channels the kernel loads the queries in
    (``_load_q_relabelled``) and stores the output back to."""
    from quantmla_core import reference as ref

    fmt, page = _written_page(name, seed=11)
    c_ref, _ = _oracle(fmt, page, False)
    r_ref = ref.decode_page(fmt, page)[1]
    tiles, rope, rs = _a_tiles(fmt, page)
    assert sorted(tiles) == list(range(fmt.latent_dim // 64))
    pos64, pos32 = np.arange(64), np.arange(32)
    for g, tile in tiles.items():
        want = c_ref[:, 64 * g + np.array([v6.a_channel(k, 64) for k in pos64])]
        assert _same_bits(tile, want), (g, np.argwhere(tile != want)[:5])
    for pl, tile in enumerate(rope):
        assert np.array_equal(tile, np.round(tile)) and np.abs(tile).max() <= 15  # exact code - z
        want = r_ref[:, 32 * pl + np.array([v6.a_channel(k, 32) for k in pos32])]
        np.testing.assert_array_equal(tile.astype(np.float64) * rs.astype(np.float64)[:, None], want)


def test_a_tiles_control_plain_order_mismatches():
    """Control: the tiles are not the reference's channels in plain order (the map matters)."""
    fmt, page = _written_page("C4R4", seed=12)
    c_ref, _ = _oracle(fmt, page, False)
    tiles, _, _ = _a_tiles(fmt, page)
    assert not np.array_equal(tiles[0], c_ref[:, :64])


# ---------------------------------------------------------------- offline sm_90a builds


@pytest.fixture(scope="module")
def reports_v6() -> dict:
    """``offline_v4.compile_report_v6`` of C4R4 and C2R4 at each prefetch depth, and a page ahead with the protected
    tokens inline (keyed ``(fmt, "1p")``) or with the key tile as one allocation a plane (``(fmt, "1k")``), in a
    subprocess without ``TRITON_INTERPRET``."""
    _needs_gluon()
    _needs_ptxas()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = {}
    for ahead, inline, planes in ((0, 0, 0), (1, 0, 0), (2, 0, 0), (1, 1, 0), (1, 0, 1)):
        cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m",
               "quantmla_core.backends.triton.offline_v4", "C4R4", "C2R4", "kernel=6", f"ahead={ahead}",
               f"inline_prot={inline}", f"key_planes={planes}"]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tempfile.gettempdir())
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert len(lines) == 2, r.stdout + r.stderr
        for fmt, line in zip(("C4R4", "C2R4"), lines):
            key = (fmt, f"{ahead}p" if inline else f"{ahead}k" if planes else ahead)
            out[key] = ast.literal_eval(line)
            assert "err" not in out[key], out[key]
    return out


@pytest.mark.parametrize("ahead", [0, 1, 2])
@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_v6_build(reports_v6, fmt, ahead):
    """68 ``wgmma`` a page (QK: 8 content tiles x 4 k-steps + 2 RoPE planes x 2, A from registers; PV 8 x 4),
    pipelined; two programs' shared memory within an SM's; no spills (the descriptors made in the loop, not hoisted
    into ~80 registers: ``_opaque_zero``); the relabelling moves
    no data (the loops' plain shared-memory loads and stores are the softmax's column maxima alone: a relabel through
    shared memory would add 32 of each a tile); three CTA barriers a page with triton 3.7 (before the key tile's first
    store, the warps' maxima, P; ten with 3.6) with the softmax's sums deferred (``_softmax_deferred``; reducing them and the maxima across
    warps each page took seven)."""
    r = reports_v6[fmt, ahead]
    assert r["ahead"] == ahead and not r["key_planes"] and r["wgmma"] == 68 and not r["wgmma_serialized"], r
    assert V6_CTAS_PER_SM * r["smem"] <= SMEM_LIMIT, r
    assert r["spill_bytes"] == 0, r
    if r["sass"] >= 0:
        # triton 3.6 (the GPU machine's) puts a barrier before each of the key tile's 8 stores, not only the first
        most_bars = 3 if tuple(int(x) for x in r["triton"].split(".")[:2]) >= (3, 7) else 10
        assert r["sts_in_loops"] <= 16 and r["lds_in_loops"] <= 16 and r["bar_in_loops"] <= most_bars, r


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_v6_build_key_planes(reports_v6, fmt):
    """With the key tile as one shared allocation a 64-channel plane (``KEY_PLANES``): three CTA barriers a page with
    either triton (with one allocation triton 3.6 puts one before each plane's store), the same 68 ``wgmma``, no
    spills, two programs an SM, and the page loop within 3 % of the one-allocation build's instructions (its 8 output
    products each make their own descriptors)."""
    r, plain = reports_v6[fmt, "1k"], reports_v6[fmt, 1]
    assert r["key_planes"] and r["wgmma"] == 68 and not r["wgmma_serialized"], r
    assert r["spill_bytes"] == 0 and V6_CTAS_PER_SM * r["smem"] <= SMEM_LIMIT, r
    if r["sass"] >= 0:
        assert r["bar_in_loops"] <= 3 and r["sts_in_loops"] <= 16 and r["lds_in_loops"] <= 16, r
        assert abs(r["loop_sizes"][0] - plain["loop_sizes"][0]) <= 0.03 * plain["loop_sizes"][0], (r, plain)


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_offline_v6_build_inline_protected(reports_v6, fmt):
    """With the protected tokens in the last split: a second page loop over bfloat16 rows (its own 68 ``wgmma``, not
    serialized), still no spills and two programs an SM, and the packed loop within 3 % of its instructions without
    it (the protected loop comes after it and shares none of its code)."""
    r, plain = reports_v6[fmt, "1p"], reports_v6[fmt, 1]
    assert r["inline_prot"] and r["wgmma"] == 2 * plain["wgmma"] == 136 and not r["wgmma_serialized"], r
    assert r["spill_bytes"] == 0 and V6_CTAS_PER_SM * r["smem"] <= SMEM_LIMIT, r
    if r["sass"] >= 0:
        packed, packed_plain = r["loop_sizes"][0], plain["loop_sizes"][0]
        assert len(r["loop_sizes"]) == len(plain["loop_sizes"]) + 1, (r, plain)
        assert abs(packed - packed_plain) <= 0.03 * packed_plain, (r["loop_sizes"], plain["loop_sizes"])


# ---------------------------------------------------------------- the launcher (CPU, kernels stubbed)


def _prepare(*args, **kw):
    return prepare_v5(*args, variant="v6", **kw)


def test_v6_is_refused_off_a_gpu_with_the_reason():
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_ATTENTION=v6: kernel v6 .*(NVIDIA GPUs|Gluon)"):
        _prepare()


@pytest.mark.parametrize("kwargs,why", [
    ({"q_dtype": torch.float32}, "kernel v6 takes bfloat16 queries, got torch.float32"),
    ({"fmt": "BF16"}, "kernel v6 reads pages of C4R4/C2R4, got BF16"),
    ({"fmt": "C4R8"}, "kernel v6 reads pages of C4R4/C2R4, got C4R8"),
    ({"latent_dim": 256, "rope_dim": 32}, r"kernel v6 is built for \(d_c, d_r\) = \(512, 64\), got \(256, 32\)"),
    ({"page_size": 32}, "kernel v6 reads 64-token pages, got page_size=32"),
], ids=str)
def test_v6_names_what_it_cannot_serve(monkeypatch, kwargs, why):
    _as_hopper(monkeypatch)
    with pytest.raises(ValueError, match=why):
        _prepare(**kwargs)


def test_v6_needs_hopper(monkeypatch):
    _as_hopper(monkeypatch, 8)
    with pytest.raises(ValueError, match=r"kernel v6 needs compute capability 9.x \(Hopper\), cpu is 8.x"):
        _prepare()


@pytest.mark.parametrize("inline", ["1", "0", None])
@pytest.mark.parametrize("heads,s_q", [(16, 1), (16, 2), (40, 1), (1, 3)])
@pytest.mark.parametrize("batch,tokens", [(32, 32768), (8, 4096), (1, 65536)])
def test_v6_plan(monkeypatch, heads, s_q, batch, tokens, inline):
    """Row blocks of 16 rows; the splits kernel v3 takes for twice the programs (two programs an SM, so the same rule
    on twice the SMs); the protected tokens in the last split or by the protected-tile kernel as v4's knob says (unset:
    v6's own default, ``heuristics.V6_INLINE_PROTECT``, here off while v4's is on); plain channel order even where
    v4's knob asks for its order; v4's partials."""
    _as_hopper(monkeypatch)
    if inline is None:
        monkeypatch.delenv(A.V4_INLINE_PROTECT_ENV, raising=False)
        monkeypatch.setattr(A, "V4_INLINE_PROTECT", True)
        monkeypatch.setattr(A, "V6_INLINE_PROTECT", False)
    else:
        monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, inline)
    monkeypatch.setenv(A.V4_CHANNEL_ORDER_ENV, "1")
    call = _prepare("C2R4", batch=batch, heads=heads, s_q=s_q, tokens=tokens)
    rows = heads * s_q
    pl = call.plan
    assert call.variant == "v6" and pl.block_r == 16 and pl.row_blocks == -(-rows // 16) and pl.block_n == 128
    assert call.split_grid == (pl.num_splits, batch, pl.row_blocks)
    v3 = plan_v3(batch, 64 * pl.row_blocks, 512, 64, tokens, V6_CTAS_PER_SM * 132)
    assert pl.num_splits == v3.num_splits
    assert bool(call.split_consts.get("INLINE_PROT")) == (call.protect_grid is None) == (inline == "1")
    assert not call.split_consts.get("CHANNEL_ORDER") and not call.merge_consts["CHANNEL_ORDER"]
    assert call.partial_specs[:2] == (((batch, pl.num_splits, rows, 512), torch.float32),
                                      ((batch, pl.num_splits, rows), torch.float32))
    assert call.split_dims["num_warps"] == 4


def _consts_with(monkeypatch, env: str, value: str | None) -> dict:
    """The prepared v6 call's constexprs (stubbed Hopper) with ``$env`` set to ``value`` (unset where None)."""
    _as_hopper(monkeypatch)
    if value is None:
        monkeypatch.delenv(env, raising=False)
    else:
        monkeypatch.setenv(env, value)
    return _prepare().split_consts


@pytest.mark.parametrize("value", [None, "0", "1", "2"])
def test_v6_ahead_is_a_knob(monkeypatch, value):
    consts = _consts_with(monkeypatch, A.V6_AHEAD_ENV, value)
    assert consts["AHEAD"] == (V6_AHEAD if value is None else int(value))


@pytest.mark.parametrize("value", [None, "0", "1"])
def test_v6_key_planes_is_a_knob(monkeypatch, value):
    """Unset: the default for the running triton (:func:`heuristics.v6_key_planes`); else the value asked for."""
    consts = _consts_with(monkeypatch, A.V6_KEY_PLANES_ENV, value)
    assert consts["KEY_PLANES"] is (HR.v6_key_planes(A.triton.__version__) if value is None else value == "1")


@pytest.mark.parametrize("setting,version,want", [
    (None, "3.6.0", True), (None, "3.6.1+git0123abc", True), (None, "3.7.1", False), (None, "3.10.0", False),
    (None, "4.0.0", False), (None, "2.3.1", True), (True, "3.7.1", True), (False, "3.6.0", False)])
def test_v6_key_planes_default_follows_the_triton_release(monkeypatch, setting, version, want):
    """One allocation a plane below :data:`heuristics.V6_KEY_PLANES_BEFORE` (3.7) unless the default is set."""
    monkeypatch.setattr(HR, "V6_KEY_PLANES", setting)
    monkeypatch.setattr(HR, "V6_KEY_PLANES_BEFORE", (3, 7))
    assert HR.v6_key_planes(version) is want


@pytest.mark.parametrize("env,value", [("V6_AHEAD_ENV", "3"), ("V6_AHEAD_ENV", "x"), ("V6_KEY_PLANES_ENV", "2"),
                                       ("V6_KEY_PLANES_ENV", "x")])
def test_malformed_v6_knobs_are_refused(monkeypatch, env, value):
    with pytest.raises(ValueError, match=getattr(A, env)):
        _consts_with(monkeypatch, getattr(A, env), value)


@pytest.mark.parametrize("v6_auto,fmt,heads,s_q,pages,want", [
    (True, "C4R4", 16, 1, 256, "v6"), (True, "C2R4", 8, 2, 256, "v6"), (True, "C2R4", 16, 2, 256, "v5"),
    (True, "C4R4", 16, 1, 255, "v5"), (True, "C2R4", 1, 1, 64, "v5"), (True, "BF16", 16, 1, 256, "v1"),
    (True, "C4R8", 16, 1, 256, "v2"), (False, "C4R4", 16, 1, 256, "v5")])
def test_auto_runs_v6_up_to_16_rows_over_long_tables_where_on(monkeypatch, v6_auto, fmt, heads, s_q, pages, want):
    """With ``heuristics.V6_AUTO`` on, auto runs v6 in v5's place over C4R4/C2R4 pages up to 16 query rows a request
    (one row block) where the block table holds ``heuristics.V6_MIN_TABLE_TOKENS`` (16,384: 256 pages of 64) tokens a
    request or more; v5 above 16 rows or below that; BF16 pages keep v1, formats neither reads v2; off, v5."""
    _as_hopper(monkeypatch)
    monkeypatch.setattr(A, "V6_AUTO", v6_auto)
    monkeypatch.setattr(A, "V6_MIN_TABLE_TOKENS", 256 * 64)  # the shipped value: the defaults' test in test_triton_v5
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    f = PackFormat.parse(fmt)
    cache = qm.MLACache.allocate(f, pages, 1, 4, 128, device="cpu")
    call = A.prepare(cache, torch.arange(pages, dtype=torch.int32).view(1, pages),
                     torch.tensor([4096], dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1, s_q, heads,
                     torch.bfloat16, 0.05)
    assert call.variant == want


# ---------------------------------------------------------------- on an sm_90 GPU


def _gpu_cases() -> list[tuple[Case, int | None]]:
    """(case, forced splits): C4R4 and C2R4 at H 16 (S_q 1 and 2: two row blocks) over the edge lengths, H 40 (a row
    block part-filled) over 3 splits, one head with S_q 3 over 8 splits (splits without packed pages), no sink or
    window, a long request beside short ones."""
    out, seed = [], 7000
    for name in ("C4R4", "C2R4"):
        fmt = PackFormat.parse(name)
        for lens in edge_lengths(fmt, 4, 128):
            for s_q in (1, 2):
                seed += 1
                lens_q = tuple(max(n, s_q) for n in lens)
                out.append((Case(fmt, lens_q, heads=16, s_q=s_q, sink=4, local=128, seed=seed), None))
        out.append((Case(fmt, (777, 2000), heads=40, sink=4, local=128, seed=seed + 1), 3))
        out.append((Case(fmt, (300, 5), heads=1, s_q=3, sink=4, local=128, seed=seed + 2), 8))
        out.append((Case(fmt, (1000, 130, 4099), heads=16, sink=0, local=0, seed=seed + 3), 5))
        out.append((Case(fmt, (20000, 5, 9000), heads=16, sink=4, local=128, seed=seed + 4), None))
        seed += 10
    return out


def _attend(cache, args, batch, variant: str, num_splits: int | None):
    return A.attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                       args["attn_seq_ids"], batch.softmax_scale, num_splits=num_splits, variant=variant)


#: GPU builds: "a" + AHEAD, "p" where the protected tokens are in the last split (else the protected-tile kernel), "k"
#: where the key tile is one allocation a plane (``KEY_PLANES``)
BUILDS = ["a0pk", "a1pk", "a2pk", "a1k", "a1p", "a1"]


def _set_build(monkeypatch, build: str) -> None:
    monkeypatch.setenv(A.V6_AHEAD_ENV, build[1])
    monkeypatch.setenv(A.V4_INLINE_PROTECT_ENV, "1" if "p" in build else "0")
    monkeypatch.setenv(A.V6_KEY_PLANES_ENV, "1" if "k" in build else "0")


@NEEDS_HOPPER
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case,splits", _gpu_cases(), ids=lambda x: str(x))
def test_v6_matches_reference_and_v5(case, splits, build, monkeypatch):
    """Against the float64 reference (bfloat16 tolerance) and kernel v5 on the same cache and queries (both round the
    dequantized keys to bfloat16 once; they differ in summation order and in P's bfloat16 rounding)."""
    _set_build(monkeypatch, build)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    out_v5, lse_v5 = _attend(cache, args, batch, "v5", splits)
    out, lse = _attend(cache, args, batch, "v6", splits)
    assert A.LAST_LAUNCH["variant"] == "v6"
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, "bfloat16")
    torch.testing.assert_close(out.float(), out_v5.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, lse_v5, rtol=1e-3, atol=1e-3)


@NEEDS_HOPPER
@pytest.mark.parametrize("build", BUILDS)
def test_v6_overwrites_poisoned_partials(monkeypatch, build):
    """Every partial a v6 split owns is written, empty splits included (NaN-filled partials and outputs come back
    finite and match the reference)."""
    _set_build(monkeypatch, build)
    case = Case(PackFormat.parse("C2R4"), (3000, 64, 129), heads=16, s_q=2, seed=7999)
    check_poisoned_partials(monkeypatch, A, case, 6, "v6")


@NEEDS_HOPPER
@pytest.mark.parametrize("name,heads,s_q", [("C4R4", 16, 1), ("C2R4", 16, 1), ("C4R4", 8, 2), ("C2R4", 5, 3)])
def test_auto_runs_v6_and_matches_reference(monkeypatch, name, heads, s_q):
    """``auto`` (heuristics' defaults, no knob set) runs v6 up to 16 query rows a request over packed pages where the
    block table is long enough, and matches the reference there."""
    for env in (A.VARIANT_ENV, A.V6_AHEAD_ENV, A.V4_INLINE_PROTECT_ENV, A.V6_KEY_PLANES_ENV):
        monkeypatch.delenv(env, raising=False)
    case = Case(PackFormat.parse(name), (17000, 70, 131), heads=heads, s_q=s_q, sink=4, local=128, seed=7900 + heads)
    batch, args, cache = write_case(case, "cuda", "bfloat16")
    out, lse = _attend(cache, args, batch, "auto", None)
    assert A.LAST_LAUNCH["variant"] == "v6"
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, "bfloat16")
