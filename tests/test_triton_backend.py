"""Triton backend against the reference.

Without a GPU the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set by
conftest.py) on small shapes; with a GPU the same tests run on CUDA and, in addition, at the
real shapes of DeepSeek-V2-Lite (H=16) and V3 (H=128), d_c=512, d_r=64.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import PackFormat, get_backend
from quantmla_core import reference as ref
from quantmla_core.testing import Case, allocate, build, check_attention, edge_lengths, generate_cases, write_case

from conformance import check_attention_case, check_writer, reference_outputs

pytest.importorskip("triton")

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
BACKEND = get_backend("triton")


def _served(case: Case) -> bool:
    """Cases the backend declares it can attend over (C2R2 at d_r=32 has 8-wide slices: no)."""
    from quantmla_core.dispatch import DeviceInfo, Problem

    return not BACKEND.extra_reasons(Problem("attention", case.fmt, DeviceInfo("cuda"), num_heads=case.heads, q_len=case.s_q))


CASES = [c for c in generate_cases(BACKEND.capabilities, quick=not GPU) if _served(c)]
FORMATS = ("C4R4", "C2R4", "C4R8", "C8R8", "BF16")
DIMS = ((512, 64), (256, 32))


def _fmt_cases() -> list[Case]:
    """Every required format and dims at the edge lengths (several requests per batch)."""
    out, seed = [], 1000
    for name in FORMATS:
        for dc, dr in DIMS:
            fmt = PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
            for lens in edge_lengths(fmt, 4, 16)[1:]:
                seed += 1
                out.append(Case(fmt, lens, heads=4, seed=seed))
    return out


FMT_CASES = _fmt_cases()

# ---------------------------------------------------------------- attention kernel variants
#: split kernels behind $QUANTMLA_TRITON_ATTENTION (read per call by backends/triton/attention.py)
VARIANTS = ("v1", "v2", "v3")


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    monkeypatch.setenv("QUANTMLA_TRITON_ATTENTION", request.param)
    return request.param


def _v2_cases() -> list[Case]:
    """A small set for kernel v2 in the interpreter: every fast format, both dims, S_q 1 and 3,
    heads 4 and 20 (20 rows: the wide 8-warp program), lengths crossing page / 64-token tile /
    split edges, protection on and off and a one-token sink and ring, pages of 16 (tiles spanning pages), groups of 128."""
    f = PackFormat.parse
    return [
        Case(f("C4R4"), (63, 64, 65), heads=4, seed=9001),
        Case(f("C4R4"), (200, 4), heads=20, s_q=1, local=0, seed=9002),
        Case(f("C2R4"), (3, 19, 197), heads=4, s_q=3, seed=9003),
        Case(f("C2R4", latent_dim=256, rope_dim=32), (130, 64), heads=20, s_q=3, seed=9004),
        Case(f("C4R4", latent_dim=256, rope_dim=32), (150, 21), heads=4, sink=0, local=0, seed=9005),
        Case(f("BF16"), (70, 9, 129), heads=4, sink=0, local=0, seed=9006),
        Case(f("BF16", latent_dim=256, rope_dim=32), (100,), heads=20, s_q=3, seed=9007),
        Case(f("C8R8", latent_dim=256, rope_dim=32), (90, 3), heads=4, seed=9008),
        Case(f("C4R8"), (80,), heads=4, s_q=2, seed=9009),
        Case(f("C4R4", page_size=16), (37, 100), heads=3, s_q=2, seed=9010),
        Case(f("C2R4", page_size=32), (70, 33), heads=4, seed=9011),
        Case(f("C4R4", group_size=128), (70, 9), heads=4, seed=9012),
        Case(f("C4R4", latent_dim=256, rope_dim=32), (7, 2, 66), heads=2, s_q=2, sink=1, local=1, seed=9013),
    ]


V2_CASES = _v2_cases()


def _v3_cases() -> list[Case]:
    """Kernel v3 (64 query rows per program) in the interpreter: 64 and 80 rows (a partly
    filled second row block), S_q 1-4, every format it serves at both dims, lengths crossing
    page / 128-token tile / split edges, sink and window on and off, pages of 16 and 32 (tiles
    spanning pages), groups of 128 and (2-bit content, 16 groups of scales a token) of 32, and a request of 8 rows
    (forced)."""
    f = PackFormat.parse
    return [
        Case(f("C4R4"), (127, 128, 129), heads=64, seed=9101),
        Case(f("C4R4"), (300, 4), heads=20, s_q=4, local=0, seed=9102),
        Case(f("C2R4"), (4, 19, 260), heads=16, s_q=4, seed=9103),
        Case(f("C2R4", latent_dim=256, rope_dim=32), (130, 64), heads=32, s_q=2, seed=9104),
        Case(f("C4R4", latent_dim=256, rope_dim=32), (150, 21), heads=64, sink=0, local=0, seed=9105),
        Case(f("BF16"), (70, 9, 200), heads=64, sink=0, local=0, seed=9106),
        Case(f("BF16", latent_dim=256, rope_dim=32), (100,), heads=20, s_q=4, seed=9107),
        Case(f("C8R8", latent_dim=256, rope_dim=32), (90, 3), heads=64, seed=9108),
        Case(f("C4R8"), (180,), heads=32, s_q=2, seed=9109),
        Case(f("C4R4", page_size=16), (37, 200), heads=64, seed=9110),
        Case(f("C2R4", page_size=32), (170, 33), heads=64, seed=9111),
        Case(f("C4R4", group_size=128), (170, 9), heads=64, seed=9112),
        Case(f("C4R4"), (140, 5), heads=4, s_q=2, seed=9113),
        Case(f("C2R4", latent_dim=256, rope_dim=32), (7, 2, 66), heads=32, s_q=2, sink=1, local=1, seed=9114),
        Case(f("C2R4", group_size=32), (150, 70), heads=64, seed=9115),
    ]


V3_CASES = _v3_cases()


def test_backend_declares_cpu_only_in_interpreter():
    devices = BACKEND.capabilities.devices
    assert {"cuda", "rocm"} <= devices
    import os

    assert ("cpu" in devices) == (os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", FMT_CASES[::2] if not GPU else FMT_CASES, ids=str)
def test_writer_matches_reference(case, dtype):
    check_writer(case, "triton", DEVICE, dtype)


@pytest.mark.parametrize("case", FMT_CASES + CASES, ids=str)
def test_attention_matches_reference(case, variant):
    """Pages written by the torch backend, read by Triton (float32 queries, tight tolerance).
    Without a GPU only v1 runs the full set (interpreter time); v2 and v3 run V2_CASES and
    V3_CASES below."""
    if variant != "v1" and not GPU:
        pytest.skip(f"interpreter: {variant} runs the small {variant.upper()}_CASES set")
    check_attention_case(case, "torch", "triton", DEVICE)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", V2_CASES, ids=str)
def test_v2_attention_matches_reference(case, dtype, monkeypatch):
    monkeypatch.setenv("QUANTMLA_TRITON_ATTENTION", "v2")
    if dtype == "bfloat16" and not GPU and case.seed % 3:
        pytest.skip("interpreter: bfloat16 queries on every third case")
    check_attention_case(case, "torch", "triton", DEVICE, dtype)
    from quantmla_core.backends.triton.attention import LAST_LAUNCH

    # float32 queries on a GPU run v1 (heuristics.V2_FLOAT32_ON_GPU)
    assert LAST_LAUNCH["variant"] == ("v2" if dtype == "bfloat16" or not GPU else "v1")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", V3_CASES, ids=str)
def test_v3_attention_matches_reference(case, dtype, monkeypatch):
    monkeypatch.setenv("QUANTMLA_TRITON_ATTENTION", "v3")
    if dtype == "bfloat16" and not GPU and case.seed % 2:
        pytest.skip("interpreter: bfloat16 queries on every second case")
    check_attention_case(case, "torch", "triton", DEVICE, dtype)
    from quantmla_core.backends.triton.attention import LAST_LAUNCH

    # float32 queries on a GPU run v1 (heuristics.V2_FLOAT32_ON_GPU)
    assert LAST_LAUNCH["variant"] == ("v3" if dtype == "bfloat16" or not GPU else "v1")


def _declared_dims_cases() -> list[Case]:
    """The dims the backend declares beyond 512/64 and 256/32 (d_c 128-1024, d_r 32-128), through ``auto``: v2 and v1
    at 4 heads, v3 at 64. On a GPU these are the plans whose shared memory the launcher checks on every device (the
    d_c 1024 combine runs 16-token tiles; stop 42)."""
    f = PackFormat.parse
    return [
        Case(f("C4R4", latent_dim=1024, rope_dim=64), (70, 130), heads=4, seed=9201),
        Case(f("BF16", latent_dim=1024, rope_dim=128), (90, 5), heads=4, seed=9202),
        Case(f("C2R4", latent_dim=1024, rope_dim=64), (140,), heads=64, seed=9203),
        Case(f("C4R4", latent_dim=512, rope_dim=128), (100, 33), heads=64, seed=9204),
        Case(f("C4R8", latent_dim=128, rope_dim=32), (80, 17), heads=4, s_q=2, seed=9205),
    ]


@pytest.mark.parametrize("case", _declared_dims_cases(), ids=str)
def test_declared_dims_match_reference(case):
    from quantmla_core.backends.triton.attention import LAST_LAUNCH

    check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")
    if not GPU or (torch.version.hip is None and torch.cuda.get_device_capability()[0] == 9):  # Hopper, interpreter
        assert LAST_LAUNCH["variant"] == ("v3" if case.heads >= 64 else "v2" if case.fmt.quantized else "v1")


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_v3_split_counts_and_prefetch(splits, prefetch):
    """Forced split counts over 64 rows (S_q 2 x H 32), with tokens in the sink and the window,
    with the tile's bytes loaded up front (the default) and chunk by chunk."""
    case = Case(PackFormat.parse("C2R4"), (700, 260), heads=32, s_q=2, seed=78 + splits)
    _attend_direct(case, "bfloat16" if GPU else "float32", variant="v3", num_splits=splits,
                   overrides={"prefetch": prefetch})


