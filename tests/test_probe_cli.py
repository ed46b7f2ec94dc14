"""benchmarks/probe_cli: the probes' shared checks and command line, on CPU (the timing needs CuPy and a GPU)."""
import json

import numpy as np
import pytest

from benchmarks.probe_cli import emit_json_row, partial_errors, probe_main, probe_row


def _parts(rng):
    """Two CTAs x two parts of unnormalized outputs and their (log2 maximum, row sum), with the reference they are."""
    ref_o = rng.standard_normal((2, 2, 16, 512))
    ref_lse = rng.standard_normal((2, 2, 16))
    m = rng.standard_normal((2, 2, 16))
    l = rng.uniform(0.5, 2.0, (2, 2, 16))
    stats = np.stack([m, l], axis=-1)
    stats[..., 0] = ref_lse - np.log2(l)  # so that m + log2(l) is the reference's
    return ref_o * l[..., None], stats, lambda cta, part: (ref_o[cta, part], ref_lse[cta, part])


def test_partial_errors_are_zero_on_exact_parts_and_see_one_wrong_value():
    out, stats, reference = _parts(np.random.default_rng(0))
    assert partial_errors(out, stats, 2, reference) == pytest.approx((0.0, 0.0), abs=1e-12)
    out[1, 1, 3, 7] += 1.0 * stats[1, 1, 3, 1]
    err_o, _ = partial_errors(out, stats, 2, reference)
    assert err_o > 0.1
    assert partial_errors(out, stats, 1, reference)[0] < 1e-12  # one CTA checked: the first, which is right
    assert partial_errors(out, stats, 0, reference) == (0.0, 0.0)


def test_emit_json_row_prints_and_appends(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    emit_json_row({"a": 1}, str(path))
    emit_json_row({"b": 2.5}, str(path))
    emit_json_row({"c": 3}, None)
    assert [json.loads(x) for x in path.read_text().splitlines()] == [{"a": 1}, {"b": 2.5}]
    assert capsys.readouterr().out.splitlines()[-1] == '{"c": 3}'


def test_probe_main_runs_or_prints_the_histogram(tmp_path, capsys):
    calls = []

    def run(ctas, tpc, iters, check, skip=0):
        calls.append((ctas, tpc, iters, check, skip))
        return {"us": 1.5}

    hist = {1: {"HMMA": 2.0, "LOP3": 5.5}}
    kw = dict(description="probe", run=run, histogram=lambda skip: hist[skip], skips={0: "none", 1: "PV"},
              label="tile loop", tpc_multiple=128)
    probe_main(["--sass", "--skip", "1"], **kw)
    assert capsys.readouterr().out.strip() == "tile loop (skipped: PV): 7.5 instructions; LOP3 5.5, HMMA 2"
    probe_main(["--ctas", "3", "--tpc", "256", "--check", "0", "--json", str(tmp_path / "r.jsonl")], **kw)
    assert calls == [(3, 256, 20, 0, 0)] and json.loads((tmp_path / "r.jsonl").read_text()) == {"us": 1.5}
    with pytest.raises(SystemExit):
        probe_main(["--skip", "2"], **kw)


def test_probe_row_reports_rate_errors_and_untouched_outputs():
    out = np.zeros((2, 1, 16, 512))
    row = probe_row("PV", 2, 128, 4.0, 8000, 1, (1e-3, 2e-4), out)
    assert row["tokens"] == 256 and row["gbps"] == 2.0 and row["max_rel_err_out"] == 1e-3
    assert row["max_abs_err_lse2"] == 2e-4 and row["skip"] == "PV" and row["nan_in_output"] is False
    out[1, 0, 5, 7] = np.nan
    assert probe_row("none", 2, 128, 4.0, 8000, 0, (0.0, 0.0), out)["nan_in_output"] is True
