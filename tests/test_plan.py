"""plan_attention / AttentionPlan.run: the same results as qm.attention, bit for bit, on every
backend that runs here; argument errors that name the argument; the CuPy plan prepares once."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.testing import (
    Case,
    allocate,
    build,
    check_attention,
    stub_cupy_launcher,
    stub_triton_launcher,
)

CPU_BACKENDS = [("torch", "cpu"), ("numba", "cpu"), ("reference", "numpy"), ("reference", "cpu"), ("triton", "cpu")]
CASES = [
    Case(qm.PackFormat.parse("C4R4"), (1, 70, 200), heads=4, s_q=1, seed=3),
    Case(qm.PackFormat.parse("C2R4"), (9, 64, 131), heads=3, s_q=3, seed=4),
    Case(qm.PackFormat.parse("BF16", latent_dim=256, rope_dim=32), (5, 100), heads=2, s_q=1, seed=5),
]


def _layer(case: Case, batch, device: str, seed: int) -> qm.MLACache:
    """A cache of ``batch``'s geometry written with fresh random values (``seed``), like another layer."""
    rng = np.random.default_rng(seed)
    latent = (rng.standard_normal(batch.latent.shape) * 3).astype(np.float32)
    k_rope = rng.standard_normal(batch.k_rope.shape).astype(np.float32)
    cache = allocate(case, batch, device)
    conv = (lambda a: a) if device == "numpy" else torch.from_numpy
    qm.write(cache, conv(latent), conv(k_rope), slot_mapping=conv(batch.slot_mapping), seq_ids=conv(batch.seq_ids),
             positions=conv(batch.positions), seq_lens=conv(batch.seq_lens), backend="reference" if device == "numpy" else "torch")
    return cache


def _equal(a, b) -> bool:
    return np.array_equal(a, b) if isinstance(a, np.ndarray) else torch.equal(a, b)


