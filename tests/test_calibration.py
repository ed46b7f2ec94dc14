"""Calibration on tiny random-weight DeepSeek-V2/V3 models: adapters, capture, fusion, training, CLI."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from quantmla_core.calibration.adapters import find_mla_layers  # noqa: E402
from quantmla_core.calibration.capture import capture, layer_tensors, make_sequences, default_text, tokenize  # noqa: E402
from quantmla_core.calibration.fuse import equivalence_check, fuse_model, random_transforms  # noqa: E402
from quantmla_core.calibration.objectives import QuantSpec, fake_quantize_range_ste  # noqa: E402
from quantmla_core.calibration.pipeline import compare_methods  # noqa: E402
from quantmla_core.calibration.tiny import tiny_model  # noqa: E402
from quantmla_core.calibration.train import Recipe, lr_lambda  # noqa: E402
from quantmla_core.quantizer import fake_quantize  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: one thread is much faster on a shared 2-core machine
    yield
    torch.set_num_threads(n)


# arch, q LoRA, YaRN, V3 rope_interleave -> expected (raw, cached) pair layouts
CASES = [
    ("v2", False, True, None, ("interleaved", "interleaved")),
    ("v2", True, False, None, ("interleaved", "interleaved")),
    ("v3", True, False, True, ("interleaved", "half")),
    ("v3", False, True, False, ("half", "half")),
    ("v3", True, True, True, ("interleaved", "half")),
]
IDS = [f"{a}-{'qlora' if q else 'qproj'}-{'yarn' if y else 'noyarn'}{'' if i is None else ('-interleave' if i else '-half')}"
       for a, q, y, i, _ in CASES]


def _model(arch, q_lora, yarn, inter, **kw):
    extra = {} if inter is None else {"rope_interleave": inter}
    return tiny_model(arch, q_lora=q_lora, yarn=yarn, outliers=True, **extra, **kw)


@pytest.mark.parametrize("arch,q_lora,yarn,inter,layouts", CASES, ids=IDS)
def test_adapter_spec(arch, q_lora, yarn, inter, layouts):
    m = _model(arch, q_lora, yarn, inter)
    specs = find_mla_layers(m)
    assert [s.layer_idx for s in specs] == [0, 1]
    s = specs[0]
    assert (s.rope_layout, s.cache_rope_layout) == layouts
    assert (s.q_lora_rank is not None) == q_lora
    assert (s.q_proj is None) == q_lora and (s.q_b_proj is not None) == q_lora
    assert s.q_out_proj.weight.shape[0] == s.num_heads * s.qk_head_dim
    assert s.kv_a_proj_with_mqa.weight.shape[0] == s.d_c + s.d_r
    tau = s.qk_head_dim**-0.5
    if yarn:
        mscale = 0.1 * 1.0 * math.log(4.0) + 1.0
        tau *= mscale**2
    assert s.softmax_scale == pytest.approx(tau, rel=1e-12)


@pytest.mark.parametrize("arch,q_lora,yarn,inter,layouts", CASES, ids=IDS)
def test_capture_reproduces_attention(arch, q_lora, yarn, inter, layouts):
    m = _model(arch, q_lora, yarn, inter)
    specs = find_mla_layers(m)
    caps = capture(m, specs, torch.randint(0, 256, (2, 24)))
    for s in specs:
        d = layer_tensors(caps[s.layer_idx])
        ym = torch.cat(caps[s.layer_idx].y_model)
        assert float((d.y - ym).norm() / ym.norm()) < 1e-5


@pytest.mark.parametrize("arch,q_lora,yarn,inter,layouts", CASES, ids=IDS)
def test_fusion_random_transforms_keeps_logits(arch, q_lora, yarn, inter, layouts):
    m = _model(arch, q_lora, yarn, inter)
    fused = copy.deepcopy(m)
    content, rope = random_transforms(m, seed=3)
    fuse_model(fused, content, rope)
    ids = torch.randint(0, 256, (2, 40))
    eq = equivalence_check(m, fused, ids)
    assert eq["logits_rel_err"] <= 1e-5
    assert max(eq["layer_rel_err"]) <= 1e-5
    assert abs(eq["nll_fused"] - eq["nll_original"]) <= 1e-5 * abs(eq["nll_original"])
    # the fused model caches exactly the transformed values, in the model's own pair layout
    ca = capture(m, find_mla_layers(m), ids)
    cb = capture(fused, find_mla_layers(fused), ids)
    for i in ca:
        da, db = layer_tensors(ca[i]), layer_tensors(cb[i])
        rel = lambda a, b: float((a.detach() - b).norm() / b.norm())
        assert rel(rope[i].apply_to_cache(da.kr), db.kr) < 1e-5
        assert rel(rope[i].apply_to_query(da.qr), db.qr) < 1e-5
        assert rel(content[i].apply_to_cache(da.c), db.c) < 1e-5
        # every q.k of the RoPE path kept
        ref = torch.einsum("nhtr,nsr->nhts", da.qr.double(), da.kr.double())
        with torch.no_grad():
            qt, kt = rope[i].apply_to_query(da.qr.double()), rope[i].apply_to_cache(da.kr.double())
        got = torch.einsum("nhtr,nsr->nhts", qt, kt)
        assert float((got - ref).abs().max()) <= 1e-12 * float(ref.abs().max())


def test_range_ste_values_match_core_quantizer():
    x = torch.randn(6, 128, requires_grad=True)
    for bits in (2, 4):
        a = fake_quantize_range_ste(x, bits, 64, torch.bfloat16)
        b = fake_quantize(x, bits, 64, torch.bfloat16)
        assert torch.equal(a, b)
    # uniform rescaling leaves relative error unchanged: zero gradient for a global scale
    s = torch.ones((), requires_grad=True)
    y = x.detach()
    loss = ((fake_quantize_range_ste(y * s, 4, 64, torch.float32) / s - y) ** 2).sum()
    loss.backward()
    assert abs(float(s.grad)) < 1e-3 * float(loss.detach())


def test_lr_schedule():
    f = lr_lambda(100, 0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(99) < 0.01


def test_sequences_from_default_text():
    ids = tokenize(default_text(), None, 256)
    assert ids.numel() > 3000
    seqs = make_sequences(ids, 5, 2048)
    assert seqs.shape == (5, 2048) and int(seqs.max()) < 256


def _layer_split(fmt_dims=(128, 32), n_train=12, n_val=6, T=96, seed=0):
    m = tiny_model("v3", outliers=True, d_c=fmt_dims[0], d_r=fmt_dims[1], hidden=128, seed=seed)
    specs = find_mla_layers(m)
    g = torch.Generator().manual_seed(seed)
    caps = capture(m, specs[:1], torch.randint(0, 256, (n_train + n_val, T), generator=g), batch_size=6)
    d = layer_tensors(caps[specs[0].layer_idx])
    return d.subset(slice(0, n_train)), d.subset(slice(n_train, None))


@pytest.fixture(scope="module")
def outlier_layer():
    return _layer_split()


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_learned_beats_baselines(outlier_layer, fmt):
    """Planted outliers: learned transforms < RTN, SmoothQuant-style, QuaRot-style on held-out objectives."""
    train, val = outlier_layer
    qs = QuantSpec.from_format(fmt, train.u.shape[-1], train.kr.shape[-1])
    recipe = Recipe(steps=60, val_every=10, lr_rotation=1e-2, lr_scale=1e-2, lr_angle=1e-2)
    res, tc, tr, _ = compare_methods(train, val, qs, recipe)
    for path in ("content", "rope"):
        r = res[path]
        for base in ("rtn", "smoothquant", "quarot"):
            assert r["quantmla"] < r[base], (fmt, path, r)
    # the learned transforms are real: R orthogonal, scales clipped
    R = tc.R.detach()
    assert torch.allclose(R @ R.T, torch.eye(R.shape[0]), atol=1e-4)
    assert float(tr.log_s.detach().abs().max()) <= 2.0 + 1e-6 or float(tr.s.log().abs().max()) <= 2.0 + 1e-6


def test_cli_end_to_end(tmp_path):
    from transformers import AutoModelForCausalLM

    from quantmla_core.calibration.__main__ import main
    from quantmla_core.calibration.fuse import load_fused_transforms

    src = tmp_path / "tiny"
    out = tmp_path / "fused"
    orig = tiny_model("v2", q_lora=True, yarn=True, outliers=True)
    orig.save_pretrained(src)
    rc = main(["--model", str(src), "--format", "C2R4", "--out", str(out), "--n-train", "6", "--n-val", "3",
               "--seq-len", "48", "--steps", "8", "--val-every", "4", "--layers-per-pass", "1", "--quiet"])
    assert rc == 0
    for f in ("config.json", "model.safetensors", "quantmla_transforms.safetensors", "quantmla_transforms.json",
              "quantmla_report.json", "dual_path.csv", "dual_path.png", "objectives.csv"):
        assert (out / f).exists(), f
    fused = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        eq = equivalence_check(orig.eval(), fused, ids)
        gen = fused.generate(ids, max_new_tokens=5, do_sample=False)
        gen0 = orig.generate(ids, max_new_tokens=5, do_sample=False)
    assert eq["logits_rel_err"] < 1e-5
    assert gen.shape == (1, 17) and torch.equal(gen, gen0)
    content, rope, meta = load_fused_transforms(out)
    assert sorted(content) == [0, 1] and meta["format"] == "C2R4" and meta["rope_layout"] == "interleaved"


@pytest.mark.parametrize("config_name,why", [("DeepseekV32Config", "index_topk"), ("GlmMoeDsaConfig", "index_topk"),
                                             ("DeepseekV4Config", "not an MLA latent")])
def test_models_it_cannot_serve_are_refused_with_the_reason(config_name, why):
    """DeepSeek Sparse Attention models cache an MLA latent but attend to their indexer's top-k tokens only, and
    DeepSeek-V4 caches no latent: finding their MLA layers fails naming the model type and why, not with the
    generic "no adapter" error."""
    transformers = pytest.importorskip("transformers")
    config_cls = getattr(transformers, config_name, None)
    if config_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {config_name}")
    model = type("Model", (torch.nn.Module,), {})()
    model.config = config_cls()
    with pytest.raises(ValueError, match=f"{model.config.model_type!r} is not served: it .*{why}"):
        find_mla_layers(model)


def test_unknown_model_types_name_the_known_ones():
    model = type("Model", (torch.nn.Module,), {})()
    model.config = type("Config", (), {"model_type": "llama"})()
    with pytest.raises(ValueError, match="no MLA adapter for 'llama'; known: .*sarvam_mla"):
        find_mla_layers(model)


def test_fuse_accepts_attention_module():
    """``transform.fuse`` takes an MLALayerSpec or the transformers attention module itself."""
    m = _model("v3", True, False, True)
    ref = copy.deepcopy(m)
    content, rope = random_transforms(m, seed=5)
    for s in find_mla_layers(m):
        content[s.layer_idx].fuse(s.attn)
        rope[s.layer_idx].fuse(s.attn)
    eq = equivalence_check(ref, m, torch.randint(0, 256, (1, 16)))
    assert eq["logits_rel_err"] <= 1e-5


@pytest.mark.parametrize("kind", ["content", "rope"])
def test_fusion_of_one_kind_alone(kind):
    """``fuse_model`` with only content or only RoPE transforms fuses those alone: logits kept, the cached latent
    (content) or RoPE key (rope) transformed, the other left as it was."""
    arch, q_lora, yarn, inter, layouts = CASES[0]
    m = _model(arch, q_lora, yarn, inter)
    fused = copy.deepcopy(m)
    content, rope = random_transforms(m, seed=4)
    fuse_model(fused, content if kind == "content" else None, rope if kind == "rope" else None)
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))
    assert equivalence_check(m, fused, ids)["logits_rel_err"] <= 1e-5
    from quantmla_core.calibration.fuse import TRANSFORMS_NAME

    assert fused.config.quantmla == {"transforms": TRANSFORMS_NAME, "fused": True}  # saved with the model
    assert not hasattr(m.config, "quantmla")
    ca, cb = capture(m, find_mla_layers(m), ids), capture(fused, find_mla_layers(fused), ids)
    rel = lambda a, b: float((a.detach() - b.detach()).norm() / b.detach().norm())  # noqa: E731
    for i in ca:
        da, db = layer_tensors(ca[i]), layer_tensors(cb[i])
        if kind == "content":
            assert rel(content[i].apply_to_cache(da.c), db.c) < 1e-5 and rel(da.kr, db.kr) < 1e-6
        else:
            assert rel(rope[i].apply_to_cache(da.kr), db.kr) < 1e-5 and rel(da.c, db.c) < 1e-6


def _output_nmse(d, c, kr):
    from quantmla_core.calibration.objectives import attention_output
    with torch.no_grad():
        return float((attention_output(d, c, kr) - d.y).pow(2).sum() / d.y.pow(2).sum())


def test_dual_path_injects_each_paths_own_quantization_error(outlier_layer):
    """At the format's own cache NMSE the injected error is exactly RTN's, with its sign, on one path at a time."""
    from quantmla_core.calibration.analysis import dual_path
    d = outlier_layer[1]
    qs = QuantSpec.from_format("C2R4", d.u.shape[-1], d.kr.shape[-1])
    qc, qk = qs.q_content(d.c), qs.q_rope(d.kr)
    own = lambda q, x: float((q - x).pow(2).sum() / x.pow(2).sum())
    want_c, want_r = _output_nmse(d, qc, d.kr), _output_nmse(d, d.c, qk)
    got_c = dual_path(d, qs, cache_nmse=own(qc, d.c))
    got_r = dual_path(d, qs, cache_nmse=own(qk, d.kr))
    assert got_c["content_out_nmse"] == pytest.approx(want_c, rel=1e-3)
    assert got_r["rope_out_nmse"] == pytest.approx(want_r, rel=1e-3)
    # the opposite sign would be another error: this layer's outputs tell them apart
    assert _output_nmse(d, 2 * d.c - qc, d.kr) != pytest.approx(want_c, rel=1e-2)
    assert got_c["ratio"] == pytest.approx(got_c["rope_out_nmse"] / got_c["content_out_nmse"], rel=1e-12)
    assert got_c["layer"] == d.spec.layer_idx and got_c["cache_nmse"] == own(qc, d.c)


def test_dual_path_gaussian_noise_is_seeded_and_scales_with_the_cache_nmse(outlier_layer):
    from quantmla_core.calibration.analysis import dual_path
    d = outlier_layer[1]
    qs = QuantSpec.from_format("C4R4", d.u.shape[-1], d.kr.shape[-1])
    a = dual_path(d, qs, cache_nmse=1e-6, noise="gaussian", seed=1)
    assert dual_path(d, qs, cache_nmse=1e-6, noise="gaussian", seed=1) == a
    assert dual_path(d, qs, cache_nmse=1e-6, noise="gaussian", seed=2)["content_out_nmse"] != a["content_out_nmse"]
    b = dual_path(d, qs, cache_nmse=4e-6, noise="gaussian", seed=1)
    for path in ("content_out_nmse", "rope_out_nmse"):  # small noise: output NMSE is linear in the cache NMSE
        assert 0 < a[path] and b[path] / a[path] == pytest.approx(4.0, rel=0.05), path
    with pytest.raises(ValueError, match="noise: expected 'quant' or 'gaussian', got 'uniform'"):
        dual_path(d, qs, noise="uniform")
