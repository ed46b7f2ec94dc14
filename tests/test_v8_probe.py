"""benchmarks/v8_probe: its channel maps agree with the CUDA source, a NumPy emulation of its QK (the lanes' code
pairs, the mma.sync fragments, the per-group scales and the zero-point MMAs) matches float64, its options are checked
before CuPy is imported, and its tile loop holds the instructions the design counts on."""
import re

import numpy as np
import pytest

from benchmarks.v7_probe import _bf16_to_f64, make_inputs
from benchmarks.v8_probe import (DC, HMMA_PER_TILE, KSTEPS, NGC, SOURCE, exact_keys, kslot_channel, kstep_group,
                                 query_fragments, run, tile_loop_histogram)
from quantmla_core.backends.cupy.sass_report import missing_tools


def _cuda_channel():
    """v8_probe.cu's v8_channel(c, i), evaluated as written (its body is a C integer expression Python reads alike)."""
    body = re.search(r"int v8_channel\(int c, int i\) \{\s*return (.*?);\s*\}", SOURCE.read_text(), re.S).group(1)
    return lambda c, i: eval(body, {}, {"c": c, "i": i})


def test_each_group_is_covered_once_by_its_ksteps():
    for grp in range(NGC + 1):
        got = sorted(kslot_channel(ks, k) for ks in range(KSTEPS) if kstep_group(ks) == grp for k in range(16))
        assert got == list(range(64 * grp, 64 * grp + 64))


def test_key_tile_chunks_hold_what_stmatrix_stores():
    """QK's A fragment of content k-step (gp, half, e) is stored as 4 matrices; matrix column i of k-slot block kb
    lands in chunk 32 half + 8 gp + 2 e + kb: the channel there must be the k-slot's."""
    channel = _cuda_channel()
    seen = set()
    for ks in range(32):
        gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
        for kb in range(2):
            for i in range(8):
                chunk = 32 * half + 8 * gp + 2 * e + kb
                assert channel(chunk, i) == kslot_channel(ks, 8 * kb + i)
                seen.add(channel(chunk, i))
    assert seen == set(range(DC))  # the 512 positions hold the 512 channels


def _pair(x: np.ndarray, sh: int) -> tuple[np.ndarray, np.ndarray]:
    """v8_pair: the bf16 values (128 + nibble) at bits sh and sh + 16 of x."""
    y = ((x >> sh) & 0x000F000F) | 0x43004300
    return _bf16_to_f64((y & 0xFFFF).astype(np.uint16)), _bf16_to_f64((y >> 16).astype(np.uint16))


def _words(rows: np.ndarray, offset: np.ndarray) -> np.ndarray:
    """The little-endian 32-bit word at byte offset[q] of each row: [rows, 4 lanes]."""
    b = np.stack([rows[:, offset + k] for k in range(4)], axis=-1).astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _b_matrix(frag: np.ndarray) -> np.ndarray:
    """[16 slots, 16 heads] float64 of one k-step's B fragments ([32 lanes, 4] uint32: nb 0 b0, b1, nb 1 b0, b1)."""
    b = np.zeros((16, 16))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for nb in range(2):
            for reg, slot in ((2 * nb, 2 * q), (2 * nb + 1, 2 * q + 8)):
                word = np.array([frag[lane, reg]], np.uint32)
                b[slot, g + 8 * nb] = _bf16_to_f64((word & 0xFFFF).astype(np.uint16))[0]
                b[slot + 1, g + 8 * nb] = _bf16_to_f64((word >> 16).astype(np.uint16))[0]
    return b


def _bf16_round(x: np.ndarray) -> np.ndarray:
    from benchmarks.v8_probe import _bf16_bits

    return _bf16_to_f64(_bf16_bits(x))


def test_emulated_qk_matches_float64():
    """The kernel's QK for 16 tokens, emulated: A from the lanes' code pairs (rows = tokens), B from
    query_fragments, one accumulator a group times the token's scale, started at W Z (zero points and the 128)."""
    inp = make_inputs(np.random.default_rng(3), 16)
    frags = query_fragments(inp["q"])
    q = np.arange(4)
    cc, rc = inp["cc"], inp["rc"]
    acc = np.zeros((NGC + 1, 16, 16))
    for ks in range(KSTEPS):
        if ks < 32:
            gp, half, e = ks // 8, (ks // 4) % 2, ks % 4
            x = _words(cc, 64 * gp + 16 * q + 4 * e)
        else:
            half, e = (ks - 32) >> 1, (ks - 32) & 1
            x = _words(rc, 8 * q + 4 * e)
        a = np.zeros((16, 16))
        lo0, hi0 = _pair(x, 4 if half else 0)
        lo1, hi1 = _pair(x, 12 if half else 8)
        a[:, 2 * q], a[:, 2 * q + 1], a[:, 2 * q + 8], a[:, 2 * q + 9] = lo0, hi0, lo1, hi1
        acc[kstep_group(ks)] += a @ _b_matrix(frags[ks])
    scales = np.concatenate([_bf16_to_f64(inp["csc"]), _bf16_to_f64(inp["rsc"])[:, None]], axis=1)  # [16, 9]
    zeros = np.concatenate([inp["cze"], inp["rze"][:, None]], axis=1).astype(np.float64)
    w = scales * (128.0 + zeros)
    w_slots = np.zeros((16, 16))
    w_slots[:, :NGC + 1] = w
    wh = _bf16_round(w_slots)
    wl = _bf16_round(w_slots - wh)
    assert np.array_equal(wh + wl, w_slots)  # s (128 + z) has 16 significant bits: two bf16 parts hold it
    z = sum(_b_matrix(frags[KSTEPS + part]) for part in range(3))
    scores = (wh + wl) @ z + np.einsum("tg,gth->th", scales, acc)
    want = exact_keys(inp, 0, 16) @ _bf16_to_f64(inp["q"]).T
    assert np.abs(scores - want).max() < 1e-5 * np.abs(want).max()
    # the zero-point MMAs carry the 128 and the zero points: without them the scores are far off
    assert np.abs(np.einsum("tg,gth->th", scales, acc) - want).max() > 10 * np.abs(want).max()


@pytest.mark.parametrize("kwargs, match", [({"skip": 2}, "--skip must be one of"), ({"skip": 1}, "pass --check 0"),
                                           ({"tpc": 192}, "multiple of 128"), ({"tpc": 0}, "multiple of 128")])
def test_run_checks_its_options_before_cupy(kwargs, match):
    args = {"ctas": 1, "tpc": 128, "iters": 1, "check": 1, "skip": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        run(**args)


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
@pytest.mark.parametrize("skip", [0, 1])
def test_tile_loop_holds_the_designed_instructions(skip):
    hist = tile_loop_histogram(skip)
    assert hist["HMMA"] == HMMA_PER_TILE[skip]
    assert hist["STSM"] == 32 + NGC  # the key tile (one stmatrix a content k-step) and the P' tiles
    assert hist.get("HADD2", 0) == 0 and hist.get("HFMA2", 0) == 0  # no value is scaled or offset
    if skip:
        assert "LDSM" not in hist
    else:
        assert hist["LDSM"] == 4 * (2 + 8) + 2  # per k-step: P' of 2 groups, 8 key-tile pairs; 128 + z twice
        assert sum(hist.values()) < 1100  # stop 72's count (v5: 1,307 a warp and tile)
