"""benchmarks/wgmma_rates: every case's kernel builds for sm_90a (CPU, with nvcc), the layout guards reject the
builds they name, and the multiply-add accounting matches the shapes."""
import os
import subprocess
import tempfile

import pytest

from benchmarks.wgmma_rates import (CASES, PEAK_MAC_PER_CLK, PV_MACS, QK_STEPS8, SOURCE, SYNC_MMAS, SYNC_MMAS8,
                                    build_options, macs_per_iter)
from quantmla_core.backends.cupy import KERNEL_DIR
from quantmla_core.backends.cupy.sass_report import find_tool, missing_tools

NVCC = find_tool("nvcc")


def _build(mode: int, n: int, wgs: int, stores: int) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [NVCC, "-cubin", "-arch=sm_90a", "--std=c++17", f"-I{KERNEL_DIR}", *build_options(mode, n, wgs, stores),
               "-o", os.path.join(tmp, "k.cubin"), str(SOURCE)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "mode{}-n{}-wg{}-st{}".format(*c))
def test_case_builds_for_sm90a(case):
    r = _build(*case)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "C7514" not in r.stderr, "ptxas serialized the wgmma pipeline:\n" + r.stderr[-3000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc not found: CUDA sources cannot be compiled on this machine")
@pytest.mark.parametrize("case", [(1, 64, 1, 0), (2, 128, 1, 0), (0, 32, 1, 0), (0, 16, 1, 0), (3, 64, 1, 0),
                                  (3, 16, 5, 0), (4, 16, 1, 0), (4, 8, 1, 4), (5, 16, 1, 0),
                                  (5, 8, 1, 4), (6, 16, 1, 0), (6, 8, 1, 4), (7, 64, 1, 0), (7, 8, 1, 0),
                                  (7, 32, 4, 0), (7, 32, 1, 4), (8, 16, 1, 0), (8, 32, 5, 0), (8, 32, 1, 17),
                                  (9, 32, 1, 0)], ids=str)
def test_guards_reject_builds_outside_the_modes(case):
    r = _build(*case)
    assert r.returncode != 0
    assert "static assertion failed" in r.stderr or "static_assert" in r.stderr


def test_multiply_adds_per_iteration():
    assert macs_per_iter(0, 64) == 36 * 64 * 64 * 16
    assert macs_per_iter(0, 256) == 36 * 64 * 256 * 16  # per warpgroup
    assert macs_per_iter(1, 64) == 36 * 64 * 64 * 16 + 4 * 64 * 256 * 16
    assert PV_MACS == 4 * 64 * 256 * 16
    # v6's QK alone at the dense rate: 1,152 clocks, the number stop 33's timing probe was read against
    assert macs_per_iter(0, 64) / PEAK_MAC_PER_CLK == 1152
    # kernel v5's tile: 68 m64n16k16 (576 channels of QK, 512 x 64 tokens of PV, 16 rows)
    assert macs_per_iter(3, 16) == (576 * 64 + 512 * 64) * 16
    # mma.sync: a warpgroup's four warps, each a quarter of the same tile's multiply-adds
    assert macs_per_iter(4, 8) == macs_per_iter(3, 16)
    assert macs_per_iter(5, 8) == macs_per_iter(4, 8)  # the same mma.sync, fed from shared memory
    # 8-bit QK with the queries in two halves (32 columns) over the same quarter tile, then its PV
    assert macs_per_iter(6, 8) == (64 * 32 * 576 + 16 * 512 * 64)
    assert macs_per_iter(7, 32) == 64 * 32 * 576  # one 64-token tile's QK, both halves
    assert macs_per_iter(7, 16) == 64 * 16 * 576
    # the 8-bit design's tile: QK's two query halves over 576 channels, PV's 512 channels x 64 tokens at 16 rows
    assert macs_per_iter(8, 32) == 64 * 32 * 576 + 512 * 64 * 16


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_mode5_feeds_every_pair_of_mma_sync_from_one_ldmatrix():
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    sass, _ = compile_sass_source(SOURCE, {"WR_MODE": 5, "WR_N": 8, "WR_WGS": 1, "WR_STORES": 0})
    hist = loops(sass)[0].opcodes
    assert hist.get("HMMA") == SYNC_MMAS and hist.get("LDSM") == SYNC_MMAS // 2


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
@pytest.mark.parametrize("n", [16, 32])
def test_mode7_issues_whole_k32_integer_wgmmas(n):
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    sass, _ = compile_sass_source(SOURCE, {"WR_MODE": 7, "WR_N": n, "WR_WGS": 1, "WR_STORES": 0})
    assert f"IGMMA.64x{n}x32.U8.S8" in sass
    hist = loops(sass)[0].opcodes
    assert hist.get("IGMMA", 0) % QK_STEPS8 == 0 and hist.get("IGMMA", 0) > 0 and "HGMMA" not in hist


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_mode6_issues_only_integer_mma_sync():
    from quantmla_core.backends.cupy.sass_report import compile_sass_source, loops

    sass, _ = compile_sass_source(SOURCE, {"WR_MODE": 6, "WR_N": 8, "WR_WGS": 1, "WR_STORES": 0})
    assert "IMMA.16832.U8.S8" in sass
    hist = loops(sass)[0].opcodes
    assert hist.get("IMMA") == SYNC_MMAS8 and "HMMA" not in hist


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_mode8_issues_qk_and_pv_integer_wgmmas():
    from benchmarks.wgmma_rates import PV8_MMAS
    from quantmla_core.backends.cupy.sass_report import compile_sass_source

    sass, _ = compile_sass_source(SOURCE, {"WR_MODE": 8, "WR_N": 32, "WR_WGS": 2, "WR_STORES": 16})
    qk, pv = sass.count("IGMMA.64x32x32.U8.S8"), sass.count("IGMMA.64x16x32.U8.U8")
    assert qk > 0 and pv > 0 and qk * PV8_MMAS == pv * QK_STEPS8, (qk, pv)
    assert sass.count("STSM") * QK_STEPS8 == 16 * qk and "HGMMA" not in sass
