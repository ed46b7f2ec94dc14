"""benchmarks/tile_numerics: the v8 probe's arithmetic with a bf16 or an fp16 key tile, against float64."""
import json

import numpy as np
import pytest

from benchmarks.int8_numerics import errors, reference, v5_numerics
from benchmarks.tile_numerics import TILE_REGIMES, channel_offsets, main, scaled_case, tile_numerics


@pytest.fixture(scope="module")
def sharp():
    return scaled_case(np.random.default_rng(2), 1024, *TILE_REGIMES["sharp"])


def test_exact_keys_give_v8_a_log_sum_exp_far_closer_than_v5s(sharp):
    want = reference(sharp)
    v5 = errors(v5_numerics(sharp), want)
    for tile in ("bf16", "fp16"):
        got = errors(tile_numerics(sharp, tile), want)
        assert got["rel_fro_out"] < 1e-2 and got["rel_fro_out"] < v5["rel_fro_out"]
        assert got["max_abs_lse"] < 1e-3 and got["max_abs_lse"] < v5["max_abs_lse"] / 10


def test_fp16_weights_need_the_shift_where_latents_are_tiny():
    tiny = scaled_case(np.random.default_rng(0), 64, *TILE_REGIMES["tiny"])
    want = reference(tiny)
    assert errors(tile_numerics(tiny, "fp16", shift=False), want)["rel_fro_out"] > 1e-2  # below fp16's normals
    assert errors(tile_numerics(tiny, "fp16"), want)["rel_fro_out"] < 3e-3
    assert errors(tile_numerics(tiny, "bf16"), want)["rel_fro_out"] < 3e-3  # bf16's range needs no shift


def test_scaled_case_keeps_the_logits():
    a = scaled_case(np.random.default_rng(3), 64, 2.0, 0, 0)
    b = scaled_case(np.random.default_rng(3), 64, 2.0, 0, -16)
    (out_a, lse_a), (out_b, lse_b) = reference(a), reference(b)
    assert np.array_equal(lse_a, lse_b)
    assert np.allclose(out_a * 2.0 ** -16, out_b, rtol=0, atol=1e-12 * np.abs(out_b).max())


def test_fp16_offsets_put_the_high_nibbles_sixteenth_in_their_queries():
    off = channel_offsets("fp16")
    assert (off[:256] == 1024).all() and (off[256:512] == 64).all()
    assert (off[512:544] == 1024).all() and (off[544:] == 64).all()
    assert (channel_offsets("bf16") == 128).all()


def test_model_names_a_bad_tile(sharp):
    with pytest.raises(ValueError, match="tile.*'fp8'"):
        tile_numerics(sharp, "fp8")


def test_main_prints_a_row_per_regime_and_length(capsys):
    main(["--lengths", "64"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["regime"] for r in rows] == list(TILE_REGIMES)
    assert all({"v5", "v8_bf16", "v8_fp16", "v8_fp16_no_shift"} <= set(r) for r in rows)
    with pytest.raises(ValueError, match="multiple of 64"):
        main(["--lengths", "100"])
