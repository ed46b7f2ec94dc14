"""Case generation shared by the conformance tests and the benchmarks.

A :class:`Case` names a format, request lengths, heads, S_q and protection sizes; :func:`build`
turns it into random inputs (never zeros) with shuffled page tables, and
:func:`check_attention` compares a backend's output with the float64 reference run on the
same cache (the same dequantized operands).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .cache import MLACache
from .dispatch import Capabilities
from .formats import PackFormat

#: DESIGN.md §8 tolerances: relative Frobenius error of out, absolute error of lse
TOLERANCE = {"bfloat16": (1e-2, 2e-2), "float32": (1e-4, 1e-4)}
POISON_BYTE = 0xA5


@dataclass(frozen=True)
class Case:
    fmt: PackFormat
    lens: tuple[int, ...]
    heads: int = 4
    s_q: int = 1
    sink: int = 4
    local: int = 16
    dtype: str = "float32"
    seed: int = 0
    extra_pages: int = 3

    def __str__(self) -> str:
        return f"{self.fmt.name}-dc{self.fmt.latent_dim}-P{self.fmt.page_size}-G{self.fmt.group_size}-L{'_'.join(map(str, self.lens))}-H{self.heads}-S{self.s_q}-sink{self.sink}-local{self.local}-{self.dtype}"


@dataclass
class Batch:
    """Host (NumPy) copies of every input of one case; :meth:`to` converts them."""

    latent: np.ndarray
    k_rope: np.ndarray
    slot_mapping: np.ndarray
    seq_ids: np.ndarray
    positions: np.ndarray
    seq_lens: np.ndarray  # [max_seqs], for write
    block_table: np.ndarray
    q_latent: np.ndarray
    q_rope: np.ndarray
    attn_seq_lens: np.ndarray  # [B]
    attn_seq_ids: np.ndarray  # [B]
    num_pages: int
    softmax_scale: float
    extras: dict = field(default_factory=dict)

    def to(self, device: str, dtype: str = "float32") -> dict[str, Any]:
        """Inputs as NumPy arrays (``device="numpy"``) or torch tensors on ``device``."""
        out = {}
        for name in ("latent", "k_rope", "q_latent", "q_rope"):
            arr = getattr(self, name)
            if device == "numpy":
                out[name] = arr.astype(np.float32)
            else:
                out[name] = torch.from_numpy(arr).to(device=device, dtype=getattr(torch, dtype))
        for name in ("slot_mapping", "seq_ids", "positions", "seq_lens", "block_table", "attn_seq_lens", "attn_seq_ids"):
            arr = getattr(self, name)
            out[name] = arr if device == "numpy" else torch.from_numpy(arr).to(device)
        return out


def build(case: Case) -> Batch:
    """Random tokens for every request, written in one call, with shuffled page tables.

    Content values carry per-channel scales (outliers like real MLA latents).
    """
    rng = np.random.default_rng(case.seed)
    fmt, p = case.fmt, case.fmt.page_size
    pages_per = [-(-n // p) for n in case.lens]
    num_pages = sum(pages_per) + case.extra_pages
    perm = rng.permutation(num_pages)
    width = max(pages_per) + 1
    table = np.zeros((len(case.lens), width), np.int32)
    table[:, :] = perm[-1]  # padding points at a real page that no request owns
    slots, seqs, pos = [], [], []
    k = 0
    for s, n in enumerate(case.lens):
        table[s, : pages_per[s]] = perm[k : k + pages_per[s]]
        k += pages_per[s]
        idx = np.arange(n)
        slots.append(table[s, idx // p].astype(np.int64) * p + idx % p)
        seqs.append(np.full(n, s))
        pos.append(idx)
    total = sum(case.lens)
    chan = np.exp(rng.normal(0, 0.7, fmt.latent_dim)).astype(np.float32)
    latent = (rng.standard_normal((total, fmt.latent_dim)) * chan).astype(np.float32)
    k_rope = (rng.standard_normal((total, fmt.rope_dim)) * 2).astype(np.float32)
    order = rng.permutation(total)  # tokens arrive in any order
    b = len(case.lens)
    q_shape = (b, case.s_q, case.heads)
    q_latent = (rng.standard_normal(q_shape + (fmt.latent_dim,)) / np.sqrt(chan)).astype(np.float32)
    q_rope = rng.standard_normal(q_shape + (fmt.rope_dim,)).astype(np.float32)
    return Batch(
        latent=latent[order],
        k_rope=k_rope[order],
        slot_mapping=np.concatenate(slots)[order],
        seq_ids=np.concatenate(seqs)[order].astype(np.int64),
        positions=np.concatenate(pos)[order].astype(np.int64),
        seq_lens=np.asarray(case.lens, np.int64),
        block_table=table,
        q_latent=q_latent,
        q_rope=q_rope,
        attn_seq_lens=np.asarray(case.lens, np.int32),
        attn_seq_ids=np.arange(b, dtype=np.int64),
        num_pages=num_pages,
        softmax_scale=float(1.0 / np.sqrt(fmt.latent_dim + fmt.rope_dim)),
    )


def allocate(case: Case, batch: Batch, device: str, protect_dtype: Any = None) -> MLACache:
    """Cache for ``batch`` with pages poisoned so unwritten bytes cannot pass for data."""
    cache = MLACache.allocate(case.fmt, batch.num_pages, len(case.lens), case.sink, case.local, device, protect_dtype)
    cache.pages[...] = POISON_BYTE
    return cache


def write_case(case: Case, device: str, dtype: str = "float32", backend: str = "torch") -> tuple[Batch, dict, MLACache]:
    """``case``'s batch, its tensors on ``device`` in ``dtype`` (:meth:`Batch.to`) and a poisoned cache holding every
    token, written in one ``quantmla_core.write`` call by ``backend``."""
    from .api import write

    batch = build(case)
    args = batch.to(device, dtype)
    cache = allocate(case, batch, device)
    write(cache, args["latent"], args["k_rope"], slot_mapping=args["slot_mapping"], seq_ids=args["seq_ids"],
          positions=args["positions"], seq_lens=args["seq_lens"], backend=backend)
    return batch, args, cache


def check_attention(out, lse, ref_out: np.ndarray, ref_lse: np.ndarray, dtype: str) -> tuple[float, float]:
    """Assert DESIGN.md §8 tolerances; return (relative error of out, max abs error of lse)."""
    o = out.float().cpu().numpy() if isinstance(out, torch.Tensor) else np.asarray(out, np.float64)
    l = lse.float().cpu().numpy() if isinstance(lse, torch.Tensor) else np.asarray(lse, np.float64)
    assert o.shape == ref_out.shape, f"out shape {o.shape} != reference {ref_out.shape}"
    assert l.shape == ref_lse.shape, f"lse shape {l.shape} != reference {ref_lse.shape}"
    assert np.isfinite(o).all() and np.isfinite(l).all(), "non-finite output"
    rel = float(np.linalg.norm(o - ref_out) / np.linalg.norm(ref_out))
    lse_err = float(np.abs(l - ref_lse).max())
    tol_out, tol_lse = TOLERANCE[dtype]
    assert rel <= tol_out, f"relative error {rel:.3g} > {tol_out}"
    assert lse_err <= tol_lse, f"lse error {lse_err:.3g} > {tol_lse}"
    return rel, lse_err


def edge_lengths(fmt: PackFormat, sink: int, local: int) -> list[tuple[int, ...]]:
    """Request-length sets covering DESIGN.md §8's edges: 1, P-1, P, P+1, inside the sink,
    inside the window, beyond both; several requests of different lengths per batch."""
    p = fmt.page_size
    return [
        (1,),
        (p - 1, p, p + 1),
        (max(sink - 1, 1), sink + local - 1, 3 * p + 5),
        (2 * p + sink + local + 7, 1, p + 3),
    ]


def generate_cases(cap: Capabilities, quick: bool = True, dtype: str = "float32") -> list[Case]:
    """Cases from a backend's declarations: every declared format and dims, edge lengths,
    S_q > 1, protection off; ``quick`` keeps the set small enough for interpreters."""
    names = [n for n in ("C4R4", "C2R4", "C4R8", "C8R8", "C2R2", "BF16") if _fmt_ok(cap, n)]
    dims = [(dc, dr) for dc, dr in ((512, 64), (256, 32)) if (cap.latent_dims is None or dc in cap.latent_dims) and (cap.rope_dims is None or dr in cap.rope_dims)]
    cases: list[Case] = []
    seed = 0
    for name in names:
        for dc, dr in dims:
            fmt = PackFormat.parse(name, latent_dim=dc, rope_dim=dr)
            for lens in edge_lengths(fmt, 4, 16)[: 2 if quick else None]:
                seed += 1
                cases.append(Case(fmt, lens, heads=4, s_q=1, dtype=dtype, seed=seed))
    base = PackFormat.parse(names[0]) if names else None
    if base is not None:
        for p in sorted(cap.page_sizes):
            if p != 64:
                cases.append(Case(PackFormat.parse(base.name, page_size=p), (p + 1, 2 * p - 1), s_q=1, dtype=dtype, seed=100 + p))
        for g in sorted(cap.group_sizes):
            if g != 64 and base.quantized:
                cases.append(Case(PackFormat.parse(base.name, group_size=g), (70, 9), dtype=dtype, seed=200 + g))
        cases.append(Case(base, (150, 40, 5), heads=16, s_q=4, dtype=dtype, seed=300))
        cases.append(Case(base, (90, 17), heads=3, s_q=2, sink=0, local=0, dtype=dtype, seed=301))
        cases.append(Case(base, (130,), heads=2, s_q=1, sink=0, local=32, dtype=dtype, seed=302))
        # a one-token sink and ring: with S_q = 2 the first new token is read from its packed copy
        cases.append(Case(base, (7, 2, 66), heads=2, s_q=2, sink=1, local=1, dtype=dtype, seed=303))
    return cases


def _fmt_ok(cap: Capabilities, name: str) -> bool:
    f = PackFormat.parse(name)
    return f.content_bits in cap.content_bits and f.rope_bits in cap.rope_bits


# ---------------------------------------------------------------------- CuPy launcher on the CPU
@dataclass
class StubKernel:
    """What the CuPy launcher asked to compile: ``kernels/<source>`` entry ``kernel`` with ``defines``
    (``arch``: the NVRTC target it named, None: CuPy's build for the device)."""

    source: str
    kernel: str
    defines: dict
    smem: int = 0
    arch: str | None = None


class LaunchLog(list):
    """Recorded launches (kernel, grid, block, args, shared bytes); ``streams[i]``: the stream of
    launch i, ``"side"`` for one forked onto the protected-only side stream, else None; ``pdl[i]``: whether
    launch i asked for programmatic dependent launch."""

    def __init__(self):
        super().__init__()
        self.streams: list = []
        self.pdl: list[bool] = []

    def of(self, kernel: str) -> tuple[tuple, Any]:
        """(record, stream) of the one launch of ``kernel`` (e.g. ``"qmla_attn_v3"``)."""
        found = [(rec, st) for rec, st in zip(self, self.streams) if rec[0].kernel == kernel]
        assert len(found) == 1, f"{len(found)} launches of {kernel}: {[rec[0].kernel for rec in self]}"
        return found[0]


def patch_cupy_launcher(monkeypatch: Any, **stubs: Any) -> None:
    """Set each of ``stubs`` (name=value) in every module of the CuPy attention launcher that has that name: the op,
    its plans and its variant choice, each of which imports what it calls by name. A name no module has is an error,
    so a stub cannot silently miss. ``monkeypatch``: pytest's fixture."""
    from .backends.cupy import attention, plans, variants

    modules = (attention, plans, variants)
    for name, value in stubs.items():
        owners = [m for m in modules if hasattr(m, name)]
        if not owners:
            raise AttributeError(f"no CuPy launcher module has {name!r}")
        for m in owners:
            monkeypatch.setattr(m, name, value)


def stub_cupy_launcher(monkeypatch: Any, sm_count: int = 132, nvrtc: tuple[int, int] = (13, 0),
                       pdl_reason: str | None = "stubbed: no CUDA driver", cluster_ctas: int | None = None
                       ) -> tuple[list, list]:
    """Let the CuPy attention launcher (``quantmla_core.backends.cupy.attention`` and the modules it plans with) run
    its host logic without a GPU: compilation returns :class:`StubKernel`, launches are recorded, the device is an
    sm_90 with ``sm_count`` SMs holding 2 CTAs each and NVRTC ``nvrtc``, and scratch and tables live on the CPU.
    ``pdl_reason``: why the driver cannot launch with PDL (None: it can), whatever this machine's driver says.
    ``cluster_ctas``: the CTAs the device runs at once as clusters (clusters of C: ``cluster_ctas // C`` at once;
    None: as many as single CTAs). ``monkeypatch``: pytest's fixture. Returns (kernels asked for, launches as a
    :class:`LaunchLog`)."""
    from .backends.cupy import knobs
    from .backends.cupy.kernel_args import pack_args

    kernels: list = []
    launches = LaunchLog()

    def get_kernel(source, kernel, defines, dev, smem=0, arch=None):
        kernels.append((source, kernel))
        return StubKernel(source, kernel, defines, smem, arch)

    def launch(fn, grid, block, args, dev, smem=0, stream=None, types=None, pdl=False):
        pack_args(args, types)  # what the real launch packs
        if types is not None:  # recorded as the numpy scalars of the parameters' types
            args = tuple(t(a) for t, a in zip(types, args))
        launches.append((fn, grid, block, args, smem))
        launches.streams.append(stream)
        launches.pdl.append(pdl)

    patch_cupy_launcher(
        monkeypatch, get_kernel=get_kernel, launch=launch,
        external_stream=lambda dev, torch_stream=None: torch_stream,
        _fork_side_stream=lambda dev: "side", _join_side_stream=lambda dev, side: None,
        device_info=lambda dev: (sm_count, (9, 0)), nvrtc_version=lambda: nvrtc,
        resident_ctas=lambda fn, threads, smem, dev, sms: 2 * sms,
        function_ptr=lambda fn: fn,
        max_active_clusters=lambda fn, cluster, threads, smem, dev: (
            (2 * sm_count if cluster_ctas is None else cluster_ctas) // math.prod(cluster)),
        _workspace=lambda dev, n: torch.empty(n, dtype=torch.float32),
        _device_table=lambda rows, dev: torch.tensor(rows, dtype=torch.int32),
        _FNS={}, _PLANS={}, _PREPARED={})
    monkeypatch.setattr(knobs, "pdl_unavailable_reason", lambda capability: pdl_reason)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return kernels, launches


def stub_triton_launcher(monkeypatch: Any, sm_count: int = 132) -> list:
    """Let ``quantmla_core.backends.triton.attention`` run its host logic as on a GPU without one:
    the kernels record their launches (grid, positional args, keyword args) instead of
    compiling, and the device has ``sm_count`` SMs. ``monkeypatch``: pytest's fixture.
    Returns the launch records, as (kernel name, grid, args, kwargs)."""
    from .backends.triton import attention as A
    from .backends.triton import common as C

    launches: list = []

    class Kernel:
        def __init__(self, name: str):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((self.name, grid, args, kwargs))

    for variant, kernel in list(A._KERNELS.items()):
        monkeypatch.setitem(A._KERNELS, variant, Kernel(getattr(kernel, "fn", kernel).__name__))
    monkeypatch.setattr(A, "protect_kernel", Kernel("protect_kernel"))
    monkeypatch.setattr(A, "merge_kernel", Kernel("merge_kernel"))
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_sm_count", lambda dev: sm_count)
    monkeypatch.setattr(C, "interpreting", lambda: False)
    return launches


def stub_cache(fmt: PackFormat, batch: int, pages_per: int, sink: int = 4, local: int = 128) -> type:
    """A stand-in for an :class:`~quantmla_core.MLACache` that stubbed launchers plan over (CPU, zeros): ``fmt``'s
    geometry, ``batch * pages_per`` pages, ``batch`` requests with ``sink`` / ``local`` bfloat16 protected rows."""
    width = fmt.latent_dim + fmt.rope_dim

    class Cache:
        format = fmt
        pages = torch.zeros((batch * pages_per, fmt.page_bytes), dtype=torch.uint8)
        sink_buf = torch.zeros((batch, sink, width), dtype=torch.bfloat16)
        local_buf = torch.zeros((batch, local, width), dtype=torch.bfloat16)
        num_pages, max_seqs = batch * pages_per, batch

    Cache.sink, Cache.local = sink, local
    return Cache


def capture_graph(fn: Any) -> tuple[Any, Any]:
    """``fn`` warmed up twice on a side stream (compiles, plans), then captured into a CUDA graph: (the graph,
    what the captured call returned, whose memory the graph's replays rewrite)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result
