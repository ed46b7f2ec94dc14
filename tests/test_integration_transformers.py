"""Hugging Face integration: ``generate()`` on a QuantMLACache with the absorbed decode path.

Tiny random-weight DeepseekV2 / DeepseekV3 models (float32, CPU), built from their config
classes. Protection is kept small (sink 4, local 16) so that most of the history is read from
the packed pages. The backend is ``torch`` unless ``QUANTMLA_TEST_HF_BACKEND`` names another.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")

import quantmla_core as qm  # noqa: E402
from quantmla_core.integrations.transformers import (  # noqa: E402
    QuantMLACache,
    QuantMLAHandle,
    QuantMLALayer,
    cache_kwarg,
    enable_quantmla,
)

BACKEND = os.environ.get("QUANTMLA_TEST_HF_BACKEND", "torch")
SINK, LOCAL = 4, 16
GEN = dict(do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=2)


# ------------------------------------------------------------------------------------- models
def tiny_model(arch: str = "v3", *, q_lora: bool = True, yarn: bool = False, rope_interleave: bool = True,
               attn: str = "eager", seed: int = 0) -> nn.Module:
    """A float32 eval-mode 2-layer MLA CausalLM (layer 0 dense, layer 1 MoE), random weights.

    d_c = 64, d_r = 32, 4 heads of (16 nope + 32 rope) / 16 v; attention projections re-drawn
    with std fan_in^-0.5 so that attention is far from uniform.
    """
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128,
                "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0}
    common = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
                  q_lora_rank=32 if q_lora else None, qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16,
                  n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                  max_position_embeddings=512, rope_parameters=rope, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if arch == "v2":
        cfg = transformers.DeepseekV2Config(**common)
        cls = transformers.DeepseekV2ForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(**common, n_group=1, topk_group=1, rope_interleave=rope_interleave)
        cls = transformers.DeepseekV3ForCausalLM
    cfg._attn_implementation = attn
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and ".self_attn." in name:
                nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
    return model


def prompt(n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (1, n), generator=g)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def step_errors(out, ref) -> list[float]:
    assert len(out.logits) == len(ref.logits)
    return [rel(a, b) for a, b in zip(out.logits, ref.logits)]


def with_cache(model, cache) -> dict:
    """``{"cache": cache}`` on transformers >= 5.2x, ``{"past_key_values": cache}`` on earlier releases."""
    return {cache_kwarg(model): cache}


@torch.no_grad()
def generate(model, ids, n, **kw):
    if "cache" in kw:  # the tests spell it cache=; older transformers take past_key_values=
        kw.update(with_cache(model, kw.pop("cache")))
    return model.generate(ids, max_new_tokens=n, **GEN, **kw)


# ------------------------------------------------------------------------------------- import guard
def test_import_quantmla_core_does_not_import_transformers():
    code = "import sys, quantmla_core, quantmla_core.integrations; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_clear_import_error_without_transformers():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import quantmla_core.integrations.transformers\n"
        "except ImportError as e:\n"
        "    assert 'pip install' in str(e) and 'transformers' in str(e), e\n"
        "else:\n"
        "    raise SystemExit('no ImportError')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------------------------- accuracy
MODELS = {
    "v2": dict(arch="v2", q_lora=False),
    "v3": dict(arch="v3"),
    "v3-yarn-neox-sdpa": dict(arch="v3", q_lora=False, yarn=True, rope_interleave=False, attn="sdpa"),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_bf16_format_matches_unmodified_model(name):
    model = tiny_model(**MODELS[name])
    ids = prompt(45)
    ref = generate(model, ids, 24)
    handle = enable_quantmla(model, "BF16", sink=SINK, local=LOCAL, backend=BACKEND)
    assert isinstance(handle, QuantMLAHandle) and len(handle.specs) == 2
    cache = QuantMLACache(model)
    out = generate(model, ids, 24, cache=cache)
    assert torch.equal(out.sequences, ref.sequences)
    errs = step_errors(out, ref)
    assert errs[0] < 1e-6  # prefill: the model's own full-precision attention
    assert max(errs) < 1e-2, errs
    assert cache.seq_lengths() == [45 + 23] * 1 and cache.get_seq_length() == 45 + 23
    # pages grow on demand: no maximum length, the -1 that transformers' dynamic layers report
    assert cache.get_max_length() == -1 and [layer.get_max_length() for layer in cache.layers] == [-1, -1]
    # the pages really hold the history: 68 tokens, 48 outside the protection buffers
    assert cache.layers[0].paged.pages_in_use == 2  # 64-token pages
    handle.disable()
    again = generate(model, ids, 24)
    assert torch.equal(again.sequences, ref.sequences) and max(step_errors(again, ref)) == 0.0


@pytest.mark.parametrize("arch", ["v2", "v3"])
def test_c8r8_close_to_unmodified_model(arch):
    model = tiny_model(arch)
    ids = prompt(50, seed=2)
    ref = generate(model, ids, 16)
    with enable_quantmla(model, "C8R8", sink=SINK, local=LOCAL, backend=BACKEND):
        out = generate(model, ids, 16, cache=QuantMLACache(model))
    assert torch.equal(out.sequences, ref.sequences)
    errs = step_errors(out, ref)
    assert max(errs) < 3e-2, errs
    assert max(errs[1:]) > 1e-4  # really quantized


@pytest.mark.parametrize("fmt", ["C4R4", "C2R4"])
def test_low_bit_generation_runs_and_reports_real_bytes(fmt):
    model = tiny_model("v3")
    ids = prompt(70, seed=3)
    enable_quantmla(model, fmt, sink=SINK, local=LOCAL, backend=BACKEND)
    cache = QuantMLACache(model)
    with warnings.catch_warnings():  # transformers >= 5.2x spells it cache=; past_key_values= still works (until 5.40)
        warnings.simplefilter("ignore", FutureWarning)
        out = generate(model, ids, 12, past_key_values=cache)
    assert out.sequences.shape == (1, 82)
    assert all(torch.isfinite(x).all() for x in out.logits)
    length = 70 + 11
    pf = qm.PackFormat.parse(fmt, latent_dim=64, rope_dim=32)
    assert cache.format == pf
    # real allocation: every tensor of every layer
    real = 0
    for layer in cache.layers:
        c = layer.paged.cache
        real += sum(t.numel() * t.element_size() for t in (c.pages, c.sink_buf, c.local_buf))
        assert c.pages.dtype == torch.uint8 and c.pages.shape[1] == pf.page_bytes
    rep = cache.memory_report()
    assert rep["allocated_bytes"] == cache.allocated_bytes() == real
    # used bytes follow DESIGN.md 3.6 (bf16 protection rows) for one request per layer
    assert cache.used_bytes() == 2 * qm.memory_bytes(pf, length, SINK, LOCAL) <= real
    assert rep["bf16_bytes"] == 2 * length * (64 + 32) * 2
    assert rep["tokens"] == length and rep["format"] == fmt
    assert rep["compression"] == pytest.approx(rep["bf16_bytes"] / rep["used_bytes"])


def test_bytes_shrink_with_bits():
    model = tiny_model("v3")
    ids = prompt(300, seed=4)
    used = {}
    for fmt in ("BF16", "C8R8", "C4R4", "C2R4"):
        enable_quantmla(model, fmt, sink=SINK, local=LOCAL, backend=BACKEND)
        cache = QuantMLACache(model)
        generate(model, ids, 2, cache=cache)
        used[fmt] = cache.used_bytes()
    assert used["C2R4"] < used["C4R4"] < used["C8R8"] < used["BF16"], used


# ------------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("arch,attn", [("v3", "eager"), ("v2", "sdpa")])
def test_left_padded_batch_matches_one_at_a_time(arch, attn, monkeypatch):
    model = tiny_model(arch, attn=attn)
    lens = [37, 21, 50]
    prompts = [prompt(n, seed=10 + i)[0] for i, n in enumerate(lens)]
    width = max(lens)
    ids = torch.full((3, width), 2)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):], mask[i, width - len(p):] = p, 1
    enable_quantmla(model, "C4R4", sink=SINK, local=LOCAL, backend=BACKEND)

    writes = []
    import quantmla_core.paged as paged_mod

    real_write = paged_mod._write
    monkeypatch.setattr(paged_mod, "_write", lambda *a, **k: (writes.append(int(a[1].shape[0])), real_write(*a, **k)))
    cache = QuantMLACache(model)
    with torch.no_grad():
        model(ids, attention_mask=mask, **with_cache(model, cache))  # prefill alone: one writer call a layer, no padding
    assert writes == [sum(lens)] * 2
    assert cache.seq_lengths() == lens and cache.get_seq_length() == width
    monkeypatch.setattr(paged_mod, "_write", real_write)

    n = 10
    cache = QuantMLACache(model)
    batch = generate(model, ids, n, attention_mask=mask, cache=cache)
    assert cache.seq_lengths() == [x + n - 1 for x in lens]
    for i, p in enumerate(prompts):
        one = generate(model, p[None], n, cache=QuantMLACache(model))
        assert torch.equal(one.sequences[0, len(p):], batch.sequences[i, width:]), i
        errs = [rel(b[i], a[0]) for a, b in zip(one.logits, batch.logits)]
        assert max(errs) < 1e-3, (i, errs)


def test_beam_search_and_multiple_samples_match_unmodified():
    model = tiny_model("v3")
    ids = prompt(30, seed=5)
    kw = dict(max_new_tokens=8, num_beams=3, num_return_sequences=2, do_sample=False, pad_token_id=2)
    with torch.no_grad():
        ref_beam = model.generate(ids, **kw)
        torch.manual_seed(7)
        ref_sample = model.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=3, pad_token_id=2)
        with enable_quantmla(model, "BF16", sink=SINK, local=LOCAL, backend=BACKEND):
            beam = model.generate(ids, **with_cache(model, QuantMLACache(model)), **kw)
            torch.manual_seed(7)
            cache = QuantMLACache(model)
            sample = model.generate(ids, max_new_tokens=8, do_sample=True, num_return_sequences=3, pad_token_id=2,
                                    **with_cache(model, cache))
    assert torch.equal(beam, ref_beam)
    assert torch.equal(sample, ref_sample)
    assert cache.seq_lengths() == [37, 37, 37]


def test_continuation_long_chunk_and_page_growth():
    """A second generate() on the same cache feeds 25 tokens at once (chunks of 16 on the packed
    path); 16-token pages grow by doubling."""
    model = tiny_model("v3", attn="sdpa")
    ids = prompt(30, seed=6)
    ref_cache = transformers.DynamicCache(config=model.config)
    r1 = generate(model, ids, 6, cache=ref_cache)
    ext = torch.cat([r1.sequences, prompt(25, seed=8)], dim=1)
    r2 = generate(model, ext, 6, cache=ref_cache)
    enable_quantmla(model, "BF16", sink=2, local=8, backend=BACKEND, page_size=16)
    cache = QuantMLACache(model)
    q1 = generate(model, ids, 6, cache=cache)
    pages_first = cache.layers[0].paged.cache.num_pages
    q2 = generate(model, ext, 6, cache=cache)
    assert torch.equal(q1.sequences, r1.sequences) and torch.equal(q2.sequences, r2.sequences)
    assert max(step_errors(q2, r2)) < 1e-2
    assert cache.seq_lengths() == [ext.shape[1] + 5]
    assert cache.layers[0].paged.cache.num_pages > pages_first


def test_max_length_reserves_pages_up_front():
    model = tiny_model("v2", q_lora=False)
    enable_quantmla(model, "C4R4", sink=SINK, local=LOCAL, backend=BACKEND, page_size=16)
    cache = QuantMLACache(model, max_length=64)
    generate(model, prompt(40), 10, cache=cache)
    assert [layer.paged.cache.num_pages for layer in cache.layers] == [4, 4]


def _family_model(kind: str) -> nn.Module:
    torch.manual_seed(0)
    dims = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, kv_lora_rank=64, q_lora_rank=32,
                qk_nope_head_dim=16, qk_rope_head_dim=32, v_head_dim=16, n_routed_experts=4,
                max_position_embeddings=512, pad_token_id=2)
    v3_like = dict(intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2, num_key_value_heads=4,
                   num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1)
    if kind == "glm4_moe_lite":
        cfg = transformers.Glm4MoeLiteConfig(**dims, **v3_like)
        cls = transformers.Glm4MoeLiteForCausalLM
    elif kind == "sarvam_mla":  # its own config, DeepSeek-V3's modules (transformers' auto mapping)
        cfg = transformers.SarvamMLAConfig(**dims, **v3_like)
        cls = transformers.AutoModelForCausalLM.from_config
    else:  # two MLA blocks per layer, latent and query multipliers
        cfg = transformers.LongcatFlashConfig(**dims, ffn_hidden_size=128, expert_ffn_hidden_size=32, num_layers=2,
                                              moe_topk=2, zero_expert_num=1, head_dim=32)
        cls = transformers.LongcatFlashForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).float().eval()
    assert model.config.model_type == kind
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and ".self_attn." in name:
                nn.init.normal_(m.weight, std=m.weight.shape[1] ** -0.5)
    return model


FAMILY_CONFIGS = {"glm4_moe_lite": "Glm4MoeLiteConfig", "longcat_flash": "LongcatFlashConfig", "sarvam_mla": "SarvamMLAConfig"}


@pytest.mark.parametrize("kind", sorted(FAMILY_CONFIGS))
def test_other_mla_families_through_the_adapter(kind):
    if not hasattr(transformers, FAMILY_CONFIGS[kind]):
        pytest.skip(f"transformers {transformers.__version__} has no {kind}")
    model = _family_model(kind)
    ids = prompt(30, seed=12)
    ref = generate(model, ids, 8)
    with enable_quantmla(model, "BF16", sink=SINK, local=8, backend=BACKEND):
        out = generate(model, ids, 8, cache=QuantMLACache(model))
    assert torch.equal(out.sequences, ref.sequences)
    assert max(step_errors(out, ref)) < 1e-2


# ------------------------------------------------------------------------------------- transforms
def test_fused_transforms_keep_the_model_function():
    from quantmla_core.calibration.adapters import find_mla_layers
    from quantmla_core.transforms import ContentTransform, RopeTransform

    model = tiny_model("v3")
    ids = prompt(40, seed=9)
    ref = generate(model, ids, 12)
    g = torch.Generator().manual_seed(3)
    content, rope = {}, {}
    for s in find_mla_layers(model):
        ct = ContentTransform(s.d_c, gamma=s.kv_a_layernorm.weight.detach(), log_scale=0.5 * torch.randn(s.d_c, generator=g))
        with torch.no_grad():
            ct.A.copy_(0.3 * torch.randn(s.d_c, s.d_c, generator=g))
        content[s.layer_idx] = ct
        rope[s.layer_idx] = RopeTransform(s.d_r, layout=s.rope_layout, cache_layout=s.cache_rope_layout,
                                          log_scale=0.5 * torch.randn(s.d_r // 2, generator=g),
                                          angle=6.28 * torch.rand(s.d_r // 2, generator=g))
    handle = enable_quantmla(model, "BF16", sink=SINK, local=LOCAL, backend=BACKEND, transforms=(content, rope))
    assert handle.fused_transforms
    out = generate(model, ids, 12, cache=QuantMLACache(model))
    assert torch.equal(out.sequences, ref.sequences)
    assert max(step_errors(out, ref)) < 1e-2
    # a fused model is served as is (transforms=None)
    handle.disable()
    enable_quantmla(model, "C8R8", sink=SINK, local=LOCAL, backend=BACKEND)
    out8 = generate(model, ids, 12, cache=QuantMLACache(model))
    assert max(step_errors(out8, ref)[:3]) < 3e-2


# ------------------------------------------------------------------------------------- plumbing
def test_cache_kwarg_follows_the_forward_signature():
    class New(nn.Module):  # transformers >= 5.2x
        def forward(self, input_ids=None, cache=None, **kwargs):
            return input_ids

    class Old(nn.Module):  # earlier releases
        def forward(self, input_ids=None, past_key_values=None, **kwargs):
            return input_ids

    assert cache_kwarg(New()) == "cache"
    assert cache_kwarg(Old()) == "past_key_values"
    assert with_cache(Old(), 5) == {"past_key_values": 5}


def test_other_caches_pass_through_and_errors():
    model = tiny_model("v3")
    ids = prompt(20)
    ref = generate(model, ids, 4)
    handle = enable_quantmla(model, "C4R4", backend=BACKEND)
    plain = generate(model, ids, 4)  # default DynamicCache: the module runs unmodified
    assert max(step_errors(plain, ref)) == 0.0
    c = QuantMLACache(model)
    assert (c.format.name, c.sink, c.local, c.backend) == ("C4R4", 4, 128, BACKEND)
    c2 = QuantMLACache(config=model.config, format="C2R4", sink=0, local=0)
    assert c2.format.name == "C2R4" and len(c2.layers) == 2
    handle.disable()
    # decoding on a QuantMLACache without enable_quantmla fails loudly
    with pytest.raises(RuntimeError, match="enable_quantmla"):
        generate(model, ids, 3, cache=QuantMLACache(model, backend=BACKEND))
    with pytest.raises(ValueError, match="format"):
        enable_quantmla(model, "C3R4")
    with pytest.raises(ValueError, match="no MLA|adapter"):
        enable_quantmla(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="model or a config"):
        QuantMLACache()


# ------------------------------------------------------------------------------------- rollback (crop)
def _tokens(n: int, seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Random latent [B, n, 64] and k_rot [B, n, 32] of the tiny models' dims."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n, 64, generator=g), torch.randn(batch, n, 32, generator=g)


def _layer(steps, crop: int = 0, local: int = 8, rollback: bool = True):
    """A QuantMLALayer after ``steps`` (each a list of writes: one forward), then ``crop(-crop)``."""
    layer = QuantMLALayer(qm.PackFormat.parse("C4R4", latent_dim=64, rope_dim=32), 4, local, BACKEND,
                          rollback=rollback)
    for writes in steps:
        layer.begin_step()
        for lat, kr in writes:
            layer.write(lat, kr, None)
    if crop:
        layer.crop(-crop)
    return layer


def _same_state(a, b) -> None:
    """Same lengths, ring, sink rows and pages in use, and bit-identical attention over the two layers."""
    assert a.seq_lengths() == b.seq_lengths() and a.hf_len == b.hf_len
    assert a.paged.pages_in_use == b.paged.pages_in_use
    assert torch.equal(a.paged.cache.local_buf[a.rows], b.paged.cache.local_buf[b.rows])
    g = torch.Generator().manual_seed(9)
    q, r = torch.randn(2, 1, 4, 64, generator=g), torch.randn(2, 1, 4, 32, generator=g)
    assert torch.equal(a.attend(q, r, 0.2), b.attend(q, r, 0.2))


@pytest.mark.parametrize("prompt_len, spec, reject", [(40, 8, 5), (40, 8, 8), (5, 6, 4), (40, 3, 1)])
def test_crop_restores_what_the_rejected_tokens_overwrote(prompt_len, spec, reject):
    """Write a prompt, then ``spec`` candidates in one decode step, reject the last ``reject``: the cache equals one
    that only ever saw the accepted tokens, also after the next token (the ring rows the rejected tokens overwrote
    hold the older tokens again; pages past the new length are free)."""
    p, c, nxt = _tokens(prompt_len, 1), _tokens(spec, 2), _tokens(1, 3)
    keep = spec - reject
    accepted = (c[0][:, :keep], c[1][:, :keep])
    a = _layer([[p], [c]], crop=reject)
    b = _layer([[p], [accepted]] if keep else [[p]])
    _same_state(a, b)
    a.begin_step(), b.begin_step()
    a.write(*nxt, None), b.write(*nxt, None)
    _same_state(a, b)


def test_crop_of_prefill_tokens_and_across_the_chunks_of_one_forward():
    """Assisted generation's first forward is the prompt plus its candidates (a prefill); a long decode step is
    written in chunks. Rejected tokens come back out of either."""
    p, extra = _tokens(30, 4), _tokens(6, 5)
    whole = (torch.cat([p[0], extra[0]], 1), torch.cat([p[1], extra[1]], 1))
    _same_state(_layer([[whole]], crop=6), _layer([[p]]))
    c1, c2 = _tokens(5, 6), _tokens(4, 7)
    a = _layer([[p], [c1, c2]], crop=6)  # all of the second chunk and 2 of the first
    b = _layer([[p], [(c1[0][:, :3], c1[1][:, :3])]])
    _same_state(a, b)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_crop_by_a_tensor_count_shortens_the_length_transformers_sees(as_tensor):
    """transformers 5.17's assisted decoding calls ``crop(-(candidate_length - n_matches))`` with ``n_matches`` a 0-d
    tensor. The length ``get_seq_length`` reports (the masks' query offset and key length) must drop with the pages:
    before the fix an in-place ``remove -= n`` on that tensor zeroed ``n`` too, so the pages lost the tokens but
    ``hf_len`` kept them, and the next step's mask (built for 5 phantom keys past the 2-D mask) hid the new token
    from its own query."""
    p, c = _tokens(40, 12), _tokens(6, 13)
    ref = _layer([[p], [(c[0][:, :1], c[1][:, :1])]])
    for count in (-5, 41):  # remove 5 tokens; the legacy positive form: the length to keep
        layer = _layer([[p], [c]])
        layer.crop(torch.tensor(count) if as_tensor else count)
        assert type(layer.hf_len) is int and type(layer.get_seq_length()) is int
        assert layer.get_seq_length() == 41 and layer.get_mask_sizes(1) == (42, 0)
        assert all(type(u.tokens) is int for u in layer._undo)
        _same_state(layer, ref)


def test_crop_refuses_what_it_cannot_take_back():
    p, c = _tokens(40, 8), _tokens(12, 9)
    with pytest.raises(NotImplementedError, match="rollback=True"):
        _layer([[p], [c]], crop=2, rollback=False)
    with pytest.raises(NotImplementedError, match="can remove 8 tokens"):
        _layer([[p], [c]], crop=9, local=8)  # a write gives back at most `local` tokens
    layer = _layer([[p], [c]])
    layer.begin_step()
    with pytest.raises(NotImplementedError, match="can remove 0 tokens"):
        layer.crop(-1)  # a new forward began: the last one's tokens stay
    layer.crop(0)


def test_assisted_generation_with_rollback_matches_plain_generation(monkeypatch):
    """``generate(prompt_lookup_num_tokens=...)`` verifies candidates and crops the rejected ones; on a cache made
    with rollback=True it gives the tokens plain greedy generation gives on the same quantized cache."""
    model = tiny_model("v3")
    ids = prompt(40, seed=3)
    rep = torch.cat([ids, ids[:, :20], ids[:, :20]], 1)  # repeats, so that prompt lookup proposes candidates
    removed = []
    real_crop = QuantMLALayer.crop
    monkeypatch.setattr(QuantMLALayer, "crop", lambda self, n: removed.append(-n) or real_crop(self, n))
    with enable_quantmla(model, "C4R4", sink=SINK, local=8, backend=BACKEND):
        plain = model.generate(rep, max_new_tokens=20, do_sample=False, **with_cache(model, QuantMLACache(model)),
                               pad_token_id=2)
        cache = QuantMLACache(model, rollback=True)
        assert cache.is_croppable and not QuantMLACache(model).is_croppable
        assisted = model.generate(rep, max_new_tokens=20, do_sample=False, **with_cache(model, cache), pad_token_id=2,
                                  prompt_lookup_num_tokens=5)
    assert max(removed) > 0  # candidates were rejected and taken back
    assert torch.equal(assisted, plain)
    assert cache.layers[0].seq_lengths() == [assisted.shape[1] - 1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: counts stream synchronizations")
@pytest.mark.parametrize("rollback", [False, True])
def test_decode_step_of_a_layer_queues_without_a_stream_sync(rollback):
    """One decode step of a QuantMLALayer (write one token a row, attend) on the GPU backends waits for no kernel:
    before stop 45 each step moved six index arrays from pageable memory, a stream sync each, in every layer."""
    dev = torch.device("cuda")
    layer = QuantMLALayer(qm.PackFormat.parse("C4R4", latent_dim=512, rope_dim=64), 4, 128, "auto", rollback=rollback)
    g = torch.Generator(device=dev).manual_seed(3)

    def tokens(n: int):
        return (torch.randn(3, n, 512, device=dev, generator=g, dtype=torch.bfloat16),
                torch.randn(3, n, 64, device=dev, generator=g, dtype=torch.bfloat16))

    def step():
        layer.begin_step()
        layer.write(*tokens(1), None)
        q = torch.randn(3, 1, 16, 512, device=dev, generator=g, dtype=torch.bfloat16)
        return layer.attend(q, torch.randn(3, 1, 16, 64, device=dev, generator=g, dtype=torch.bfloat16), 0.04)

    layer.write(*tokens(300), None)
    step()  # builds the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (3, 1, 16, 512) and torch.isfinite(out.float()).all()
    if rollback:
        layer.crop(-1)
        assert layer.seq_lengths() == [301] * 3


def test_decode_write_of_every_row_matches_the_per_row_write():
    """A decode step without rollback writes the whole [B, t, d] batch in one reservation; the protection buffers,
    lengths, pages in use and attention (bit for bit) equal those of the per-row path (which rollback keeps), across a
    page boundary. (The pages' unwritten slots are uninitialised memory, so pages are compared through attention.)"""
    fast, per_row = (_layer([], rollback=False), _layer([], rollback=True))
    for step, t in enumerate([70, 1, 1, 3, 1]):  # prefill, then decode steps and a 3-token chunk
        lat, kr = _tokens(t, seed=50 + step)
        for layer in (fast, per_row):
            layer.begin_step()
            layer.write(lat, kr, None)
    assert fast.seq_lengths() == per_row.seq_lengths() == [76, 76]
    assert fast.paged.block_table(fast.rows).tolist() == per_row.paged.block_table(per_row.rows).tolist()
    assert torch.equal(fast.paged.cache.sink_buf, per_row.paged.cache.sink_buf)
    _same_state(fast, per_row)


@pytest.mark.parametrize("beams", [1, 2])
def test_a_step_builds_its_index_arrays_once_for_every_layer(beams):
    """The layers' allocators share one StepMemo: the first layer of a step builds its write plan and attention plan
    and the other layer takes them (beam search forks, frees and reorders requests between steps); the generation
    is bit for bit that of the same cache with every layer building its own."""
    model = tiny_model("v3")
    ids = prompt(40, seed=11).repeat(2, 1)
    enable_quantmla(model, "C4R4", sink=SINK, local=LOCAL, backend=BACKEND, page_size=16)
    shared, own = QuantMLACache(model), QuantMLACache(model)
    for layer in own.layers:
        layer.memo = None
    out = generate(model, ids, 12, cache=shared, num_beams=beams)
    want = generate(model, ids, 12, cache=own, num_beams=beams)
    assert torch.equal(out.sequences, want.sequences)
    assert all(torch.equal(a, b) for a, b in zip(out.logits, want.logits))
    assert shared.layers[1].paged.memo is shared.memo and own.layers[1].paged.memo is None
    assert shared.layers[1].paged.history == shared.layers[0].paged.history
    # 11 decode steps: layer 1 takes layer 0's write plan and attention plan in each (and the prefill's write plan)
    assert shared.memo.hits == 2 * 11 + 1, (shared.memo.hits, shared.memo.misses)


def test_disable_forgets_the_handle_and_a_decode_step_writes_every_row_at_once(monkeypatch):
    """``disable`` marks the handle off and takes it off the model (a later ``QuantMLACache(model)`` cannot pick up its
    options); while enabled, a decode step without rollback writes every row in one reservation
    (``_write_every_row``), not row by row, and keeps no undo records."""
    model = tiny_model("v3")
    handle = enable_quantmla(model, "C4R4", sink=SINK, local=LOCAL, backend=BACKEND)
    calls = []
    original = QuantMLALayer._write_every_row
    monkeypatch.setattr(QuantMLALayer, "_write_every_row", lambda self, *a: calls.append(1) or original(self, *a))
    cache = QuantMLACache(model)
    generate(model, prompt(20, seed=3), 3, cache=cache)
    assert len(calls) == 2 * 2  # two decode steps, two layers
    prefilled = QuantMLACache(model)
    generate(model, prompt(20, seed=3), 1, cache=prefilled)
    assert all(layer._undo == [] for layer in prefilled.layers)  # without rollback nothing is kept to take back
    assert not QuantMLALayer.is_compileable  # README: no torch.compile of generate() on this cache
    handle.disable()
    assert not handle.enabled and getattr(model, "_quantmla_handle", None) is None
    handle.disable()  # again: nothing to do
    assert not handle.enabled


def test_token_validity_reads_every_mask_form():
    """Which new tokens are real, from the mask forms ``transformers`` passes: 2-D flash style (1 = real), 4-D bool and
    4-D additive (also inside a per-layer-type dict); None when every token is real, when the mask is too short to
    say, or when there is no mask."""
    from quantmla_core.integrations.transformers import _token_validity

    flat = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1]])  # left padding, past 0
    want = flat[:, :4].bool()
    assert torch.equal(_token_validity(flat, 0, 4), want)
    assert _token_validity(flat, 2, 4) is None  # every token after the padding is real
    assert _token_validity(flat[:, :5], 2, 4) is None  # too short to say
    square = flat[:, None, None, :].bool().expand(3, 1, 4, 6)  # [B, 1, q, kv]: each query sees the real keys
    assert torch.equal(_token_validity(square, 0, 4), want)
    additive = torch.zeros(3, 1, 4, 6).masked_fill(~square, torch.finfo(torch.float32).min)
    assert torch.equal(_token_validity({"full_attention": additive}, 0, 4), want)
    assert _token_validity(additive[..., :3], 0, 4) is None
    assert _token_validity(None, 0, 4) is None and _token_validity(flat[0], 0, 4) is None
