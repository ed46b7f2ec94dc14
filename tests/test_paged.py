"""PagedMLACache: allocation, append across pages, free, fork, attention through the allocator."""

import itertools

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

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


def test_step_memo_keeps_the_latest_entries():
    memo = qm.StepMemo(capacity=2)
    made = []

    def make(v):
        return lambda: made.append(v) or v

    assert memo.get("a", make(1)) == 1 and memo.get("b", make(2)) == 2
    assert memo.get("a", make(-1)) == 1  # kept: not made again, and now the most recent
    assert memo.get("c", make(3)) == 3  # "b" is the least recently used: dropped
    assert memo.get("b", make(4)) == 4 and memo.get("c", make(-1)) == 3
    assert made == [1, 2, 3, 4] and (memo.hits, memo.misses) == (2, 4) and len(memo) == 2
    memo.clear()
    assert len(memo) == 0 and memo.get("c", make(5)) == 5
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="capacity: expected an integer >= 1"):
            qm.StepMemo(capacity=bad)
    with pytest.raises(TypeError, match="memo: expected a StepMemo or None, got dict"):
        qm.PagedMLACache(FMT, num_pages=2, max_seqs=1, device="cpu", memo={})


def _lockstep_ops(pc, seed):
    """Bookkeeping and writes of a few steps: prefill, decode steps across a page boundary, a fork, a free, a
    truncate and a grow; yields after each so that callers compare the allocators in between."""
    a, b = pc.add_request(), pc.add_request()
    plans = [pc.reserve([(a, 14), (b, 3)])]
    yield plans[-1]
    for step in range(4):
        plans.append(pc.reserve([(a, 1), (b, 1)]))
        yield plans[-1]
    c = pc.fork(a)
    plans.append(pc.reserve([(a, 1), (b, 1), (c, 2)]))
    yield plans[-1]
    pc.free(b)
    pc.truncate(a, 15)
    plans.append(pc.reserve([(c, 1), (a, 1)]))
    yield plans[-1]
    pc.grow(min_free_pages=pc.num_free_pages + 4)
    plans.append(pc.reserve([(c, 17), (a, 1)]))
    yield plans[-1]


def _plan_arrays(plan):
    return [np.asarray(x).tolist() for x in (plan.slot_mapping, plan.seq_ids, plan.positions, plan.seq_lens)]


def test_allocators_in_lockstep_share_a_steps_arrays():
    """Two allocators sharing a memo, driven by the same operations (a model's layers): the second takes the first's
    write plans, page tables and attention plans (the same objects), each equal to what an allocator without a memo
    builds, and attention through them is bit for bit that of the allocator without a memo."""
    memo = qm.StepMemo()
    kw = dict(num_pages=6, max_seqs=3, sink=2, local=4, device="cpu", backend="torch")
    first, second, alone = (qm.PagedMLACache(FMT, memo=memo, **kw), qm.PagedMLACache(FMT, memo=memo, **kw),
                            qm.PagedMLACache(FMT, **kw))
    q, qr = torch.randn(3, 2, 256), torch.randn(3, 2, 32)
    for step, (p1, p2, p0) in enumerate(zip(*(_lockstep_ops(pc, 0) for pc in (first, second, alone)))):
        assert p2 is p1 and _plan_arrays(p1) == _plan_arrays(p0), step
        assert first.history == second.history == alone.history  # the operations, not the memo
        c, r = _tokens(p0.num_tokens, 60 + step)
        for pc, plan in ((first, p1), (second, p2), (alone, p0)):
            pc.write(plan, c, r)
        ids = first.active_requests
        got = [pc.attention(q[: len(ids)], qr[: len(ids)], ids, 0.1, return_lse=False) for pc in (first, second)]
        want = alone.attention(q[: len(ids)], qr[: len(ids)], ids, 0.1, return_lse=False)
        assert torch.equal(got[0], want) and torch.equal(got[1], want), step
        plans = [pc.plan_attention(ids, num_heads=2, q_dtype=torch.float32, softmax_scale=0.1) for pc in (first, second)]
        assert plans[1] is plans[0]
        assert torch.equal(plans[1].run(q[: len(ids)], qr[: len(ids)], second.cache, return_lse=False), want)
    assert first.layer(0).num_pages == second.layer(0).num_pages == alone.layer(0).num_pages > 6
    assert memo.hits >= 3 * 8 and alone.memo is None


