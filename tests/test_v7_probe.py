"""benchmarks/v7_probe: the probe kernel builds for sm_90a without spills (CPU, with nvcc), and its float64 reference
(the check the GPU run prints) is a real attention over the dequantized keys."""
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
