"""PagedMLACache: allocation, append across pages, free, fork, attention through the allocator."""

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.paged import OutOfPagesError

FMT = qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32, page_size=16)


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 256, generator=g), torch.randn(n, 32, generator=g)


@pytest.mark.parametrize("device", ["cpu", "numpy"])
def test_append_many_then_attention_matches_reference(device):
    pc = qm.PagedMLACache(FMT, num_pages=20, max_seqs=4, sink=2, local=8, device=device, backend="reference" if device == "numpy" else "torch")
    a, b = pc.add_request(), pc.add_request()
    ca, ra = _tokens(37, 1)
    cb, rb = _tokens(5, 2)
    conv = (lambda t: t.numpy()) if device == "numpy" else (lambda t: t)
    pc.append_many([(a, conv(ca), conv(ra)), (b, conv(cb), conv(rb))])
    for step in range(3):  # decode steps
        c1, r1 = _tokens(1, 10 + step)
        pc.append(a, conv(c1), conv(r1))
    assert pc.seq_len(a) == 40 and pc.seq_len(b) == 5
    assert pc.num_free_pages == 20 - 3 - 1
    q = torch.randn(2, 3, 256)
    qr = torch.randn(2, 3, 32)
    out, lse = pc.attention(conv(q), conv(qr), [a, b], softmax_scale=0.07)
    want, want_lse = ref.decode_attention(q, qr, pc.cache, pc.block_table([a, b]), pc.seq_lens([a, b]),
                                          np.array([a, b]), 0.07)
    assert np.allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    assert np.allclose(np.asarray(lse), want_lse, atol=1e-4)


def test_free_and_reuse_and_out_of_pages():
    pc = qm.PagedMLACache(FMT, num_pages=3, max_seqs=2, device="cpu", backend="torch")
    a = pc.add_request()
    c, r = _tokens(40, 0)
    pc.append(a, c, r)
    assert pc.num_free_pages == 0
    b = pc.add_request()
    with pytest.raises(OutOfPagesError, match="needs 1 pages, 0 free"):
        pc.append(b, c[:1], r[:1])
    assert pc.seq_len(b) == 0  # a failed append changes nothing
    with pytest.raises(OutOfPagesError, match="request rows"):
        pc.add_request()
    pc.free(a)
    assert pc.num_free_pages == 3
    pc.append(b, c[:17], r[:17])
    assert pc.seq_len(b) == 17
    with pytest.raises(ValueError, match="seq_id: expected a live request id"):
        pc.seq_len(a)


def test_fork_copies_tokens():
    pc = qm.PagedMLACache(FMT, num_pages=8, max_seqs=3, sink=2, local=4, device="cpu", backend="torch")
    a = pc.add_request()
    c, r = _tokens(20, 3)
    pc.append(a, c, r)
    b = pc.fork(a)
    c2, r2 = _tokens(1, 4)
    pc.append(b, c2, r2)
    q, qr = torch.randn(1, 2, 256), torch.randn(1, 2, 32)
    out_a = pc.attention(q, qr, [a], softmax_scale=0.1, return_lse=False)
    pc.free(b)
    out_a2 = pc.attention(q, qr, [a], softmax_scale=0.1, return_lse=False)
    assert torch.equal(out_a, out_a2)
    assert pc.seq_len(a) == 20


def test_allocated_bytes_match_design_accounting():
    fmt = qm.PackFormat.parse("C4R4")
    pc = qm.PagedMLACache(fmt, num_pages=2048, max_seqs=1, device="cpu")
    assert pc.allocated_bytes() == qm.memory_bytes(fmt, 2048 * 64)