def test_allocators_that_differ_share_nothing():
    """Two allocators on one memo whose requests hold the same lengths in other pages (their histories differ): each
    gets its own slots and page table, never the other's."""
    memo = qm.StepMemo()
    one, two = (qm.PagedMLACache(FMT, num_pages=8, max_seqs=2, device="cpu", backend="torch", memo=memo)
                for _ in range(2))
    a1, b1, a2, b2 = one.add_request(), one.add_request(), two.add_request(), two.add_request()
    one.reserve([(a1, 20), (b1, 20)])
    two.reserve([(b2, 20), (a2, 20)])  # the same lengths, pages handed out in the other order
    s1, s2 = one.reserve([(a1, 1), (b1, 1)]), two.reserve([(a2, 1), (b2, 1)])
    assert s1 is not s2 and np.asarray(s1.slot_mapping).tolist() != np.asarray(s2.slot_mapping).tolist()
    assert np.asarray(s2.slot_mapping).tolist() == [two._pages[a2][1] * 16 + 4, two._pages[b2][1] * 16 + 4]
    t1 = one.plan_attention([a1, b1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)
    t2 = two.plan_attention([a2, b2], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)
    assert t1 is not t2
    assert two.block_table([a2, b2]).tolist() == [two._pages[a2], two._pages[b2]] != one.block_table([a1, b1]).tolist()
    assert memo.hits == 0


def test_grow_drops_the_plans_over_the_old_arrays():
    """A plan holds its cache's arrays: once an allocator grows, the memo lets go of the plans over its old ones (and
    keeps the rest), so the old pages are freed at once."""
    memo = qm.StepMemo()
    kw = dict(num_pages=2, max_seqs=1, device="cpu", backend="torch", memo=memo)
    pc, other = qm.PagedMLACache(FMT, **kw), qm.PagedMLACache(FMT, **kw)

    def plan(c):
        return c.plan_attention(c.active_requests, num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)

    for c in (pc, other):
        c.reserve([(c.add_request(), 3)])
    first = plan(pc)
    assert plan(other) is first and first.cache is pc.cache and len(memo) == 3  # write plan, arrays, plan
    old = pc.cache
    pc.grow(min_free_pages=4)
    assert len(memo) == 2 and pc.cache is not old  # the plan over the old arrays is gone, the rest kept
    again = plan(other)  # other has not grown: its arrays are still shared, its plan made anew over its own cache
    assert again is not first and again.cache is other.cache and len(memo) == 3
    other.grow(min_free_pages=4)
    assert len(memo) == 2
    assert plan(pc).cache is pc.cache and plan(other).cache is pc.cache  # in lockstep again after both grew


def _truncated(c):
    c.truncate(0, 5)


def _refilled(c):
    c.free(0)
    assert c.add_request() == 0  # the same request id, now empty


def _forked(c):
    assert c.fork(0) == 1  # request 1 now holds request 0's 20 tokens


def _grown(c):
    c.grow(min_free_pages=6, min_free_rows=3)


@pytest.mark.parametrize("operation", [_truncated, _refilled, _forked, _grown])
def test_an_allocator_that_ran_one_more_operation_shares_nothing(operation):
    """Two allocators on one memo, the second with one more operation (truncate, free and add, fork, grow) before a
    step that asks the same of both: the second's write plan, page table and attention plan are its own, equal to
    those of an allocator without a memo that ran the same operations."""
    memo = qm.StepMemo()
    kw = dict(num_pages=6, max_seqs=3, sink=1, local=2, device="cpu", backend="torch")
    same, other, alone = (qm.PagedMLACache(FMT, memo=memo, **kw), qm.PagedMLACache(FMT, memo=memo, **kw),
                          qm.PagedMLACache(FMT, **kw))
    prompt = _tokens(20, 71)
    for c in (same, other, alone):
        c.write(c.reserve([(c.add_request(), 20)]), *prompt)
    for c in (other, alone):
        operation(c)
    for c in (same, other, alone):
        if c.active_requests == [0]:
            c.add_request()
    plans = [c.reserve([(0, 1), (1, 1)]) for c in (same, other, alone)]
    assert plans[1] is not plans[0] and _plan_arrays(plans[1]) == _plan_arrays(plans[2])
    assert other.block_table([0, 1]).tolist() == alone.block_table([0, 1]).tolist()
    for c, plan in zip((same, other, alone), plans):
        c.write(plan, *_tokens(2, 70))
    q, qr = torch.randn(2, 2, 256), torch.randn(2, 2, 32)
    steps = [c.plan_attention([0, 1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1) for c in (same, other)]
    assert steps[1] is not steps[0]
    want = alone.attention(q, qr, [0, 1], 0.1, return_lse=False)
    assert torch.equal(steps[1].run(q, qr, other.cache, return_lse=False), want)
    assert torch.equal(other.attention(q, qr, [0, 1], 0.1, return_lse=False), want)


def test_a_freed_or_added_request_is_part_of_what_is_shared():
    """Freeing a request puts its pages back where the next request takes them, and a request added to one
    allocator only is live there only: neither allocator may take the other's arrays afterwards."""
    memo = qm.StepMemo()
    kw = dict(num_pages=8, max_seqs=3, device="cpu", backend="torch")
    kept, freed, alone = (qm.PagedMLACache(FMT, memo=memo, **kw), qm.PagedMLACache(FMT, memo=memo, **kw),
                          qm.PagedMLACache(FMT, **kw))
    for c in (kept, freed, alone):
        c.add_request(), c.add_request()
        c.reserve([(1, 20)])
    for c in (freed, alone):
        c.free(1)
    plans = [c.reserve([(0, 20)]) for c in (kept, freed, alone)]
    assert _plan_arrays(plans[1]) == _plan_arrays(plans[2]) != _plan_arrays(plans[0])
    kept.plan_attention([0, 1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)
    with pytest.raises(ValueError, match=r"seq_id: expected a live request id in \[0\], got 1"):
        freed.plan_attention([0, 1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1)
    one, two = (qm.PagedMLACache(FMT, memo=memo, **kw) for _ in range(2))
    one.add_request(), one.add_request(), two.add_request()
    for c in (one, two):
        c.reserve([(0, 5)])
    # unchecked lengths (the GPU default): request 1 of `one` is live and empty, in `two` it does not exist
    one.plan_attention([0, 1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1, validate=False)
    with pytest.raises(ValueError, match=r"seq_id: expected a live request id in \[0\], got 1"):
        two.plan_attention([0, 1], num_heads=2, q_dtype=torch.float32, softmax_scale=0.1, validate=False)


def test_reserve_counts_the_pages_of_a_request_named_twice():
    """Items of one request follow each other: two one-token items at 15 of 16 tokens need one new page (refused,
    changing nothing, where none is free), and at 0 tokens share one page."""
    pc = qm.PagedMLACache(FMT, num_pages=1, max_seqs=2, device="cpu", backend="torch")
    a = pc.add_request()
    pc.reserve([(a, 15)])
    with pytest.raises(OutOfPagesError, match="needs 1 pages, 0 free"):
        pc.reserve([(a, 1), (a, 1)])
    assert pc.seq_len(a) == 15 and pc.block_table([a]).tolist() == [[0]]
    with pytest.raises(ValueError, match="items: expected token counts >= 0, got -1 for request 0"):
        pc.reserve([(a, -1)])
    pc.free(a)
    b = pc.add_request()
    plan = pc.reserve([(b, 1), (b, 1)])  # one page for both
    assert plan.positions.tolist() == [0, 1] and plan.slot_mapping.tolist() == [0, 1] and pc.seq_len(b) == 2


def _apply(pc, op):
    """One bookkeeping operation drawn as three integers, read against ``pc``'s state; returns what it built (a write
    plan's arrays, a page table and lengths) or None. Operations that do not fit (no free row, too few pages) change
    nothing, as in an allocator."""
    kind, x, y = op
    live = pc.active_requests
    try:
        if kind == 0 or not live:
            pc.add_request()
        elif kind == 1:
            pc.free(live[x % len(live)])
        elif kind == 2:
            s = live[x % len(live)]
            pc.truncate(s, y % (pc.seq_len(s) + 1))
        elif kind == 3:
            pc.fork(live[x % len(live)])
        elif kind == 4:
            pc.grow(min_free_pages=x % 5, min_free_rows=y % 2)
        elif kind in (5, 6):  # drawn twice as often: writes are what later arrays differ by
            return _plan_arrays(pc.reserve([(s, (x >> i) % 3 + (y % 20 if i == 0 else 0) + (kind == 6))
                                            for i, s in enumerate(live)]))
        else:
            arrays = pc._attention_arrays(live)
            return [np.asarray(arrays[k]).tolist() for k in ("block_table", "seq_lens", "seq_ids")]
    except OutOfPagesError:
        return "out of pages"
    return None


OP = st.tuples(st.integers(0, 7), st.integers(0, 255), st.integers(0, 255))


@given(st.lists(OP, min_size=1, max_size=25), st.integers(0, 24), OP, st.booleans())
@example([(0, 0, 0), (5, 0, 15), (5, 0, 3)], 2, (2, 0, 5), True)  # a truncate inserted before a write
@example([(0, 0, 0), (5, 0, 15), (3, 0, 0), (5, 0, 3)], 2, (0, 0, 0), False)  # a fork replaced by an empty request
@example([(0, 0, 0), (5, 0, 15), (2, 0, 5), (5, 0, 3)], 2, (2, 0, 7), False)  # a truncate to another length
@settings(max_examples=400, deadline=None)
def test_allocators_on_one_memo_build_what_they_would_alone(ops, where, other, insert):
    """Property: two allocators on one StepMemo, the second running the first's operations with one more operation
    inserted (or one replaced), interleaved: after every operation each one's write plan, page table and lengths equal
    those of its own twin without a memo (a wrong share would hand one allocator the other's arrays). The requests an
    operation names are read off each allocator's live ones, so a freed or added request changes what the later steps
    ask for: those cases are the explicit tests above."""
    at = where % (len(ops) + insert)
    changed = ops[:at] + [other] + ops[at + (not insert):]
    memo = qm.StepMemo(capacity=8)
    kw = dict(num_pages=6, max_seqs=3, device="numpy")
    shared = [qm.PagedMLACache(FMT, memo=memo, **kw), qm.PagedMLACache(FMT, memo=memo, **kw)]
    alone = [qm.PagedMLACache(FMT, **kw), qm.PagedMLACache(FMT, **kw)]
    for a, b in itertools.zip_longest(ops, changed):
        for pc, twin, op in ((shared[0], alone[0], a), (shared[1], alone[1], b)):
            if op is not None:
                assert _apply(pc, op) == _apply(twin, op)
                assert pc.history == twin.history


def test_allocator_argument_edges():
    """One memo entry is a valid capacity; zero layers are refused; a new request of exactly one page needs one page;
    a write plan (shared through a memo) cannot be changed."""
    import dataclasses

    memo = qm.StepMemo(capacity=1)
    assert memo.get("a", lambda: 1) == 1 and memo.get("b", lambda: 2) == 2 and len(memo) == 1
    with pytest.raises(ValueError, match="num_layers: expected an integer >= 1, got 0"):
        qm.PagedMLACache(FMT, num_pages=2, max_seqs=1, device="cpu", num_layers=0)
    pc = qm.PagedMLACache(FMT, num_pages=4, max_seqs=1, device="cpu")
    assert [pc.pages_needed(None, n) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]
    plan = pc.reserve([(pc.add_request(), 3)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.num_tokens = 4