@pytest.mark.parametrize("batch,rows,tokens,splits", [(32, 128, 32768, 2), (8, 128, 4096, 8), (32, 80, 32768, 2),
                                                     (1, 64, 2048, 4), (128, 128, 131072, 18)])
def test_v3_plan(batch, rows, tokens, splits):
    """One program per SM: the split count fills whole rounds of 132 programs, shares of >= 4 tiles
    of 128 tokens, rows in blocks of 64 (80 rows: two blocks)."""
    from quantmla_core.backends.triton import heuristics as hz

    pl = hz.plan_v3(batch, rows, 512, 64, tokens, 132)
    assert (pl.block_n, pl.block_r, pl.num_warps) == (128, 64, 8)
    assert pl.row_blocks == -(-rows // 64) and pl.num_splits == splits
    assert -(-tokens // 128) // pl.num_splits >= hz.V3_MIN_TILES_PER_SPLIT or pl.num_splits == 1
    ctas = batch * pl.row_blocks * pl.num_splits
    assert ctas < 132 or ctas / (132 * -(-ctas // 132)) > 0.95  # the last round nearly full


@pytest.mark.parametrize("words", [{"word_codes": False}, {"word_codes": True},
                                   {"word_codes": True, "ptx_split": False}, {"word_codes": True, "word_lanes": 4},
                                   {"word_codes": True, "ptx_split": False, "word_lanes": 4},
                                   {"word_codes": True, "word_lanes": 4, "tile_groups": False}], ids=str)
@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4", "C4R8", "C8R8"])
def test_v3_code_words(fmt_name, words):
    """Kernel v3's codes from bytes and from 32-bit words (2- and 4-bit codes; 8-bit ones stay bytes), the words taken
    apart in PTX (the default on NVIDIA GPUs) or in portable Triton, in either column order (``word_lanes``), with the
    scales loaded per tile or per chunk (``tile_groups``); 64 rows over partial tiles and two splits."""
    case = Case(PackFormat.parse(fmt_name), (300, 129), heads=32, s_q=2, seed=81)
    _attend_direct(case, "bfloat16" if GPU else "float32", variant="v3", num_splits=2, overrides=words)


def test_code_word_runs_are_aligned_in_every_layout():
    """``code_words.load_words`` reads 32-bit words: every page, code section, token row and chunk of 2- and 4-bit
    codes starts on a multiple of 4 bytes, for each format, dims, page and group size the backend serves."""
    from quantmla_core.backends.triton import slice_width
    from quantmla_core.backends.triton.common import page_layout_constexprs

    checked = 0
    for c in CASES + FMT_CASES + V3_CASES:
        fmt, consts = c.fmt, page_layout_constexprs(c.fmt)
        if not fmt.quantized:
            continue
        for bits, dim, group, off in [(fmt.content_bits, fmt.latent_dim, fmt.content_group_size, consts["C_CODES_OFF"]),
                                      (fmt.rope_bits, fmt.rope_dim, fmt.rope_group_size, consts["R_CODES_OFF"])]:
            if bits < 8:
                checked += 1
                runs = (consts["PAGE_BYTES"], off, dim * bits // 8, slice_width(dim, bits, group))
                assert all(r % 4 == 0 for r in runs), (fmt, bits, runs)
    assert checked > 20


def test_ptx_split_is_refused_off_nvidia():
    """The PTX path is NVIDIA's: asked for where the call cannot run it, the launcher says why."""
    case = Case(PackFormat.parse("C4R4"), (70,), heads=64, seed=4)
    if GPU and torch.version.hip is None:
        pytest.skip("this GPU runs PTX")
    with pytest.raises(ValueError, match="'ptx_split' cannot run here: PTX runs on NVIDIA GPUs, the call runs on cpu"
                       if not GPU else "'ptx_split' cannot run here: ROCm"):
        _attend_direct(case, variant="v3", overrides={"ptx_split": True})
    with pytest.raises(ValueError, match="'word_lanes' is a kernel-v3 switch, the call runs v2"):
        _attend_direct(case, variant="v2", overrides={"word_lanes": 4})
    with pytest.raises(ValueError, match="'word_codes' is a kernel-v2/v3 switch, the call runs v1"):
        _attend_direct(case, variant="v1", overrides={"word_codes": True})


def test_kernel_switches_name_their_variant():
    case = Case(PackFormat.parse("C4R4"), (70,), heads=4, seed=3)
    with pytest.raises(ValueError, match="'prefetch' is a kernel-v3 switch"):
        _attend_direct(case, variant="v2", overrides={"prefetch": True})
    with pytest.raises(ValueError, match="'zsub' is a kernel-v2 switch"):
        _attend_direct(case, variant="v3", overrides={"zsub": True})


def _attend_direct(case: Case, dtype: str = "float32", tol_dtype: str | None = None, **kwargs):
    """Write with torch, attend with the Triton op directly (kwargs: num_splits, overrides,
    variant), compare with the reference."""
    from quantmla_core.backends.triton.attention import attention as triton_attention

    batch, args, cache = write_case(case, DEVICE, dtype)
    out, lse = triton_attention(args["q_latent"], args["q_rope"], cache, args["block_table"], args["attn_seq_lens"],
                                args["attn_seq_ids"], batch.softmax_scale, **kwargs)
    want_out, want_lse = reference_outputs(batch, args, cache)
    check_attention(out, lse, want_out, want_lse, tol_dtype or dtype)


@pytest.mark.parametrize("switches", [{"code_bias": 128}, {"pv_form": 1}, {"hold_raw": True},
                                      {"code_bias": 128, "pv_form": 1, "block_r": 32}, {"block_n": 32},
                                      {"zsub": True}, {"zsub": True, "code_bias": 128, "pv_form": 1}], ids=str)
@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4"])
def test_v2_switches(fmt_name, switches):
    """Kernel-v2 switches the probe times: the +128 code bias algebra (forced in float32, where
    the interpreter can run it), both PV orientations, bytes held for PV, a wider row block.
    bfloat16 queries on a GPU (float32 ones run v1 there)."""
    case = Case(PackFormat.parse(fmt_name), (150, 66), heads=5, s_q=2, seed=77)
    # the bias serves bfloat16 dots (tolerance 1e-2); in float32 its cancellation (128 + code
    # against code - zero, 2-bit codes) costs ~1e-4 relative, far below that, while a wrong
    # correction would be off by O(1)
    tol = "bfloat16" if "code_bias" in switches else None
    _attend_direct(case, "bfloat16" if GPU else "float32", tol_dtype=tol, variant="v2", overrides=switches, num_splits=2)


@pytest.mark.parametrize("switches", [{"word_codes": True}, {"word_codes": True, "ptx_split": False},
                                      {"word_codes": True, "code_bias": 128}, {"word_codes": True, "zsub": True},
                                      {"word_codes": True, "hold_raw": True, "pv_form": 1}], ids=str)
@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4", "C4R8"])
def test_v2_code_words(fmt_name, switches):
    """Kernel v2 with 2- and 4-bit codes from 32-bit words in its operands' quad order (``_word_plane``; the PTX
    split on NVIDIA GPUs unless ``ptx_split`` is off): the query slices and the partial outputs follow the order,
    with the bias algebra, ZSUB, held words and both PV orientations."""
    case = Case(PackFormat.parse(fmt_name), (150, 66), heads=5, s_q=2, seed=78)
    tol = "bfloat16" if "code_bias" in switches else None
    _attend_direct(case, "bfloat16" if GPU else "float32", tol_dtype=tol, variant="v2", overrides=switches,
                   num_splits=2)


def test_variant_env_is_read_per_call(monkeypatch):
    from quantmla_core.backends.triton.attention import LAST_LAUNCH

    case = Case(PackFormat.parse("C4R4"), (70,), heads=2, seed=5)
    for v in ("v1", "v2", "v1"):
        monkeypatch.setenv("QUANTMLA_TRITON_ATTENTION", v)
        check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")
        assert LAST_LAUNCH["variant"] == v
    monkeypatch.delenv("QUANTMLA_TRITON_ATTENTION")  # auto: v2 for packed pages + bf16 queries
    check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")
    assert LAST_LAUNCH["variant"] == "v2"
    check_attention_case(Case(PackFormat.parse("BF16"), (70,), heads=2, seed=5), "torch", "triton", DEVICE, "bfloat16")
    assert LAST_LAUNCH["variant"] == "v1"
    many = Case(PackFormat.parse("C4R4"), (70,), heads=64, seed=6)  # auto: v3 from 64 query rows, v4 where it serves
    check_attention_case(many, "torch", "triton", DEVICE, "bfloat16")
    from quantmla_core.backends.triton.attention import v4_unsupported

    v4_serves = v4_unsupported(many.fmt, torch.bfloat16, torch.device(DEVICE)) is None
    assert LAST_LAUNCH["variant"] == ("v4" if v4_serves else "v3")
    monkeypatch.setenv("QUANTMLA_TRITON_ATTENTION", "v9")
    with pytest.raises(ValueError, match="QUANTMLA_TRITON_ATTENTION"):
        check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")


@pytest.mark.parametrize("name,variant", [("C4R4", "v2"), ("C2R4", "v2"), ("C4R4", "v1"), ("BF16", "v1"), ("C4R4", "v3"),
                                          ("BF16", "v3")])
def test_cached_launch_constants_match_a_fresh_build(monkeypatch, name, variant):
    """The launcher caches its plan and constexprs per shape; a probe call (which builds them
    afresh) must launch with the same arguments apart from its own switch, on GPU settings."""
    from quantmla_core.backends.triton import attention as A
    from quantmla_core.testing import stub_triton_launcher

    launches = stub_triton_launcher(monkeypatch)
    fmt = PackFormat.parse(name)
    cache = qm.MLACache.allocate(fmt, 64, 4, 4, 128, device="cpu")
    q, r = torch.randn((4, 1, 16, 512)).to(torch.bfloat16), torch.randn((4, 1, 16, 64)).to(torch.bfloat16)
    args = (q, r, cache, torch.arange(64, dtype=torch.int32).view(4, 16), torch.full((4,), 1000), torch.arange(4), 0.05)
    A.attention(*args, variant=variant)
    A.attention(*args, variant=variant)  # from the caches
    A.attention(*args, variant=variant, overrides={"skip_pv": True})  # built afresh
    splits = [rec for rec in launches if rec[0].startswith("split_kernel")]
    assert len(splits) == 3 and splits[0][0] == {"v1": "split_kernel", "v2": "split_kernel_v2", "v3": "split_kernel_v3"}[variant]
    fresh = dict(splits[2][3])
    assert fresh.pop("PROBE_SKIP_PV") is True and splits[0][3]["PROBE_SKIP_PV"] is False
    assert splits[0][3] == splits[1][3] and {k: v for k, v in splits[0][3].items() if k != "PROBE_SKIP_PV"} == fresh
    assert splits[0][1] == splits[2][1]
    kw = splits[0][3]
    assert kw["DC"] == 512 and kw["PAGE_BYTES"] == fmt.page_bytes and kw["Q_BF16"] and kw["DOT_BF16"]
    assert kw["C_CODES_OFF"] == fmt.sections.get("content_codes", (0, 0))[0]


@pytest.mark.parametrize("case", FMT_CASES[::3], ids=str)
def test_triton_write_triton_read(case):
    check_attention_case(case, "triton", "triton", DEVICE)


@pytest.mark.parametrize("case", FMT_CASES[1::4], ids=str)
def test_triton_write_torch_read(case):
    check_attention_case(case, "triton", "torch", DEVICE)


@pytest.mark.parametrize("case", [c for c in FMT_CASES if c.fmt.latent_dim == 512][::2], ids=str)
def test_bf16_inputs(case, variant):
    if variant != "v1" and not GPU:
        pytest.skip(f"interpreter: {variant} takes bfloat16 queries in test_{variant}_attention_matches_reference")
    check_attention_case(case, "torch", "triton", DEVICE, "bfloat16")


@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4", "BF16"])
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_split_counts_and_causal_sq(fmt_name, splits, variant):
    """Forced split counts (some splits empty), S_q > 1 with and without protection."""
    fmt = PackFormat.parse(fmt_name)
    for case in (Case(fmt, (300, 77, 5), heads=2, s_q=3, seed=splits), Case(fmt, (200, 9), heads=3, s_q=5, sink=0, local=0, seed=7 + splits)):
        _attend_direct(case, num_splits=splits)


@pytest.mark.parametrize("fmt_name, splits, sink, local", [("C4R4", 20, 4, 100), ("C2R4", 17, 0, 70), ("BF16", 5, 3, 0)])
def test_merge_over_many_splits_and_protected_tiles(fmt_name, splits, sink, local):
    """More partials than the merge reads a load (splits > MERGE_SPLITS_A_LOAD), several protected tiles (local 100:
    7 tiles of 16 tokens, in one program for 3 requests x 2 row blocks and in two for 2 requests x 1 on the
    interpreter's 4 SMs) or only the sink, 17 query rows (a partial row block), causal S_q > 1, channels in blocks."""
    from quantmla_core.backends.triton.heuristics import MERGE_SPLITS_A_LOAD

    assert splits > MERGE_SPLITS_A_LOAD or fmt_name == "BF16"
    fmt = PackFormat.parse(fmt_name, latent_dim=256, rope_dim=32)
    _attend_direct(Case(fmt, (2200, 130, 3), heads=17, s_q=1, sink=sink, local=local, seed=splits), num_splits=splits)
    _attend_direct(Case(fmt, (260, 40), heads=3, s_q=4, sink=sink, local=local, seed=splits + 1), num_splits=splits)


def test_merge_reads_poisoned_scratch_safely(monkeypatch):
    """The partials' scratch filled with NaN before every call (torch.empty may hold anything): every slot the merge
    reads is written first (an empty split stores zeros and lse -inf), so the result still matches the reference.
    Forced splits leave some splits empty; S_q 3 masks some rows' tiles."""
    from quantmla_core.backends.triton import attention as A

    real = A.carve

    def poisoned(specs, device):
        return [t.fill_(float("nan")) if t.is_floating_point() else t for t in real(specs, device)]

    monkeypatch.setattr(A, "carve", poisoned)
    fmt = PackFormat.parse("C4R4", latent_dim=256, rope_dim=32)
    _attend_direct(Case(fmt, (300, 5, 70), heads=3, s_q=3, sink=4, local=20, seed=44), num_splits=9)


def _merge_direct(o_part, lse_part, o_prot, lse_prot, channel_order: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_kernel`` over float32 partials ``[B, NS, R, DC]`` / ``[B, NS, R]`` and protected ones (bfloat16 out)."""
    from quantmla_core.backends.triton.attention_kernel import merge_kernel
    from quantmla_core.backends.triton.heuristics import MERGE_BLOCK_C, MERGE_BLOCK_R, merge_load_width

    b, ns, r, dc = o_part.shape
    npt = o_prot.shape[1]
    out = torch.full((b, r, dc), float("nan"), dtype=torch.bfloat16, device=o_part.device)
    lse = torch.full((b, r), float("nan"), device=o_part.device)
    merge_kernel[(b, -(-r // MERGE_BLOCK_R), dc // MERGE_BLOCK_C)](
        o_part, lse_part, o_prot, lse_prot, out, lse, r, ns, npt, Q_BF16=True, DC=dc, BLOCK_R=MERGE_BLOCK_R,
        BLOCK_C=MERGE_BLOCK_C, SC=merge_load_width(ns), SCP=merge_load_width(npt), CHANNEL_ORDER=channel_order)
    return out, lse


def test_merge_channel_order():
    """``CHANNEL_ORDER`` (kernel v4 over packed pages): split partials whose column j holds channel channel_of(j)
    (bits 0 and 1 of j swapped), protected partials in plain order, merged into the plain-order output bit for bit
    as the same partials in plain order without it. The control (the permuted partials read as plain) must differ."""
    g = torch.Generator().manual_seed(57)
    b, ns, npt, r, dc = 2, 3, 2, 19, 64
    o_part, o_prot = (torch.randn(b, n, r, dc, generator=g).to(DEVICE) for n in (ns, npt))
    lse_part, lse_prot = (4 * torch.randn(b, n, r, generator=g).to(DEVICE) for n in (ns, npt))
    j = np.arange(dc)
    channel_of = torch.from_numpy((j & -4) | ((j & 1) << 1) | ((j >> 1) & 1)).to(DEVICE)
    assert sorted(channel_of[:4].tolist()) == [0, 1, 2, 3] and channel_of[:4].tolist() == [0, 2, 1, 3]
    permuted = o_part[..., channel_of].contiguous()
    want_out, want_lse = _merge_direct(o_part, lse_part, o_prot, lse_prot, False)
    got_out, got_lse = _merge_direct(permuted, lse_part, o_prot, lse_prot, True)
    assert not torch.isnan(want_out.float()).any()
    assert torch.equal(got_out, want_out) and torch.equal(got_lse, want_lse)
    control, _ = _merge_direct(permuted, lse_part, o_prot, lse_prot, False)
    assert not torch.equal(control, want_out)


def test_merge_load_width():
    from quantmla_core.backends.triton.heuristics import MERGE_SPLITS_A_LOAD, merge_load_width

    assert [merge_load_width(n) for n in (0, 1, 2, 3, 5, 8, 9, 16, 17, 64)] == [2, 2, 2, 4, 8, 8, 16, 16, 16, 16]
    assert MERGE_SPLITS_A_LOAD == 16


def test_protect_parts_rule():
    """Protected tiles spread over the parts that take the fewest tile-times (waves x tiles a part, fewer parts on a
    tie), one part (one partial) where the requests and row blocks fill the GPU alone, never an empty part."""
    from quantmla_core.backends.triton.heuristics import protect_parts

    assert protect_parts(9, 8, 132) == (9, 1)  # H16 B8: a tile a program
    assert protect_parts(9, 32, 132) == (3, 3)  # H16 B32: one wave of 3 tiles, not two waves of 2 (5 parts)
    assert protect_parts(9, 64, 132) == (2, 5)  # H128 B8: one wave of 5 tiles, not two waves of 3 (3 parts)
    assert protect_parts(9, 128, 132) == (1, 9)  # H16 B128: 3 parts would take three waves of 3 tiles, a tie
    assert protect_parts(9, 131, 132) == (1, 9)
    assert protect_parts(9, 132, 132) == (1, 9)
    assert protect_parts(9, 256, 132) == (1, 9)  # H128 B32 (8 row blocks): the requests fill the GPU
    assert protect_parts(5, 1, 4) == (3, 2)  # four parts would leave one empty
    assert protect_parts(0, 8, 132) == (0, 0)  # no sink or local tokens: no launch
    for tiles in range(1, 12):
        for programs in (1, 3, 50, 500):
            parts, per = protect_parts(tiles, programs, 132)
            assert (parts - 1) * per < tiles <= parts * per
            waves = -(-programs * parts // 132)
            for other in range(1, tiles + 1):  # no split takes fewer tile-times
                o_per = -(-tiles // other)
                assert waves * per <= -(-programs * -(-tiles // o_per) // 132) * o_per or programs >= 132


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", [
    Case(PackFormat.parse("C4R4"), (70, 9), heads=2, seed=31),
    Case(PackFormat.parse("C2R4", latent_dim=256, rope_dim=32), (40, 3), heads=2, local=8, seed=32),
    Case(PackFormat.parse("C8R8", group_size=128), (20,), heads=2, seed=33),
], ids=str)
def test_writer_one_token_per_program(case, dtype, monkeypatch):
    """The GPU's launch shape (one token per program: scalar slot, seq id, position and length
    loads) against the reference, also in the interpreter."""
    from quantmla_core.backends.triton import writer as twriter

    monkeypatch.setattr(twriter, "WRITER_BLOCK_T_INTERPRETER", 1)
    monkeypatch.setattr(twriter, "WRITER_BLOCK_T", 1)
    check_writer(case, "triton", DEVICE, dtype)


@pytest.mark.parametrize("block_t", [1, None])
def test_bad_slots_are_skipped(block_t):
    """Slots -1 and out of range write nothing; the rest of the cache keeps its poison."""
    fmt = PackFormat.parse("C4R4")
    case = Case(fmt, (70,))
    batch = build(case)
    args = batch.to(DEVICE)
    slots = args["slot_mapping"].clone()
    slots[::3] = -1
    slots[1::7] = batch.num_pages * fmt.page_size + 5  # beyond the cache: masked in the kernel
    cache = allocate(case, batch, DEVICE)
    from quantmla_core.backends.triton.writer import write as triton_write

    triton_write(cache, args["latent"], args["k_rope"], slots, args["seq_ids"], args["positions"], args["seq_lens"], block_t)
    want = allocate(case, batch, "cpu")
    keep = slots.cpu().numpy()
    keep = np.where(keep >= batch.num_pages * fmt.page_size, -1, keep)
    ref.write(want, batch.latent, batch.k_rope, keep, batch.seq_ids, batch.positions, batch.seq_lens)
    assert torch.equal(cache.pages.cpu(), want.pages)


def test_output_shapes_3d_query():
    fmt = PackFormat.parse("C2R4")
    case = Case(fmt, (65, 3), heads=5)
    batch, args, cache = write_case(case, DEVICE, backend="triton")
    out, lse = qm.attention(args["q_latent"][:, 0], args["q_rope"][:, 0], cache, block_table=args["block_table"],
                            seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
                            softmax_scale=batch.softmax_scale, backend="triton")
    assert out.shape == (2, 5, 512) and lse.shape == (2, 5) and out.dtype == torch.float32


# ---------------------------------------------------------------- real shapes (GPU only)
REAL = [
    Case(PackFormat.parse(name), lens, heads=h, s_q=s_q, sink=4, local=128, seed=5000 + i)
    for i, (name, lens, h, s_q) in enumerate(
        [(n, (4099, 5, 700, 8192), h, s) for n in FORMATS for h in (16, 128) for s in (1, 4)]
    )
]


@pytest.mark.skipif(not GPU, reason="real shapes need a GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("case", REAL, ids=str)
def test_real_shapes_gpu(case, dtype, variant):
    check_attention_case(case, "triton", "triton", "cuda", dtype)


@pytest.mark.parametrize("variant,extra", [("v2", []), ("v3", ["block_r=64"])])
def test_compiles_to_wgmma_for_sm90_offline(variant, extra):
    """Kernels v2 and v3 compile for sm_90a without a GPU (Triton's bundled ptxas; in a subprocess, as
    ``TRITON_INTERPRET=1`` turns kernels into interpreted functions) with every product a wgmma
    and no mma.sync. Registers / spill bytes go to the log (the H200 run reports its own)."""
    import ast
    import os
    import subprocess
    import sys

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    import tempfile

    # run outside the checkout (and with -P if we were) so the installed package is the one imported
    cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", "quantmla_core.backends.triton.sm90_report",
           variant, "C4R4", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tempfile.gettempdir())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout + r.stderr
    rep = ast.literal_eval(lines[-1])
    print(rep)
    assert "err" not in rep, rep
    assert rep["wgmma"] > 0 and rep["mma_sync"] == 0
    assert 0 < rep["regs"] <= 255


@pytest.mark.parametrize("block_r", [32, 64])
@pytest.mark.parametrize("variant", ["v2", "v3"])
def test_wider_protected_row_blocks(block_r, variant):
    """The probe's ``protect_block_r`` override (H = 128 reads the sink and ring once per 16-row block by default):
    the protected-tile kernel over 32 or 64 query rows a program, several parts, rows not a multiple of the block."""
    case = Case(PackFormat.parse("C4R4"), (90, 40), heads=36, sink=4, local=40, seed=91)
    from quantmla_core.backends.triton.attention import LAST_LAUNCH

    _attend_direct(case, "bfloat16" if GPU else "float32", variant=variant, overrides={"protect_block_r": block_r},
                   num_splits=2)
    assert LAST_LAUNCH["plan"].protect_block_r == block_r


def _sm90_report(*args: str) -> dict:
    """``sm90_report``'s line for one kernel build (in a subprocess without ``TRITON_INTERPRET``, outside the
    checkout so the installed package is the one imported)."""
    import ast
    import os
    import subprocess
    import sys
    import tempfile

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, *(["-P"] if sys.flags.safe_path else []), "-m", "quantmla_core.backends.triton.sm90_report",
           *args]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=tempfile.gettempdir())
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    assert lines, r.stdout + r.stderr
    rep = ast.literal_eval(lines[-1])
    assert "err" not in rep, rep
    return rep


@pytest.mark.parametrize("fmt_name", ["C4R4", "C2R4"])
def test_v3_code_words_shorten_the_tile_loop_offline(fmt_name):
    """Offline sm_90a SASS of kernel v3's tile loop: codes from words taken apart in PTX issue fewer instructions a
    thread than portable words, and those fewer than bytes (triton 3.7.1, C4R4: 2,848 / 3,662 / 4,003; C2R4: 2,915 /
    3,695 / 3,946)."""
    import os

    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    base = ["v3", fmt_name, "block_r=64", "word_codes=true"]
    ptx, portable, raw = (_sm90_report(*base, *extra)["sass_in_loops"]
                          for extra in ([], ["ptx_split=false"], ["word_codes=false"]))
    print(fmt_name, {"ptx": ptx, "portable words": portable, "bytes": raw})
    assert ptx < 0.9 * portable and portable < raw and ptx < 0.8 * raw


def _written_on_gpu(case: Case) -> tuple:
    """``case``'s bfloat16 tensors on the GPU (``args``), its cache written by the torch backend, and a function that
    prepares a Triton call of its queries over that cache (reading the environment when called)."""
    from quantmla_core.backends.triton import attention as A

    batch, args, cache = write_case(case, "cuda", "bfloat16")

    def prepare():
        return A.prepare(cache, args["block_table"], args["attn_seq_lens"], args["attn_seq_ids"], len(case.lens), 1,
                         case.heads, torch.bfloat16, batch.softmax_scale)

    return args, cache, prepare


def _assert_graph_matches(run, want: tuple, eager: tuple, replays: int) -> None:
    """Capture ``run()`` (out, lse) in a CUDA graph and replay it ``replays`` times, its output NaN-poisoned before
    each; after each, the replay's and the ``eager`` call's outputs equal ``want`` bit for bit."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for _ in range(replays):
        captured[0].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for got in (eager, captured):
            assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])


@pytest.mark.skipif(not GPU, reason="CUDA streams and graphs need a CUDA GPU")
@pytest.mark.parametrize("heads", [16, 128])
def test_protected_tiles_on_a_side_stream_are_bit_identical(heads, monkeypatch):
    """``QUANTMLA_TRITON_PROTECTED_STREAM=1``: the protected-tile kernel on a second stream (eager, and forked inside a
    captured CUDA graph) gives the one-stream call's outputs bit for bit."""
    from quantmla_core.backends.triton import attention as A

    case = Case(PackFormat.parse("C4R4"), (700, 2100, 90), heads=heads, sink=4, local=128, seed=93)
    args, cache, prepare = _written_on_gpu(case)
    call = prepare()
    q, r = args["q_latent"], args["q_rope"]
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "0")
    one = call.run(q, r, cache)
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "1")
    side = call.run(q, r, cache)
    call.run(q, r, cache)  # a warm-up outside the capture
    _assert_graph_matches(lambda: call.run(q, r, cache), one, side, replays=1)
    check_attention_case(case, "torch", "triton", "cuda", "bfloat16")


