"""QuantMLA transforms (DESIGN.md §6): maps, exactness, inverses, persistence."""

from __future__ import annotations

import pytest
import torch

from quantmla_core.transforms import (
    ContentTransform,
    RopeTransform,
    cayley,
    hadamard,
    load_transforms,
    rope_pair_indices,
    save_transforms,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _random_content(d: int, seed: int = 0, dtype=torch.float64) -> ContentTransform:
    g = torch.Generator().manual_seed(seed)
    t = ContentTransform(d, gamma=torch.exp(0.3 * torch.randn(d, generator=g)),
                         log_scale=torch.randn(d, generator=g), dtype=dtype)
    t.A.data.copy_(0.3 * torch.randn(d, d, generator=g, dtype=dtype))
    return t


def _random_rope(d: int, layout: str, cache_layout: str | None = None, seed: int = 0, dtype=torch.float64) -> RopeTransform:
    g = torch.Generator().manual_seed(seed)
    return RopeTransform(d, layout, cache_layout, log_scale=torch.randn(d // 2, generator=g) * 1.5,
                         angle=torch.rand(d // 2, generator=g) * 6.3, dtype=dtype)


def test_cayley_orthogonal_and_identity_at_zero():
    a = torch.randn(32, 32, dtype=torch.float64)
    r = cayley(a)
    assert torch.allclose(r @ r.T, torch.eye(32, dtype=torch.float64), atol=1e-12)
    assert torch.linalg.det(r) > 0
    assert torch.equal(cayley(torch.zeros(8, 8)), torch.eye(8))
    # 2 x 2: K = [[0, t], [-t, 0]] gives the rotation with cos = (1 - t^2) / (1 + t^2), sin = 2t / (1 + t^2)
    t2 = 0.5
    want = torch.tensor([[1 - t2**2, 2 * t2], [-2 * t2, 1 - t2**2]], dtype=torch.float64) / (1 + t2**2)
    assert torch.allclose(cayley(torch.tensor([[0.3, t2], [0.0, -1.2]], dtype=torch.float64)), want, atol=1e-14)
    t = ContentTransform(16)
    assert torch.allclose(t.R, torch.eye(16)) and torch.allclose(t.s, torch.ones(16))


def test_hadamard_orthogonal():
    h = hadamard(64, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(64, dtype=torch.float64), atol=1e-12)
    with pytest.raises(ValueError):
        hadamard(48)


def test_log_scale_clipped():
    t = ContentTransform(4, log_scale=torch.tensor([-5.0, -1.0, 1.0, 5.0]))
    assert torch.allclose(t.s.log(), torch.tensor([-2.0, -1.0, 1.0, 2.0]))
    r = RopeTransform(4, log_scale=torch.tensor([3.0, -3.0]))
    assert torch.allclose(r.s.log(), torch.tensor([2.0, -2.0]))


def test_content_scores_and_values_exact():
    d = 64
    t = _random_content(d)
    u = torch.randn(10, d, dtype=torch.float64)
    u = u / u.pow(2).mean(-1, keepdim=True).sqrt()
    c = u * t.gamma
    qc = torch.randn(3, d, dtype=torch.float64)
    z = t.apply_to_normalized(u)
    assert torch.allclose(t.apply_to_cache(c), z, atol=1e-12)
    # scores kept: q~ . z = qc . c
    assert torch.allclose(t.apply_to_query(qc) @ z.T, qc @ c.T, atol=1e-10)
    # inverse maps back to the native cache and query
    assert torch.allclose(t.inverse(z), c, atol=1e-12)
    assert torch.allclose(t.inverse_query(t.apply_to_query(qc)), qc, atol=1e-10)
    # RMSNorm commutes with the orthogonal map
    raw = torch.randn(10, d, dtype=torch.float64)
    rms = lambda x: x / x.pow(2).mean(-1, keepdim=True).sqrt()
    assert torch.allclose(rms(raw @ t.R), rms(raw) @ t.R, atol=1e-12)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
@pytest.mark.parametrize("d", [32, 64])
def test_rope_keeps_every_qk(layout, d):
    t = _random_rope(d, layout)
    q = torch.randn(5, 7, d, dtype=torch.float64)
    k = torch.randn(11, d, dtype=torch.float64)
    ref = q @ k.T
    got = t.apply_to_query(q) @ t.apply_to_cache(k).T
    assert torch.allclose(got, ref, rtol=0, atol=1e-12 * ref.abs().max().item())
    assert torch.allclose(t.inverse(t.apply_to_cache(k)), k, atol=1e-12)
    assert torch.allclose(t.inverse_query(t.apply_to_query(q)), q, atol=1e-12)
    # one complex scalar per pair: pair norms scale by s_i, other pairs untouched
    p = rope_pair_indices(d, layout)
    kk = t.apply_to_cache(k)
    n0 = k[:, p[:, 0]] ** 2 + k[:, p[:, 1]] ** 2
    n1 = kk[:, p[:, 0]] ** 2 + kk[:, p[:, 1]] ** 2
    assert torch.allclose(n1, n0 * t.s.double() ** 2, rtol=1e-12)


@pytest.mark.parametrize("layout", ["interleaved", "half"])
def test_rope_transform_commutes_with_rope(layout):
    """A per-pair complex scalar commutes with RoPE for every position (so it can be fused pre-RoPE)."""
    d = 32
    t = _random_rope(d, layout)
    p = rope_pair_indices(d, layout)
    inv_freq = 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)

    def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos[:, None] * inv_freq
        a, b = x[:, p[:, 0]], x[:, p[:, 1]]
        out = x.clone()
        out[:, p[:, 0]] = a * ang.cos() - b * ang.sin()
        out[:, p[:, 1]] = b * ang.cos() + a * ang.sin()
        return out

    x = torch.randn(20, d, dtype=torch.float64)
    pos = torch.arange(20, dtype=torch.float64) * 37
    assert torch.allclose(rope(t.apply_to_cache(x), pos), t.apply_to_cache(rope(x, pos)), atol=1e-10)


def test_rope_raw_vs_cache_layout():
    """V3 rope_interleave: raw pairs (2i, 2i+1) -> cached [even | odd]; both maps agree after the reorder."""
    d = 16
    t = _random_rope(d, "interleaved", "half")
    x = torch.randn(4, d, dtype=torch.float64)
    reorder = torch.cat([torch.arange(0, d, 2), torch.arange(1, d, 2)])
    assert torch.allclose(t.apply_to_cache(x, raw=True)[:, reorder], t.apply_to_cache(x[:, reorder]), atol=1e-12)


def test_rope_bad_layout():
    with pytest.raises(ValueError, match="layout"):
        RopeTransform(8, "neox")
    with pytest.raises(ValueError, match="dim"):
        RopeTransform(7)


def test_save_load_round_trip(tmp_path):
    c = _random_content(32, dtype=torch.float32)
    r = _random_rope(16, "interleaved", "half", dtype=torch.float32)
    c.save(tmp_path / "c")
    r.save(tmp_path / "r.safetensors")
    assert (tmp_path / "c.json").exists() and (tmp_path / "r.safetensors").exists()
    c2, r2 = ContentTransform.load(tmp_path / "c"), RopeTransform.load(tmp_path / "r")
    assert torch.equal(c2.R, c.R) and torch.equal(c2.s, c.s) and torch.equal(c2.gamma, c.gamma)
    assert (r2.layout, r2.cache_layout) == ("interleaved", "half")
    x = torch.randn(3, 16)
    assert torch.equal(r2.apply_to_cache(x), r.apply_to_cache(x))
    save_transforms(tmp_path / "all", {0: c, 3: c2}, {0: r, 3: r2}, meta={"format": "C4R4"})
    cs, rs, meta = load_transforms(tmp_path / "all")
    assert sorted(cs) == [0, 3] and sorted(rs) == [0, 3] and meta["format"] == "C4R4"
    assert torch.equal(cs[3].R, c.R) and torch.equal(rs[0].phi, r.phi)


def test_gradients_flow():
    t = ContentTransform(16)
    r = RopeTransform(8)
    u = torch.randn(4, 16)
    loss = (t.inverse(t.apply_to_normalized(u) ** 2)).sum() + (r.apply_to_cache(torch.randn(2, 8)) ** 3).sum()
    loss.backward()
    assert t.A.grad is not None and t.log_s.grad is not None and r.phi.grad is not None and r.log_s.grad is not None


def test_layer_view_prefers_the_module_and_falls_back_to_its_config():
    """A transformers MLA module's dims come from its own attributes where set, else from its ``config`` (modules of
    some families keep only the config)."""
    from types import SimpleNamespace

    from torch import nn

    from quantmla_core.transforms import _LayerView

    m = nn.Module()
    m.kv_a_proj_with_mqa, m.kv_a_layernorm = nn.Linear(8, 40), nn.LayerNorm(32)
    m.kv_b_proj, m.q_proj = nn.Linear(32, 64), nn.Linear(8, 48)
    m.kv_lora_rank, m.qk_rope_head_dim = 32, None  # None: not set on the module
    m.config = SimpleNamespace(kv_lora_rank=999, qk_rope_head_dim=8, qk_nope_head_dim=16, num_attention_heads=2)
    v = _LayerView.of(m)
    assert (v.num_heads, v.d_c, v.d_r, v.qk_nope_head_dim) == (2, 32, 8, 16)
    assert v.q_out_proj is m.q_proj and v.kv_b_proj is m.kv_b_proj
