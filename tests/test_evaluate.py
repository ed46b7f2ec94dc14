"""``quantmla_core.integrations.evaluate``: next-token quality of a model whose attention reads the QuantMLA cache,
against the unmodified model. On a tiny random-weight DeepSeek-V3 model (outlier channels, small protection windows so
that most of the history comes from the packed pages): the BF16 page format is the control and changes nothing but
rounding, and the low-bit formats move the predictions, C2R4 more than C4R4."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from quantmla_core.calibration.tiny import tiny_model  # noqa: E402
from quantmla_core.integrations.evaluate import (  # noqa: E402
    decode_logits,
    evaluate_formats,
    format_table,
    main,
)
from quantmla_core.integrations.transformers import enable_quantmla  # noqa: E402

BACKEND = "torch"


@pytest.fixture(scope="module")
def model():
    return tiny_model("v3", outliers=True)


def _sequences(model, n=2, length=120, seed=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (n, length), generator=g)


def test_bf16_cache_is_the_control_and_low_bits_move_predictions(model):
    res = {r.format: r for r in evaluate_formats(model, _sequences(model), ["BF16", "C4R4", "C2R4"], prefix=16,
                                                 chunk=16, sink=4, local=8, backend=BACKEND)}
    assert all(r.tokens == 2 * (120 - 16 - 1) for r in res.values())
    bf16, c4, c2 = res["BF16"], res["C4R4"], res["C2R4"]
    # a random model predicts nearly flat distributions, so bf16 rounding alone flips some near-tied top-1 picks
    assert bf16.kl < 1e-5 and abs(bf16.delta_nll) < 1e-3 and bf16.top1_agreement > 0.95 > c2.top1_agreement
    assert c2.kl > c4.kl > 10 * bf16.kl and c2.kl > 1e-4  # the pages are read: quantization shows
    assert c2.nll_reference == bf16.nll_reference  # one reference for every format
    table = format_table(res.values())
    assert table.splitlines()[0].split()[:3] == ["format", "tokens", "NLL"] and "C2R4" in table


def test_decode_logits_follow_the_model_through_a_bf16_cache(model):
    ids = _sequences(model, n=1, length=50, seed=4)
    with torch.no_grad():
        want = model(input_ids=ids).logits[:, 20:].float()
    with enable_quantmla(model, "BF16", sink=4, local=8, backend=BACKEND):
        got = decode_logits(model, ids, prefix=20, chunk=7)  # a chunk that does not divide the length
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 2e-2 * want.abs().max().item()


@pytest.mark.parametrize("shape, prefix, match", [((2, 10), 16, r"T >= prefix \+ 2 = 18"), ((30,), 4, r"\[N, T\]")])
def test_bad_sequences_are_refused_naming_the_argument(model, shape, prefix, match):
    with pytest.raises(ValueError, match=f"sequences: expected .*{match}"):
        evaluate_formats(model, torch.zeros(shape, dtype=torch.long), ["C4R4"], prefix=prefix)


def test_cli_writes_the_table_and_json(model, tmp_path, capsys):
    model.save_pretrained(tmp_path / "tiny")
    rc = main(["--model", str(tmp_path / "tiny"), "--formats", "BF16,C4R4", "--sequences", "1", "--seq-len", "60",
               "--prefix", "16", "--local", "8", "--backend", BACKEND, "--device", "cpu", "--json",
               str(tmp_path / "q.json")])
    assert rc == 0
    out = capsys.readouterr().out
    assert "C4R4" in out and "top-1" in out
    rows = json.loads((tmp_path / "q.json").read_text())
    assert [r["format"] for r in rows] == ["BF16", "C4R4"] and rows[0]["tokens"] == 60 - 16 - 1


def test_calibrated_transforms_cut_the_cache_error_against_round_to_nearest(model):
    """The method end to end: calibrate the tiny model for C2R4 (a short recipe), fuse, and the quantized cache moves
    its predictions less than round-to-nearest on the unfused model does, while the fused model itself (the
    reference, quantization off) predicts as before."""
    import copy

    from quantmla_core.calibration.pipeline import CalibrationConfig, calibrate
    from quantmla_core.calibration.train import Recipe

    fused = copy.deepcopy(model)
    train = torch.randint(3, 256, (12, 64), generator=torch.Generator().manual_seed(1))
    cfg = CalibrationConfig(fmt="C2R4", n_train=8, n_val=4, seq_len=64, recipe=Recipe(steps=60, val_every=20),
                            baselines=False, analysis=False, progress=False, check=False)
    calibrate(fused, train, cfg, log=lambda *a, **k: None)
    held_out = _sequences(model, n=3, length=160, seed=5)
    kw = dict(prefix=16, chunk=16, sink=4, local=8, backend=BACKEND)
    (rtn,) = evaluate_formats(model, held_out, ["C2R4"], **kw)
    (cal,) = evaluate_formats(fused, held_out, ["C2R4"], **kw)
    assert abs(cal.nll_reference - rtn.nll_reference) < 1e-4
    assert cal.kl < 0.6 * rtn.kl and cal.top1_agreement > rtn.top1_agreement
