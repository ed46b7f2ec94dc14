"""benchmarks/v9_probe: its options are checked before CuPy is imported, its shared memory fits an SM, and its two
roles' tile loops hold what the design counts on (the scorers read no content k-step's query fragment from shared
memory; the summers run PV and nothing of QK). Its arithmetic and addresses are v8_parts.cuh's, which
tests/test_v8_probe.py emulates."""
import pytest

from benchmarks.v9_probe import QREGS, SOURCE, main, role_loop_histograms, run, smem_bytes
from quantmla_core.backends.cupy.sass_report import compile_sass_source, missing_tools


@pytest.mark.parametrize("kwargs, match", [({"skip": 2}, "--skip must be one of"), ({"skip": 1}, "pass --check 0"),
                                           ({"tpc": 96}, "multiple of 64"), ({"tpc": 0}, "multiple of 64"),
                                           ({"qregs": 0}, "--qregs must be between 1 and 32"),
                                           ({"qregs": 33}, "--qregs must be between 1 and 32")])
def test_run_checks_its_options_before_cupy(kwargs, match):
    args = {"ctas": 1, "tpc": 128, "iters": 1, "check": 1, "skip": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        run(**args)


def test_shared_memory_fits_an_sm():
    assert smem_bytes(32) == 7 * 512 + 2 * (65536 + 16384 + 1024 + 64) + 512
    assert smem_bytes(QREGS) == smem_bytes(32) + (32 - QREGS) * 512  # a k-step's fragments: 32 lanes x 16 bytes
    assert smem_bytes(1) <= 227 * 1024  # Hopper's largest dynamic shared memory a block


def test_main_refuses_a_bad_qregs_before_cupy():
    with pytest.raises(ValueError, match="--qregs must be between 1 and 32 .*got 40"):
        main(["--qregs", "40"])


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_default_scorers_do_not_spill():
    _, info = compile_sass_source(SOURCE, {"V9_SKIP": 0, "V9_QREGS": QREGS})
    assert "0 bytes spill stores, 0 bytes spill loads" in str(info)


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_roles_hold_the_designed_instructions():
    roles = role_loop_histograms(0)
    scorer, summer = roles["scorer"], roles["summer"]
    assert scorer["HMMA"] == 72 + 12 and scorer["STSM"] == 32 + 8  # QK and the zero points; key tile and P'
    # the content k-steps past QREGS, RoPE and zero-point fragments, maxima, factors
    assert scorer.get("LDS", 0) <= (32 - QREGS) + 4 + 3 + 20
    assert role_loop_histograms(0, 32)["scorer"]["LDS"] < scorer["LDS"]  # all 32 in registers: fewer loads
    assert "LDSM" not in scorer and "HADD2" not in scorer
    assert summer["HMMA"] == 64 + 8 and summer["LDSM"] == 4 * (2 + 8) + 2 and "STSM" not in summer
    skipped = role_loop_histograms(1)
    assert "HMMA" not in skipped["summer"] and skipped["scorer"]["HMMA"] == 84
