"""Protected tokens (DESIGN.md §3.5): sink and local ring semantics, routing, never twice."""

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref

P = 16
SINK, LOCAL = 4, 8
BACKENDS = ["reference", "torch"]


def _fmt(name="C4R4"):
    return qm.PackFormat.parse(name, latent_dim=64, rope_dim=32, group_size=32, page_size=P)


def _write_request(cache, seq, tokens_c, tokens_r, start, length_after, backend, pages):
    n = tokens_c.shape[0]
    pos = np.arange(start, start + n)
    slots = np.asarray(pages)[pos // P] * P + pos % P
    lens = np.zeros(cache.max_seqs, np.int64)
    lens[seq] = length_after
    qm.write(cache, torch.from_numpy(tokens_c), torch.from_numpy(tokens_r), slot_mapping=torch.from_numpy(slots),
             seq_ids=torch.full((n,), seq), positions=torch.from_numpy(pos), seq_lens=torch.from_numpy(lens),
             backend=backend)


def _data(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 64)).astype(np.float32), rng.standard_normal((n, 32)).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompt_in_one_call_keeps_last_local_in_ring(backend):
    c, r = _data(100)
    cache = qm.MLACache.allocate(_fmt(), 8, 1, SINK, LOCAL, device="cpu", protect_dtype=torch.float32)
    _write_request(cache, 0, c, r, 0, 100, backend, list(range(7)))
    both = np.concatenate([c, r], 1)
    assert np.array_equal(cache.sink_buf[0].numpy(), both[:SINK])
    for n in range(100 - LOCAL, 100):
        assert np.array_equal(cache.local_buf[0, n % LOCAL].numpy(), both[n])


@pytest.mark.parametrize("backend", BACKENDS)
def test_incremental_equals_one_shot(backend):
    c, r = _data(45, seed=1)
    pages = [3, 0, 2]
    one = qm.MLACache.allocate(_fmt(), 4, 2, SINK, LOCAL, device="cpu", protect_dtype=torch.float32)
    inc = qm.MLACache.allocate(_fmt(), 4, 2, SINK, LOCAL, device="cpu", protect_dtype=torch.float32)
    one.pages.fill_(7)
    inc.pages.fill_(7)
    _write_request(one, 1, c, r, 0, 45, backend, pages)
    _write_request(inc, 1, c[:30], r[:30], 0, 30, backend, pages)
    for n in range(30, 45):
        _write_request(inc, 1, c[n : n + 1], r[n : n + 1], n, n + 1, backend, pages)
    assert torch.equal(one.pages, inc.pages)
    assert torch.equal(one.sink_buf, inc.sink_buf)
    assert torch.equal(one.local_buf, inc.local_buf)


@pytest.mark.parametrize("length", [1, 3, SINK, SINK + 1, SINK + LOCAL - 1, SINK + LOCAL, SINK + LOCAL + 1, P - 1, P, P + 1, 2 * P, 70])
def test_operands_route_each_token_once(length):
    """Token n comes from the sink buffer if n < sink, else the ring if n >= L - local, else its packed copy."""
    c, r = _data(length, seed=length)
    pages = list(range((length + P - 1) // P))[::-1]
    cache = qm.MLACache.allocate(_fmt(), len(pages), 1, SINK, LOCAL, device="cpu", protect_dtype=torch.float32)
    _write_request(cache, 0, c, r, 0, length, "reference", pages)
    got_c, got_r = ref.gather_request(cache, np.asarray(pages), length, 0)
    for n in range(length):
        protected = n < SINK or n >= length - LOCAL
        if protected:
            assert np.array_equal(got_c[n], c[n].astype(np.float64)), n
            assert np.array_equal(got_r[n], r[n].astype(np.float64)), n
        else:
            pc, pr = ref.read_token(cache, pages[n // P] * P + n % P)
            assert np.array_equal(got_c[n], pc) and np.array_equal(got_r[n], pr), n
            assert not np.array_equal(got_c[n], c[n])  # quantized copy differs from the original


def _grid_exact(n, d, group, bits, rng):
    """Values s*(q - z) whose groups span exactly [-z s, (m - z) s]: quantization is lossless."""
    m = 2**bits - 1
    x = np.empty((n, d), np.float32)
    for t in range(n):
        for g in range(d // group):
            s = 2.0 ** rng.integers(-3, 2)
            z = rng.integers(0, m + 1)
            q = rng.integers(0, m + 1, group)
            q[rng.integers(group)] = 0
            q[(rng.integers(1, group) + np.argmin(q)) % group] = m
            x[t, g * group : (g + 1) * group] = s * (q - z)
    return x


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["C4R4", "C2R4", "C8R8", "BF16"])
@pytest.mark.parametrize("sink,local", [(SINK, LOCAL), (0, 0), (0, 5), (3, 0)])
def test_grid_exact_attention_equals_unquantized(backend, name, sink, local):
    rng = np.random.default_rng(7)
    fmt = _fmt(name)
    bits_c = fmt.content_bits if fmt.quantized else 4
    bits_r = fmt.rope_bits if fmt.quantized else 4
    lens = [37, 5, 16]
    c = [_grid_exact(n, 64, 32, bits_c, rng) for n in lens]
    r = [_grid_exact(n, 32, 32, bits_r, rng) for n in lens]
    table = np.array([[4, 1, 6], [0, 0, 0], [2, 0, 0]], np.int32)
    cache = qm.MLACache.allocate(fmt, 7, 3, sink, local, device="cpu", protect_dtype=torch.float32)
    cache.pages.fill_(0x5A)
    for s, n in enumerate(lens):
        _write_request(cache, s, c[s], r[s], 0, n, backend, table[s])
    s_q, h = 3, 4
    q = rng.standard_normal((3, s_q, h, 64)).astype(np.float32)
    qr = rng.standard_normal((3, s_q, h, 32)).astype(np.float32)
    args = dict(block_table=torch.from_numpy(table), seq_lens=torch.tensor(lens, dtype=torch.int32),
                seq_ids=torch.arange(3), softmax_scale=0.1)
    if backend == "reference":  # the oracle itself, in float64: exact to rounding
        out, lse = ref.decode_attention(q, qr, cache, *args.values())
        tol = 1e-12
    else:
        out, lse = qm.attention(torch.from_numpy(q), torch.from_numpy(qr), cache, backend=backend, **args)
        out, lse, tol = out.double().numpy(), lse.double().numpy(), 1e-5
    for s in range(3):
        want, want_lse = ref.mla_attention(q[s], qr[s], c[s], r[s], 0.1)
        assert np.abs(out[s] - want).max() <= tol * max(1.0, np.abs(want).max())
        assert np.abs(lse[s] - want_lse).max() <= tol * 10


def test_causal_mask_for_speculative_queries():
    """With S_q = 3 and L = 10, query i sees exactly tokens < 8 + i."""
    rng = np.random.default_rng(3)
    c, r = rng.standard_normal((10, 64)), rng.standard_normal((10, 32))
    q, qr = rng.standard_normal((3, 2, 64)), rng.standard_normal((3, 2, 32))
    out, lse = ref.mla_attention(q, qr, c, r, 0.2)
    for i in range(3):
        o, l = ref.mla_attention(q[i : i + 1], qr[i : i + 1], c[: 8 + i], r[: 8 + i], 0.2)
        np.testing.assert_allclose(out[i], o[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse[i], l[0], rtol=1e-12)
    scores = 0.2 * (q[0] @ c[:8].T + qr[0] @ r[:8].T)
    np.testing.assert_allclose(lse[0], np.log(np.exp(scores).sum(-1)), rtol=1e-12)
