"""benchmarks/v9_probe: its options are checked before CuPy is imported, its shared memory fits an SM, and its two
roles' tile loops hold what the design counts on (the scorers read no content k-step's query fragment from shared
memory; the summers run PV and nothing of QK). Its arithmetic and addresses are v8_parts.cuh's, which
tests/test_v8_probe.py emulates."""
import pytest

from benchmarks.v9_probe import SMEM_BYTES, role_loop_histograms, run
from quantmla_core.backends.cupy.sass_report import missing_tools


@pytest.mark.parametrize("kwargs, match", [({"skip": 2}, "--skip must be one of"), ({"skip": 1}, "pass --check 0"),
                                           ({"tpc": 96}, "multiple of 64"), ({"tpc": 0}, "multiple of 64")])
def test_run_checks_its_options_before_cupy(kwargs, match):
    args = {"ctas": 1, "tpc": 128, "iters": 1, "check": 1, "skip": 0} | kwargs
    with pytest.raises(ValueError, match=match):
        run(**args)


def test_shared_memory_fits_an_sm():
    assert SMEM_BYTES == 7 * 512 + 2 * (65536 + 16384 + 1024 + 64) + 512
    assert SMEM_BYTES <= 227 * 1024  # Hopper's largest dynamic shared memory a block


@pytest.mark.skipif(bool(missing_tools()), reason=f"SASS tools missing: {missing_tools()}")
def test_roles_hold_the_designed_instructions():
    roles = role_loop_histograms(0)
    scorer, summer = roles["scorer"], roles["summer"]
    assert scorer["HMMA"] == 72 + 12 and scorer["STSM"] == 32 + 8  # QK and the zero points; key tile and P'
    assert scorer.get("LDS", 0) <= 4 + 3 + 20  # RoPE and zero-point fragments, maxima, factors: no content k-step's
    assert "LDSM" not in scorer and "HADD2" not in scorer
    assert summer["HMMA"] == 64 + 8 and summer["LDSM"] == 4 * (2 + 8) + 2 and "STSM" not in summer
    skipped = role_loop_histograms(1)
    assert "HMMA" not in skipped["summer"] and skipped["scorer"]["HMMA"] == 84