@pytest.mark.skipif(not GPU, reason="programmatic dependent launch needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["1", "2"])
@pytest.mark.parametrize("heads,sink,local", [(16, 4, 128), (128, 4, 128), (16, 0, 0)])
def test_launches_with_pdl_are_bit_identical(heads, sink, local, mode, monkeypatch):
    """``QUANTMLA_TRITON_PDL`` 1 (the merge) and 2 (also the protected tiles, after the split kernel): kernels launched
    with programmatic dependent launch, which wait on the GPU for their predecessors, give the plain launches' outputs
    bit for bit, eager and replayed ten times from a CUDA graph, and match the reference."""
    from quantmla_core.backends.triton import attention as A

    why = A.pdl_unsupported(torch.device("cuda"))
    if why:
        pytest.skip(why)
    case = Case(PackFormat.parse("C4R4"), (700, 2100, 90, 4099), heads=heads, sink=sink, local=local, seed=94)
    args, cache, prepare = _written_on_gpu(case)
    calls = {}
    for env in ("0", mode):
        monkeypatch.setenv(A.PDL_ENV, env)
        calls[env] = prepare()
    assert (calls["0"].pdl, calls[mode].pdl) == (0, int(mode))
    q, r = args["q_latent"], args["q_rope"]
    plain = calls["0"].run(q, r, cache)
    eager = calls[mode].run(q, r, cache)
    _assert_graph_matches(lambda: calls[mode].run(q, r, cache), plain, eager, replays=10)
    check_attention_case(case, "torch", "triton", "cuda", "bfloat16")


@pytest.mark.skipif(not GPU, reason="the default plan of many requests needs a GPU's SM count")
def test_v3_defaults_at_many_requests(monkeypatch):
    """Kernel v3's defaults where B x H/16 protected programs would fill the SMs: 64 query rows a protected-tile
    program (``heuristics.v3_protect_rows``) and, on Hopper, PDL mode 2 (the protected tiles after the split kernel),
    against the reference."""
    from quantmla_core.backends.triton import attention as A

    monkeypatch.delenv(A.PDL_ENV, raising=False)
    monkeypatch.delenv(A.PROTECT_ROWS_ENV, raising=False)
    monkeypatch.setenv(A.VARIANT_ENV, "v3")  # auto runs v4 on Hopper (PDL mode 1)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = -(-sms // 8)  # B x 128 / 16 >= the SM count
    lens = tuple(150 + 37 * i for i in range(batch))
    case = Case(PackFormat.parse("C4R4"), lens, heads=128, sink=4, local=128, seed=95)
    check_attention_case(case, "torch", "triton", "cuda", "bfloat16")
    assert A.LAST_LAUNCH["variant"] == "v3" and A.LAST_LAUNCH["plan"].protect_block_r == 64
    assert A.LAST_LAUNCH["pdl"] == (0 if A.pdl_unsupported(torch.device("cuda")) else 2)