@pytest.mark.parametrize("backend,device", CPU_BACKENDS, ids=[f"{b}-{d}" for b, d in CPU_BACKENDS])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_plan_runs_like_attention(backend, device, case):
    """Two layers' caches, one plan: every run equals qm.attention on that layer (bitwise) and
    the reference within DESIGN §8; 3-D queries where S_q = 1."""
    if backend == "numba":
        pytest.importorskip("numba")
    if backend == "triton" and torch.cuda.is_available():
        pytest.skip("with a GPU the Triton backend serves CUDA tensors (test_plan_matches_attention_on_gpu); CPU "
                    "tensors only in its interpreter")
    batch = build(case)
    args = batch.to(device)
    layers = [_layer(case, batch, device, seed) for seed in (11, 12)]
    squeeze = case.s_q == 1
    q, r = args["q_latent"], args["q_rope"]
    if squeeze:
        q, r = q[:, 0], r[:, 0]
    meta = dict(block_table=args["block_table"], seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"])
    plan = qm.plan_attention(layers[0], num_heads=case.heads, q_len=None if squeeze else case.s_q,
                             q_dtype=np.float32 if device == "numpy" else torch.float32,
                             softmax_scale=batch.softmax_scale, backend=backend, **meta)
    assert plan.backend == backend and plan.q_shape == tuple(q.shape)
    for i, cache in enumerate(layers):
        # a new query per layer: fresh values, never the plan's own
        q_i, r_i = q * (1.0 + 0.25 * i), r - 0.5 * i
        out, lse = plan.run(q_i, r_i, cache)
        want_out, want_lse = qm.attention(q_i, r_i, cache, softmax_scale=batch.softmax_scale, backend=backend, **meta)
        assert _equal(out, want_out) and _equal(lse, want_lse), f"layer {i}: plan.run differs from qm.attention"
        host = cache if device == "numpy" else qm.MLACache(cache.format, cache.pages, cache.sink_buf,
                                                           cache.local_buf, cache.max_seqs, cache.sink, cache.local)
        q4 = q_i[:, None] if squeeze else q_i
        r4 = r_i[:, None] if squeeze else r_i
        ref_out, ref_lse = ref.decode_attention(q4, r4, host, batch.block_table, batch.attn_seq_lens,
                                                batch.attn_seq_ids, batch.softmax_scale)
        if squeeze:
            ref_out, ref_lse = ref_out[:, 0], ref_lse[:, 0]
        check_attention(out, lse, ref_out, ref_lse, "float32")
    assert plan.run(q, r, return_lse=False).shape == q.shape  # default: the planned cache
    # caller-given outputs, poisoned first: filled in place, equal to the returned results
    if device == "numpy":
        o_buf, l_buf = np.full(q.shape, np.nan, np.float32), np.full(q.shape[:-1], np.nan, np.float32)
    else:
        o_buf, l_buf = torch.full(q.shape, float("nan")), torch.full(q.shape[:-1], float("nan"))
    got_out, got_lse = plan.run(q, r, layers[1], out=o_buf, lse=l_buf)
    assert got_out is o_buf and got_lse is l_buf
    want_out, want_lse = qm.attention(q, r, layers[1], softmax_scale=batch.softmax_scale, backend=backend, **meta)
    assert _equal(o_buf, want_out) and _equal(l_buf, want_lse)


def _cpu_plan(**over):
    case = CASES[0]
    batch = build(case)
    args = batch.to("cpu")
    cache = allocate(case, batch, "cpu")
    kw = dict(block_table=args["block_table"], seq_lens=args["attn_seq_lens"], seq_ids=args["attn_seq_ids"],
              num_heads=case.heads, q_dtype=torch.float32, softmax_scale=0.1, backend="torch")
    kw.update(over)
    return qm.plan_attention(cache, **kw), cache, args


@pytest.mark.parametrize("over,exc,match", [
    ({"num_heads": 0}, ValueError, "num_heads: expected an integer >= 1, got 0"),
    ({"q_len": 2.5}, ValueError, "q_len: expected an integer >= 1"),
    ({"q_dtype": torch.float16}, TypeError, "q_dtype: expected one of"),
    ({"softmax_scale": -1.0}, ValueError, "softmax_scale: expected a finite value > 0"),
    ({"block_table": torch.zeros((3,), dtype=torch.int32)}, ValueError, "block_table: expected shape"),
    ({"block_table": torch.zeros((0, 2), dtype=torch.int32)}, ValueError,
     r"block_table: expected shape \[B, max_pages\] with B >= 1, got \(0, 2\)"),
    ({"seq_lens": torch.zeros((2,), dtype=torch.int32)}, ValueError, r"seq_lens: expected shape \(3,\)"),
    ({"seq_lens": torch.full((3,), 10_000, dtype=torch.int32)}, ValueError, "seq_lens: expected a length"),
    ({"backend": "nope"}, Exception, "nope"),
])
def test_plan_argument_errors(over, exc, match):
    with pytest.raises(exc, match=match):
        _cpu_plan(**over)


def test_numpy_cache_refuses_a_torch_query_dtype():
    case = CASES[0]
    batch = build(case)
    args = batch.to("numpy")
    cache = allocate(case, batch, "numpy")
    with pytest.raises(TypeError, match="q_dtype: expected one of .*float32.*, got torch.float32"):
        qm.plan_attention(cache, block_table=args["block_table"], seq_lens=args["attn_seq_lens"],
                          seq_ids=args["attn_seq_ids"], num_heads=case.heads, q_dtype=torch.float32, softmax_scale=0.1,
                          backend="reference")


def test_run_without_lse_tells_the_backend():
    """``return_lse=False`` reaches the backend's runner as ``want_lse=False`` (so a backend may skip allocating
    lse) and returns the output alone; by default the runner is asked for both."""
    plan, _cache, args = _cpu_plan()
    q, r = args["q_latent"][:, 0], args["q_rope"][:, 0]
    calls = []
    runner = plan._runner

    def spy(*a, **kw):
        calls.append(kw.get("want_lse", True))
        return runner(*a, **kw)

    plan._runner = spy
    out = plan.run(q, r, return_lse=False)
    both = plan.run(q, r)
    assert calls == [False, True]
    assert isinstance(out, torch.Tensor) and torch.equal(out, both[0]) and both[1].shape == (3, 4)


def test_run_argument_errors():
    plan, cache, args = _cpu_plan()
    q, r = args["q_latent"][:, 0], args["q_rope"][:, 0]
    with pytest.raises(ValueError, match=r"q_latent: expected the planned shape \(3, 4, 512\)"):
        plan.run(args["q_latent"], args["q_rope"])  # 4-D where the plan is 3-D
    with pytest.raises(ValueError, match="q_latent: expected .* dtype torch.float32"):
        plan.run(q.bfloat16(), r)
    with pytest.raises(ValueError, match=r"q_rope: expected the planned shape \(3, 4, 64\)"):
        plan.run(q, r[:, :, :32])
    with pytest.raises(ValueError, match="q_latent: expected .* on cpu, got ndarray"):
        plan.run(q.numpy(), r)
    with pytest.raises(ValueError, match="q_latent: expected finite values"):
        plan.run(torch.full_like(q, float("nan")), r)  # validate defaults on for CPU caches
    other = qm.MLACache.allocate(cache.format, cache.num_pages + 1, cache.max_seqs, cache.sink, cache.local, "cpu")
    with pytest.raises(ValueError, match="cache: expected an MLACache of the planned geometry"):
        plan.run(q, r, other)
    with pytest.raises(ValueError, match="cache: expected an MLACache .* got dict"):
        plan.run(q, r, {})
    with pytest.raises(ValueError, match=r"out: expected the planned shape \(3, 4, 512\)"):
        plan.run(q, r, out=torch.empty(3, 1, 4, 512))
    with pytest.raises(ValueError, match="lse: expected .* dtype torch.float32"):
        plan.run(q, r, lse=torch.empty(3, 4, dtype=torch.float64))


def test_cupy_plan_prepares_once(monkeypatch):
    """CuPy (launches stubbed, CPU): a plan's runs issue exactly the launches of qm.attention's
    backend call (kernels, grids, blocks, shared bytes, every argument but the output and scratch
    pointers), and later runs ask for no kernel, plan or index conversion."""
    from quantmla_core.backends.cupy import CupyBackend
    from quantmla_core.backends.cupy import attention as A

    kernels, launches = stub_cupy_launcher(monkeypatch)
    fmt = qm.PackFormat.parse("C4R4")
    b, h, pages_per = 3, 16, 5

    class Cache:
        format = fmt
        pages = torch.zeros((b * pages_per, fmt.page_bytes), dtype=torch.uint8)
        sink_buf = torch.zeros((b, 4, 576), dtype=torch.bfloat16)
        local_buf = torch.zeros((b, 128, 576), dtype=torch.bfloat16)
        num_pages, max_seqs, sink, local = b * pages_per, b, 4, 128

    q = torch.randn((b, 1, h, 512)).bfloat16()
    r = torch.randn((b, 1, h, 64)).bfloat16()
    table = torch.arange(b * pages_per, dtype=torch.int32).view(b, pages_per)
    lens, ids = torch.full((b,), 300, dtype=torch.int32), torch.arange(b, dtype=torch.int32)
    A.attention(q, r, Cache, table, lens, ids, 0.05)
    eager = list(launches)
    run = CupyBackend().plan_attention(Cache, table, lens, ids, (b, 1, h, 512), torch.bfloat16, 0.05)
    launches.clear()
    asked = len(kernels)
    calls = []
    for name in ("prepare", "v2_plan", "v3_plan", "_kernel_input"):
        orig = getattr(A, name)
        monkeypatch.setattr(A, name, lambda *a, _o=orig, _n=name, **k: (calls.append(_n), _o(*a, **k))[1])
    out, lse = run(q, r, Cache, None, None)
    assert out.shape == q.shape and lse.shape == (b, 1, h)
    assert len(kernels) == asked, "a planned run compiled or looked up a kernel"
    assert calls == ["_kernel_input", "_kernel_input"], calls  # the two queries only
    assert len(launches) == len(eager) >= 2
    for got, want in zip(launches, eager):
        fn, grid, block, args, smem = got
        assert (fn, grid, block, smem) == (want[0], want[1], want[2], want[4])
        if fn.kernel == "qmla_combine":
            assert args[-1] == want[3][-1]  # slots
        else:
            # queries, pages, buffers, index arrays, then (partials) and the scalars
            assert args[:8] == want[3][:8] and args[10:] == want[3][10:]


def test_triton_plan_prepares_once(monkeypatch):
    """Triton (kernels stubbed, CPU): a plan's runs issue exactly the launches of the backend's eager call
    (kernels, grids, constexprs, launch options, every argument but the partials and outputs) without
    preparing again; given outputs are the merge's destinations; a non-contiguous ``out`` is refused."""
    from quantmla_core.backends.triton import TritonBackend
    from quantmla_core.backends.triton import attention as A

    launches = stub_triton_launcher(monkeypatch)
    case = Case(qm.PackFormat.parse("C4R4"), (300, 70, 129), heads=16, sink=4, local=128, seed=9)
    batch = build(case)
    args = batch.to("cpu", "bfloat16")
    cache = allocate(case, batch, "cpu")
    meta = (args["block_table"].int(), args["attn_seq_lens"].int(), args["attn_seq_ids"].int())
    q, r = args["q_latent"][:, 0].contiguous(), args["q_rope"][:, 0].contiguous()
    A.attention(q[:, None], r[:, None], cache, *meta, 0.05)
    eager = list(launches)
    run = TritonBackend().plan_attention(cache, *meta, tuple(q.shape), torch.bfloat16, 0.05)
    prepared = []
    monkeypatch.setattr(A, "prepare", lambda *a, **k: prepared.append(1))
    launches.clear()
    out, lse = run(q, r, cache, None, None)
    assert out.shape == q.shape and lse.shape == q.shape[:-1] and not prepared
    o_buf, l_buf = torch.empty_like(q), torch.empty(q.shape[:-1])
    assert run(q, r, cache, o_buf, l_buf) == (o_buf, l_buf)
    assert len(launches) == 2 * len(eager) == 6
    # fresh per call: the split and protected partials, the merge's inputs and outputs
    fresh_args = {"protect_kernel": {6, 7}, "merge_kernel": {0, 1, 2, 3, 4, 5}}
    for got, want in zip(launches, eager + eager):
        (name, grid, a, kw), (w_name, w_grid, w_a, w_kw) = got, want
        assert (name, grid, kw) == (w_name, w_grid, w_kw)
        fresh = fresh_args.get(name, {5, 6})
        for i, (x, y) in enumerate(zip(a, w_a, strict=True)):
            if i in fresh:
                assert x.shape == y.shape and x.dtype == y.dtype
            else:
                same = x.data_ptr() == y.data_ptr() and x.shape == y.shape if isinstance(x, torch.Tensor) else x == y
                assert same, (name, i)
    merge = launches[5][2]
    assert [n for n, *_ in launches[3:]] == ["protect_kernel", "split_kernel_v2", "merge_kernel"]
    assert merge[4].data_ptr() == o_buf.data_ptr() and merge[5].data_ptr() == l_buf.data_ptr()
    with pytest.raises(ValueError, match="out: the Triton backend writes contiguous outputs"):
        run(q, r, cache, torch.empty((q.shape[0], 512, 16), dtype=torch.bfloat16).transpose(1, 2), None)


def _gpu_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


@pytest.mark.skipif(_gpu_reason() is not None, reason="plan.run on GPU backends needs a CUDA device")
@pytest.mark.parametrize("backend,env", [("cupy", {"QUANTMLA_CUPY_ATTENTION": "v2"}),
                                         ("cupy", {"QUANTMLA_CUPY_ATTENTION": "v3"}), ("triton", {})],
                         ids=["cupy-v2", "cupy-v3", "triton"])
def test_plan_matches_attention_on_gpu(backend, env, monkeypatch):
    """H16 bf16 over two layers: eager runs and a CUDA-graph replay of a run equal qm.attention bitwise."""
    reason = qm.get_backend(backend).unavailable_reason()
    if reason:
        pytest.skip(reason)
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    case = Case(qm.PackFormat.parse("C4R4"), (300, 1000, 77), heads=16, sink=4, local=128, seed=31)
    batch = build(case)
    args = batch.to("cuda", "bfloat16")
    layers = []
    for seed in (1, 2):
        cache = allocate(case, batch, "cuda")
        g = torch.Generator().manual_seed(seed)
        latent = (torch.randn(batch.latent.shape, generator=g) * 2).to("cuda", torch.bfloat16)
        qm.write(cache, latent, args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
                 positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
        layers.append(cache)
    meta = dict(block_table=args["block_table"].int().contiguous(), seq_lens=args["attn_seq_lens"].int().contiguous(),
                seq_ids=args["attn_seq_ids"].int().contiguous())
    q, r = args["q_latent"][:, 0].clone(), args["q_rope"][:, 0].clone()
    plan = qm.plan_attention(layers[0], num_heads=16, q_dtype=torch.bfloat16, softmax_scale=batch.softmax_scale,
                             backend=backend, **meta)
    for cache in layers:
        out, lse = plan.run(q, r, cache)
        want, want_lse = qm.attention(q, r, cache, softmax_scale=batch.softmax_scale, backend=backend, **meta)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        # without lse (the CuPy backend then writes it to its scratch): the same out
        assert torch.equal(plan.run(q, r, cache, return_lse=False), want)
        assert torch.equal(qm.attention(q, r, cache, softmax_scale=batch.softmax_scale, backend=backend,
                                        return_lse=False, **meta), want)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        plan.run(q, r, layers[1])
    torch.cuda.current_stream().wait_stream(side)
    g_out = torch.empty_like(q)  # static outputs the replays write (out=)
    with torch.cuda.graph(graph):
        g_out, g_lse = plan.run(q, r, layers[1], out=g_out)
    q.mul_(0.5)
    graph.replay()
    want, want_lse = qm.attention(q, r, layers[1], softmax_scale=batch.softmax_scale, backend=backend, **meta)
    torch.cuda.synchronize()
    assert torch.equal(g_out, want) and torch.equal(g_lse, want_lse)


def test_cupy_plan_three_d_queries_and_given_outputs(monkeypatch):
    """CuPy (stubbed, CPU): 3-D queries reach the kernels as they are (same pointers as the 4-D
    view), outputs come back 3-D, and caller-given outputs are the combine's destinations."""
    from quantmla_core.backends.cupy import CupyBackend

    _kernels, launches = stub_cupy_launcher(monkeypatch)
    fmt = qm.PackFormat.parse("C4R4")
    b, h = 2, 16

    class Cache:
        format = fmt
        pages = torch.zeros((8, fmt.page_bytes), dtype=torch.uint8)
        sink_buf = torch.zeros((b, 4, 576), dtype=torch.bfloat16)
        local_buf = torch.zeros((b, 128, 576), dtype=torch.bfloat16)
        num_pages, max_seqs, sink, local = 8, b, 4, 128

    table = torch.arange(8, dtype=torch.int32).view(b, 4)
    lens, ids = torch.full((b,), 200, dtype=torch.int32), torch.arange(b, dtype=torch.int32)
    q, r = torch.randn((b, h, 512)).bfloat16(), torch.randn((b, h, 64)).bfloat16()
    run = CupyBackend().plan_attention(Cache, table, lens, ids, (b, h, 512), torch.bfloat16, 0.05)
    out, lse = run(q, r, Cache, None, None)
    assert out.shape == (b, h, 512) and lse.shape == (b, h)
    split = launches[0][3]
    assert int(split[0]) == q.data_ptr() and int(split[1]) == r.data_ptr()
    launches.clear()
    o_buf, l_buf = torch.empty((b, h, 512), dtype=torch.bfloat16), torch.empty((b, h))
    got = run(q, r, Cache, o_buf, l_buf)
    assert got[0] is o_buf and got[1] is l_buf
    combine = launches.of("qmla_combine")[0][3]
    assert int(combine[2]) == o_buf.data_ptr() and int(combine[3]) == l_buf.data_ptr()
    with pytest.raises(ValueError, match="out: the CuPy backend writes contiguous"):
        run(q, r, Cache, torch.empty((b, 512, h), dtype=torch.bfloat16).transpose(1, 2), None)
