"""benchmarks/v7_probe: the probe kernel builds for sm_90a without spills (CPU, with nvcc), its tile loop keeps PV's
operand in registers, a NumPy model of its fragments reproduces Q K^T and P V, and its float64 reference (the check
the GPU run prints) is a real attention over the dequantized keys."""
import os
import subprocess
import tempfile

import numpy as np
import pytest

from benchmarks.v7_probe import SOURCE, TEAMS, TILE, dequantized_keys, layout_bytes, make_inputs, reference_team
from quantmla_core.backends.cupy import KERNEL_DIR
from quantmla_core.backends.cupy.sass_report import find_tool, missing_tools

NVCC = find_tool("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
def test_probe_builds_for_sm90a_without_spills():
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-cubin", "-arch=sm_90a", "--std=c++17", "-Xptxas", "-v", f"-I{KERNEL_DIR}",
               "-o", os.path.join(tmp, "k.cubin"), str(SOURCE)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 bytes spill stores" in r.stderr, r.stderr[-2000:]


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_tile_loop_keeps_pv_in_registers():
    """A warp's 32-token tile: 4 x 9 QK and 2 x 16 PV mma.sync, PV's 64 B registers transposed by movmatrix, and
    no shared-memory traffic but the partial scores (4 stores, 12 loads of 16 bytes)."""
    from benchmarks.v7_probe import tile_loop_histogram

    hist = tile_loop_histogram()
    assert hist.get("HMMA") == 4 * 9 + 2 * 16
    assert hist.get("MOVM") == 2 * 16 * 2
    assert hist.get("STS", 0) == 4 and hist.get("LDS", 0) == 12
    assert not any(op.startswith(("STSM", "LDSM", "HGMMA")) for op in hist)


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
@pytest.mark.parametrize("skip", [1, 2])
def test_stage_skip_builds_leave_out_their_stage(skip: int):
    """Build 1 has QK's 36 mma.sync and no PV (no movmatrix); build 2 keeps both matmuls but no shared memory and no
    barrier."""
    from benchmarks.v7_probe import tile_loop_histogram

    hist = tile_loop_histogram(skip)
    assert hist.get("HMMA") == (4 * 9 if skip == 1 else 4 * 9 + 2 * 16)
    assert hist.get("MOVM", 0) == (0 if skip == 1 else 2 * 16 * 2)
    assert (hist.get("STS", 0), hist.get("LDS", 0), hist.get("BAR", 0)) == ((4, 12, 1) if skip == 1 else (0, 0, 0))


@pytest.mark.parametrize("kw, message", [({"skip": 3, "check": 0}, "--skip must be one of"),
                                         ({"skip": 1, "check": 2}, "its output is wrong"),
                                         ({"skip": 0, "check": 0, "tpc": 96}, "--tpc must be a multiple of 64")])
def test_run_rejects_bad_options_before_touching_a_gpu(kw: dict, message: str):
    from benchmarks.v7_probe import run

    with pytest.raises(ValueError, match=message):
        run(ctas=1, tpc=kw.pop("tpc", 64), iters=1, **kw)


def _f32(bits) -> float:
    return float((np.array([bits], dtype=np.uint32) << 16).view(np.float32)[0])


def test_dequantized_keys_follow_the_nibble_order_and_groups():
    inp = make_inputs(np.random.default_rng(1), 4)
    k = dequantized_keys(inp, 1, 3)
    code = int(inp["cc"][2, 70] >> 4)  # channel 141: the high nibble of byte 70, group 2
    assert k[1, 141] == pytest.approx(_f32(inp["csc"][2, 2]) * (code - int(inp["cze"][2, 2])), rel=2 ** -8)
    r_code = int(inp["rc"][1, 5] & 15)  # RoPE channel 10: the low nibble of RoPE byte 5
    assert k[0, 512 + 10] == pytest.approx(_f32(inp["rsc"][1]) * (r_code - int(inp["rze"][1])), rel=2 ** -8)


def test_reference_team_is_softmax_attention_over_its_tiles():
    tpc = TILE * TEAMS * 2
    inp = make_inputs(np.random.default_rng(2), tpc)
    out, lse2 = reference_team(inp, 0, 1, tpc, 0.1)
    k = dequantized_keys(inp, 0, tpc)[[t for i in (1, 3) for t in range(TILE * i, TILE * (i + 1))]]
    q = (inp["q"].astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    s = q @ k.T * 0.1
    p = np.exp(s - s.max(axis=1, keepdims=True))
    np.testing.assert_allclose(out, p @ k[:, :512] / p.sum(axis=1, keepdims=True), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse2 / np.log2(np.e), np.log(np.exp(s).sum(axis=1)), rtol=1e-12)
    assert layout_bytes(tpc) == tpc * (256 + 32 + 8 * 3 + 3)


# ------------------------------------------------------------------ a NumPy model of the probe's fragments
# Ports of v7_probe.cu's channel map and of its register pairing (the bit operations on the packed bytes), run through
# mma.sync m16n8k16's and movmatrix's fragment layouts: QK must give Q K^T and PV (through the transpose) P V.

def _channel(w: int, ks: int, kk: int) -> int:  # v7_channel
    q, el, hi = (kk & 7) >> 1, kk & 1, kk >> 3
    if ks < 8:
        r = 2 * (ks & 1) + hi
        return 128 * w + 32 * q + 8 * (ks >> 1) + (r & 1) * 4 + (r >> 1) + 2 * el
    return 512 + 16 * w + 4 * q + hi + 2 * el


def _code2(x: int, hi: int) -> tuple[int, int]:  # qmla_code2<HI>: bytes 0, 1 or 2, 3 of x
    return (x >> (16 * hi)) & 0xFF, (x >> (16 * hi + 8)) & 0xFF


def _lane_b(content: np.ndarray, rope: np.ndarray, w: int, q: int) -> list[list[tuple[int, int]]]:
    """b[ks][r] (code pairs) of lane quad q of warp w for one token (v7_dequantize's bit operations)."""
    b = [[None, None] for _ in range(9)]
    raw = content[64 * w + 16 * q: 64 * w + 16 * q + 16]
    for e in range(4):
        word = int.from_bytes(bytes(raw[4 * e: 4 * e + 4]), "little")
        lo, hi = word & 0x0F0F0F0F, (word >> 4) & 0x0F0F0F0F
        b[2 * e] = [_code2(lo, 0), _code2(lo, 1)]
        b[2 * e + 1] = [_code2(hi, 0), _code2(hi, 1)]
    r16 = int.from_bytes(bytes(rope[8 * w + 2 * q: 8 * w + 2 * q + 2]), "little")
    b[8] = [_code2(r16 & 0x0F0F, 0), _code2((r16 >> 4) & 0x0F0F, 0)]
    return b


def _mma(a_frags, b_frags) -> np.ndarray:
    """m16n8k16 from per-lane fragments: a[lane] = 4 pairs, b[lane] = 2 pairs; returns C[lane][4]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, q = lane >> 2, lane & 3
        for i, (row, col) in enumerate([(g, 2 * q), (g + 8, 2 * q), (g, 2 * q + 8), (g + 8, 2 * q + 8)]):
            A[row, col: col + 2] = a_frags[lane][i]
        for i in range(2):
            B[2 * q + 8 * i: 2 * q + 8 * i + 2, g] = b_frags[lane][i]
    D = A @ B
    return np.array([[D[g, 2 * q], D[g, 2 * q + 1], D[g + 8, 2 * q], D[g + 8, 2 * q + 1]]
                     for g, q in ((lane >> 2, lane & 3) for lane in range(32))])


def _movmatrix(pairs) -> list[tuple[float, float]]:
    M = np.zeros((8, 8))
    for lane in range(32):
        M[lane >> 2, 2 * (lane & 3): 2 * (lane & 3) + 2] = pairs[lane]
    return [(M[2 * (lane & 3), lane >> 2], M[2 * (lane & 3) + 1, lane >> 2]) for lane in range(32)]


def test_fragment_model_reproduces_qk_and_pv():
    rng = np.random.default_rng(3)
    content = rng.integers(0, 256, (32, 256), dtype=np.uint8)
    rope = rng.integers(0, 256, (32, 32), dtype=np.uint8)
    keys = np.concatenate([np.stack([content & 15, content >> 4], -1).reshape(32, 512),
                           np.stack([rope & 15, rope >> 4], -1).reshape(32, 64)], axis=1).astype(np.float64)
    qry = rng.standard_normal((16, 576))
    p = rng.standard_normal((16, 32))
    s_total = np.zeros((16, 32))
    out = np.full((16, 512), np.nan)
    for w in range(4):
        b = [[_lane_b(content[8 * j + (lane >> 2)], rope[8 * j + (lane >> 2)], w, lane & 3) for lane in range(32)]
             for j in range(4)]  # b[j][lane][ks][r]
        qa = [[[(qry[row, _channel(w, ks, kk)], qry[row, _channel(w, ks, kk + 1)])
                for row, kk in [(lane >> 2, 2 * (lane & 3)), ((lane >> 2) + 8, 2 * (lane & 3)),
                                (lane >> 2, 2 * (lane & 3) + 8), ((lane >> 2) + 8, 2 * (lane & 3) + 8)]]
               for lane in range(32)] for ks in range(9)]
        for j in range(4):
            c = sum(_mma(qa[ks], [b[j][lane][ks] for lane in range(32)]) for ks in range(9))
            for lane in range(32):
                g, q = lane >> 2, lane & 3
                s_total[[g, g, g + 8, g + 8], [8 * j + 2 * q, 8 * j + 2 * q + 1] * 2] += c[lane]
        for kk in range(2):  # PV k-step: blocks 2 kk, 2 kk + 1
            pa = [[(p[r, 16 * kk + 8 * blk + 2 * (lane & 3)], p[r, 16 * kk + 8 * blk + 2 * (lane & 3) + 1])
                   for blk, r in [(0, lane >> 2), (0, (lane >> 2) + 8), (1, lane >> 2), (1, (lane >> 2) + 8)]]
                  for lane in range(32)]
            for ks in range(8):
                for r in range(2):
                    t0 = _movmatrix([b[2 * kk][lane][ks][r] for lane in range(32)])
                    t1 = _movmatrix([b[2 * kk + 1][lane][ks][r] for lane in range(32)])
                    c = _mma(pa, [(t0[lane], t1[lane]) for lane in range(32)])
                    for lane in range(32):
                        g, q = lane >> 2, lane & 3
                        for e in range(2):
                            ch = _channel(w, ks, 2 * q + e + 8 * r)
                            out[g, ch] = (0 if kk == 0 else out[g, ch]) + c[lane][e]
                            out[g + 8, ch] = (0 if kk == 0 else out[g + 8, ch]) + c[lane][2 + e]
    np.testing.assert_allclose(s_total, qry @ keys.T, rtol=1e-12, atol=1e-9)
    np.testing.assert_allclose(out, p @ keys[:, :512], rtol=1e-12, atol=1e-9)