def test_multi_layer_cache_shares_page_table():
    pc = qm.PagedMLACache(FMT, num_pages=6, max_seqs=2, sink=1, local=3, device="cpu", backend="torch", num_layers=3)
    a, b = pc.add_request(), pc.add_request()
    data = [_tokens(25, 20 + i) for i in range(3)]
    plan = pc.reserve([(a, 20), (b, 5)])
    assert plan.num_tokens == 25 and pc.seq_len(a) == 20
    for i, (c, r) in enumerate(data):
        pc.write(plan, c, r, layer=i)
    with pytest.raises(ValueError, match="append_many: this cache has 3 layers"):
        pc.append_many([(a, data[0][0][:1], data[0][1][:1])])
    q, qr = torch.randn(2, 2, 256), torch.randn(2, 2, 32)
    outs = [pc.attention(q, qr, [a, b], 0.1, layer=i, return_lse=False) for i in range(3)]
    single = qm.PagedMLACache(FMT, num_pages=6, max_seqs=2, sink=1, local=3, device="cpu", backend="torch")
    sa, sb = single.add_request(), single.add_request()
    single.append_many([(sa, data[2][0][:20], data[2][1][:20]), (sb, data[2][0][20:], data[2][1][20:])])
    assert torch.equal(outs[2], single.attention(q, qr, [sa, sb], 0.1, return_lse=False))
    assert not torch.equal(outs[0], outs[2])
    assert pc.allocated_bytes() == 3 * single.allocated_bytes()
    # one plan for the step, run on every layer: the same results bit for bit
    step = pc.plan_attention([a, b], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)
    assert step.backend == "torch"
    for i in range(3):
        assert torch.equal(step.run(q, qr, pc.layer(i), return_lse=False), outs[i])
    with pytest.raises(ValueError, match="layer: expected 0 <= layer < 3"):
        pc.layer(3)


@pytest.mark.parametrize("device", ["cpu", "numpy"])
def test_grow_keeps_pages_rows_and_contents(device):
    pc = qm.PagedMLACache(FMT, num_pages=2, max_seqs=1, sink=1, local=4, device=device, backend="reference", num_layers=2)
    a = pc.add_request()
    c, r = _tokens(20, 5)
    conv = (lambda t: t.numpy()) if device == "numpy" else (lambda t: t)
    plan = pc.reserve([(a, 20)])
    for i in range(2):
        pc.write(plan, conv(c), conv(r), layer=i)
    q, qr = torch.randn(1, 2, 256), torch.randn(1, 2, 32)
    before = np.asarray(pc.attention(conv(q), conv(qr), [a], 0.1, layer=1, return_lse=False))
    pc.grow(min_free_pages=3, min_free_rows=2)
    assert pc.num_free_pages == 3 and pc.layer(1).num_pages == 5 and pc.cache.max_seqs == 3  # 2 + max(3 needed, 2 doubling)
    after = np.asarray(pc.attention(conv(q), conv(qr), [a], 0.1, layer=1, return_lse=False))
    assert np.array_equal(before, after)
    b = pc.add_request()
    plan = pc.reserve([(b, 40)])
    assert pc.pages_in_use == 2 + 3
    kept = pc.layer(0)
    pc.grow(0, 0)  # nothing needed: no change, not even a copy
    assert pc.layer(0) is kept and pc.layer(0).num_pages == 5
    pc.grow(min_free_rows=2)  # rows only (one of three is free): the pages stay as they are, with none free
    assert pc.num_free_pages == 0 and pc.layer(0).num_pages == 5 and pc.cache.max_seqs == 3 + 1


def test_decode_reserve_slots_match_prefill_layout():
    """One-token appends (the decode fast path) land where a multi-token append would put them,
    across page boundaries, and advance the lengths the same way."""
    a = qm.PagedMLACache("C4R4", 16, 2, 0, 0, device="numpy")
    b = qm.PagedMLACache("C4R4", 16, 2, 0, 0, device="numpy")
    sa, sb = a.add_request(), b.add_request()
    p = a.format.page_size
    bulk = a.reserve([(sa, p + 3)])
    singles = [b.reserve([(sb, 1)]) for _ in range(p + 3)]
    assert np.array_equal(np.concatenate([s.slot_mapping for s in singles]), bulk.slot_mapping)
    assert np.array_equal(np.concatenate([s.positions for s in singles]), bulk.positions)
    assert np.array_equal(singles[-1].seq_lens, bulk.seq_lens) and b.seq_len(sb) == p + 3


def test_truncate_frees_the_pages_past_the_new_length():
    c = qm.PagedMLACache("C4R4", num_pages=6, max_seqs=2, device="cpu")
    s = c.add_request()
    c.append(s, torch.randn(150, 512), torch.randn(150, 64))  # 3 pages of 64
    assert c.num_free_pages == 3
    c.truncate(s, 128)
    assert c.seq_len(s) == 128 and c.num_free_pages == 4 and c.block_table([s]).shape == (1, 2)
    c.truncate(s, 0)
    assert c.seq_len(s) == 0 and c.num_free_pages == 6
    assert c.block_table([s]).shape == (1, 1)  # a table is at least one page wide
    with pytest.raises(ValueError, match="length: expected 0 <= length <= 0"):
        c.truncate(s, 1)
    with pytest.raises(ValueError, match="seq_id: expected a live request id"):
        c.truncate(s + 1, 0)


def test_index_tensor_values_and_dtype():
    from quantmla_core.host_copy import index_tensor

    t = index_tensor([3, -1, 70000], np.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [3, -1, 70000]
    table = np.arange(12, dtype=np.int64).reshape(3, 4)[:, ::2]  # not contiguous
    t = index_tensor(table, np.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == table.tolist()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: counts stream synchronizations")
def test_decode_step_moves_its_indices_without_a_stream_sync():
    """A decode step through the allocator (reserve + write, page table, lengths, ids, attention) queues its work
    without waiting for the GPU: its index arrays go up from pinned memory (a pageable copy synchronizes the stream,
    once per array and layer in the Hugging Face integration before stop 45). The GPU backends only: the torch
    backend reads lengths on the host by design."""
    backend = "auto"
    fmt = qm.PackFormat.parse("C4R4", latent_dim=512, rope_dim=64)
    dev = torch.device("cuda")
    pc = qm.PagedMLACache(fmt, num_pages=64, max_seqs=4, device=dev, backend=backend)
    rows = [pc.add_request() for _ in range(3)]
    g = torch.Generator(device=dev).manual_seed(0)
    prompt = [(s, torch.randn(300 + 50 * s, 512, device=dev, generator=g, dtype=torch.bfloat16),
               torch.randn(300 + 50 * s, 64, device=dev, generator=g, dtype=torch.bfloat16)) for s in rows]
    pc.append_many(prompt)
    q = torch.randn(3, 16, 512, device=dev, generator=g, dtype=torch.bfloat16)
    qr = torch.randn(3, 16, 64, device=dev, generator=g, dtype=torch.bfloat16)

    def step(seed: int):
        new = [(s, torch.randn(1, 512, device=dev, generator=g, dtype=torch.bfloat16),
                torch.randn(1, 64, device=dev, generator=g, dtype=torch.bfloat16)) for s in rows]
        pc.append_many(new)
        return qm.attention(q, qr, pc.cache, block_table=pc.block_table(rows), seq_lens=pc.seq_lens(rows),
                            seq_ids=qm.host_copy.index_tensor(rows, np.int32, dev), softmax_scale=0.04,
                            backend=backend, return_lse=False)

    step(0)  # builds and caches the kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = step(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = qm.attention(q, qr, pc.cache, block_table=pc.block_table(rows), seq_lens=pc.seq_lens(rows),
                        seq_ids=qm.host_copy.index_tensor(rows, np.int32, dev), softmax_scale=0.04, backend="torch",
                        return_lse=False)
    assert torch.isfinite(out.float()).all() and (out.float() - want.float()).abs().max() < 2e-2
