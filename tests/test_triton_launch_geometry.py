"""The Triton backend's launch geometry at the PERFORMANCE.md shapes, as ``attention.prepare`` decides it for an
sm_90 of 132 SMs (kernels stubbed, CPU): the split kernel's grid, the protected-tile kernel's parts and tiles, the
merge's grid and the partials it reads. RESULTS.md reasons from these numbers (stops 45 and 47); a change to the
launcher or the heuristics has to change them here, visibly. Also the order of a prepared call's launches and stream
operations (``QUANTMLA_TRITON_PROTECTED_STREAM``)."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.triton import attention as A
from quantmla_core.testing import stub_triton_launcher


def _prepare(monkeypatch, batch, heads, tokens, sink=4, local=128, fmt="C4R4", launches=None):
    """``A.prepare`` of ``batch`` requests of ``tokens`` tokens (kernels stubbed; their launches are recorded in
    ``launches``, where given)."""
    recorded = stub_triton_launcher(monkeypatch, sm_count=132)
    if launches is not None:
        launches.append(recorded)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    return _prepare_stubbed(batch, heads, tokens, sink, local, fmt)


def _prepare_stubbed(batch, heads, tokens, sink=4, local=128, fmt="C4R4", q_dtype=torch.bfloat16, **kw):
    """``A.prepare`` of ``batch`` requests of ``tokens`` tokens with ``q_dtype`` queries, the kernels already stubbed."""
    f = qm.PackFormat.parse(fmt)
    pages = tokens // f.page_size
    cache = qm.MLACache.allocate(f, batch * pages, batch, sink, local, device="cpu")
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return A.prepare(cache, table, lens, torch.arange(batch, dtype=torch.int32), batch, 1, heads, q_dtype, 0.05, **kw)


@pytest.mark.parametrize("batch,heads,tokens,variant,split_grid,protect_grid,tiles,merge_grid", [
    # H16 B8 L4K: 32 splits of two 64-token tiles; 9 protected parts of one 16-token tile; 16 channel blocks
    (8, 16, 4096, "v2", (32, 8, 1), (8, 1, 9), 1, (8, 1, 16)),
    # H16 B32 L32K: 8 splits; protected tiles in 3 parts of 3 (one wave of 96 programs)
    (32, 16, 32768, "v2", (8, 32, 1), (32, 1, 3), 3, (32, 1, 16)),
    # H128 B8 L4K: kernel v3 (64 rows, 2 row blocks, 8 splits); 8 protected row blocks of 16 in 2 parts of 5
    (8, 128, 4096, "v3", (8, 8, 2), (8, 8, 2), 5, (8, 8, 16)),
    # H128 B32 L32K: 256 16-row blocks would fill the GPU alone, so 64 rows a program (heuristics.v3_protect_rows):
    # 64 programs, 2 parts of 5 tiles
    (32, 128, 32768, "v3", (2, 32, 2), (32, 2, 2), 5, (32, 8, 16)),
])
def test_launch_geometry(monkeypatch, batch, heads, tokens, variant, split_grid, protect_grid, tiles, merge_grid):
    call = _prepare(monkeypatch, batch, heads, tokens)
    assert call.variant == variant
    assert (call.split_grid, call.protect_grid, call.protect_tiles, call.merge_grid) == (
        split_grid, protect_grid, tiles, merge_grid)
    splits, parts, rows = split_grid[0], protect_grid[2], heads
    # the partials the merge reads: every split's and every protected part's, for every query row
    assert [shape for shape, _ in call.partial_specs] == [(batch, splits, rows, 512), (batch, splits, rows),
                                                          (batch, parts, rows, 512), (batch, parts, rows)]
    assert call.protect_consts["BLOCK_T"] * tiles * parts >= 4 + 128  # the parts cover the sink and the ring


@pytest.mark.parametrize("batch,rows,want", [(8, 128, 16), (16, 128, 16), (17, 128, 64), (32, 128, 64), (1024, 128, 64),
                                             (32, 64, 16), (33, 64, 64), (1024, 16, 16), (1024, 48, 16)])
def test_v3_protect_rows(batch, rows, want):
    """Kernel v3's protected tiles take 64 query rows a program where ``batch`` x ``rows`` / 16 programs would fill
    132 SMs, and 16 rows elsewhere (fewer rows than one 64-row block: always 16)."""
    from quantmla_core.backends.triton.heuristics import v3_protect_rows

    assert v3_protect_rows(batch, rows, 132) == want


def test_no_protected_launch_without_sink_and_ring(monkeypatch):
    call = _prepare(monkeypatch, 8, 16, 4096, sink=0, local=0)
    assert call.protect_grid is None and call.protect_tiles == 0
    assert [shape for shape, _ in call.partial_specs][2:] == [(8, 0, 16, 512), (8, 0, 16)]


@pytest.mark.parametrize("rows,protect_grid,tiles", [("16", (8, 8, 2), 5), ("32", (8, 4, 3), 3), ("64", (8, 2, 5), 2)])
def test_protect_rows_knob(monkeypatch, rows, protect_grid, tiles):
    """``QUANTMLA_TRITON_PROTECT_ROWS`` (read per call): H128 B8 L4K's protected tiles over 16, 32 or 64 query rows a
    program; fewer row blocks leave more SMs to split the tiles over."""
    monkeypatch.setenv(A.PROTECT_ROWS_ENV, rows)
    call = _prepare(monkeypatch, 8, 128, 4096)
    assert (call.protect_grid, call.protect_tiles, call.protect_consts["BLOCK_R"]) == (protect_grid, tiles, int(rows))
    assert call.plan.protect_block_r == int(rows) and call.merge_grid == (8, 8, 16)  # the merge is unchanged


def test_protect_rows_knob_refuses_other_values(monkeypatch):
    monkeypatch.setenv(A.PROTECT_ROWS_ENV, "48")
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_PROTECT_ROWS: expected one of 16, 32, 64, got '48'"):
        _prepare(monkeypatch, 8, 128, 4096)


def _run(call, sink=4, local=128) -> None:
    """Run H16 B8 L4K's prepared ``call`` (kernels stubbed) on random bfloat16 queries over a CPU cache."""
    q, r = torch.randn((8, 16, 512)).to(torch.bfloat16), torch.randn((8, 16, 64)).to(torch.bfloat16)
    call.run(q, r, qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), 8 * 64, 8, sink, local, device="cpu"))


def _stub_cuda_streams(monkeypatch, events: list, capturing: bool = False) -> None:
    """Launch as on a CUDA device (under graph capture where ``capturing``): the side-stream operations are stubbed
    and appended to ``events`` beside the stubbed kernels' launches: ("fork",), ("on", stream) ... ("off", stream),
    ("join", stream)."""
    @contextlib.contextmanager
    def launching_on(side):
        events.append(("on", side))
        yield
        events.append(("off", side))

    monkeypatch.setattr(A, "_uses_cuda_streams", lambda dev: True)
    monkeypatch.setattr(A, "graph_capturing", lambda: capturing)
    monkeypatch.setattr(A, "fork_side_stream", lambda dev: events.append(("fork",)) or "side")
    monkeypatch.setattr(A, "join_side_stream", lambda dev, side: events.append(("join", side)))
    monkeypatch.setattr(A, "launching_on", launching_on)


def _set_env(monkeypatch, name: str, value: str | None) -> None:
    """``$name`` = ``value``; unset where None."""
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)


def _run_recording_streams(monkeypatch, capturing: bool, sink=4, local=128) -> list:
    """Run H16 B8 L4K's prepared call as on a CUDA device (kernels and streams stubbed) and return, in order, the
    kernels' names and the stream operations (:func:`_stub_cuda_streams`)."""
    found: list = []
    call = _prepare(monkeypatch, 8, 16, 4096, sink=sink, local=local, launches=found)
    events = found[0]  # the stubbed kernels record their launches here, the stream stubs beside them
    _stub_cuda_streams(monkeypatch, events, capturing)
    _run(call, sink, local)
    return [e if e[0] in ("fork", "on", "off", "join") else e[0] for e in events]


@pytest.mark.parametrize("env,capturing,side", [(None, True, False), (None, False, False), ("1", False, True),
                                                ("1", True, True), ("0", True, False)])
def test_protected_tiles_on_a_side_stream(monkeypatch, env, capturing, side):
    """``QUANTMLA_TRITON_PROTECTED_STREAM=1`` (unset: one stream, eager or captured): the protected-tile kernel runs on
    a second stream forked before the split launch (a fork after it would wait for the split kernel), and the merge
    is ordered after both."""
    _set_env(monkeypatch, A.PROTECTED_STREAM_ENV, env)
    events = _run_recording_streams(monkeypatch, capturing)
    if side:
        assert events == [("fork",), ("on", "side"), "protect_kernel", ("off", "side"), "split_kernel_v2",
                          ("join", "side"), "merge_kernel"]
    else:
        assert events == [("on", None), "protect_kernel", ("off", None), "split_kernel_v2", "merge_kernel"]


def test_no_side_stream_without_protected_tiles(monkeypatch):
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "1")
    assert _run_recording_streams(monkeypatch, True, sink=0, local=0) == ["split_kernel_v2", "merge_kernel"]


@pytest.mark.parametrize("cuda", [True, False])
def test_protected_stream_knob_refuses_other_values(monkeypatch, cuda):
    """A malformed ``QUANTMLA_TRITON_PROTECTED_STREAM`` is refused on every device, not only where streams exist."""
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "yes")
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_PROTECTED_STREAM: expected one of 0, 1, got 'yes'"):
        if cuda:
            _run_recording_streams(monkeypatch, True)
        else:  # no CUDA streams, as in the interpreter
            _run(_prepare(monkeypatch, 8, 16, 4096))


def _pdl_launches(monkeypatch, pdl_env, side_env=None, supported=True) -> list:
    """[(kernel name, launch kwargs)] of H16 B8 L4K's prepared call run as on a CUDA device (kernels and streams
    stubbed), in launch order, with ``QUANTMLA_TRITON_PDL`` = ``pdl_env`` (None: unset) and the GPU's PDL check
    faked."""
    _set_env(monkeypatch, A.PDL_ENV, pdl_env)
    _set_env(monkeypatch, A.PROTECTED_STREAM_ENV, side_env)
    monkeypatch.setattr(A, "pdl_unsupported", lambda dev: None if supported else "no PDL on this GPU")
    found: list = []
    call = _prepare(monkeypatch, 8, 16, 4096, launches=found)
    _stub_cuda_streams(monkeypatch, found[0])
    _run(call)
    return [(e[0], e[3]) for e in found[0] if len(e) == 4]  # the kernels' launches, not the stream operations


def _pdl_summary(launches: list) -> list:
    """(name, the PDL constexpr, whether the launch asks for PDL) of each launch."""
    return [(name.replace("_kernel", ""), kw["PDL"], kw.get("launch_pdl", False)) for name, kw in launches]


#: (kernel, built with PDL, launched with PDL) in launch order, for each QUANTMLA_TRITON_PDL on one stream
PDL_LAUNCHES = {
    "0": [("protect", False, False), ("split_v2", False, False), ("merge", False, False)],
    # the merge launch overlaps the split kernel's end
    "1": [("protect", False, False), ("split_v2", True, False), ("merge", True, True)],
    # the protected tiles after the split kernel, launched with PDL too
    "2": [("split_v2", True, False), ("protect", True, True), ("merge", True, True)],
}


@pytest.mark.parametrize("pdl_env,side_env,want", [
    *((mode, None, launches) for mode, launches in PDL_LAUNCHES.items()),
    # the side stream: plain launches in the side stream's order (the kernels built with PDL do nothing more)
    ("1", "1", [("protect", False, False), ("split_v2", True, False), ("merge", True, False)]),
    ("2", "1", [("protect", True, False), ("split_v2", True, False), ("merge", True, False)]),
])
def test_pdl_launches(monkeypatch, pdl_env, side_env, want):
    """``QUANTMLA_TRITON_PDL``: which kernels are built with PDL and which launches ask for it, in launch order."""
    assert _pdl_summary(_pdl_launches(monkeypatch, pdl_env, side_env)) == want


@pytest.mark.parametrize("default", [0, 1, 2])
@pytest.mark.parametrize("supported", [False, True])
def test_pdl_default_only_where_supported(monkeypatch, default, supported):
    """Unset, ``heuristics.pdl_default`` applies where :func:`pdl_unsupported` finds nothing against PDL, and 0
    elsewhere."""
    monkeypatch.setattr(A, "pdl_default", lambda variant: default)
    got = _pdl_summary(_pdl_launches(monkeypatch, None, supported=supported))
    assert got == PDL_LAUNCHES[str(default if supported else 0)]


@pytest.mark.parametrize("value,match", [
    ("yes", r"QUANTMLA_TRITON_PDL: expected one of 0, 1, 2, got 'yes'"),
    ("3", r"QUANTMLA_TRITON_PDL: expected one of 0, 1, 2, got '3'"),
    ("1", r"QUANTMLA_TRITON_PDL=1: no PDL on this GPU"),
    ("2", r"QUANTMLA_TRITON_PDL=2: no PDL on this GPU")])
def test_pdl_knob_refusals(monkeypatch, value, match):
    with pytest.raises(ValueError, match=match):
        _pdl_launches(monkeypatch, value, supported=False)


@pytest.mark.parametrize("device,major,why", [
    ("cpu", 9, r"needs a CUDA GPU, the call runs on cpu"), ("cuda:0", None, r"ROCm has no"),
    ("cuda:0", 8, r"compute capability 9.0 or later, cuda:0 is 8.x"), ("cuda:0", 9, None), ("cuda:0", 10, None)])
def test_pdl_unsupported_reasons(monkeypatch, device, major, why):
    monkeypatch.setattr(A, "interpreting", lambda: False)
    monkeypatch.setattr(A, "_nvidia_major", lambda index: major)
    got = A.pdl_unsupported(torch.device(device))
    assert (got is None) if why is None else re.search(why, got), got


@pytest.mark.parametrize("device,interp,major,why", [
    ("cpu", False, 9, r"^PTX runs on NVIDIA GPUs, the call runs on cpu$"),
    ("cuda:0", True, 9, r"^PTX runs on NVIDIA GPUs, the call runs on cuda \(TRITON_INTERPRET=1\)$"),
    ("cuda:0", False, None, r"^ROCm GPUs run no NVIDIA PTX$"), ("cuda:0", False, 8, None), ("cuda:0", False, 9, None)])
def test_nvidia_asm_unsupported_reasons(monkeypatch, device, interp, major, why):
    monkeypatch.setattr(A, "interpreting", lambda: interp)
    monkeypatch.setattr(A, "_nvidia_major", lambda index: major)
    got = A.nvidia_asm_unsupported(torch.device(device))
    assert (got is None) if why is None else re.search(why, got), got


@pytest.mark.parametrize("batch,heads,tokens,mode", [(8, 16, 4096, 1), (32, 16, 32768, 1), (8, 128, 4096, 2),
                                                      (32, 128, 32768, 2)])
def test_pdl_default_by_kernel(monkeypatch, batch, heads, tokens, mode):
    """Unset on a GPU with PDL: mode 2 (the protected tiles after the split kernel) where the call runs kernel v3, mode
    1 (the merge) where it runs v2 (``heuristics.pdl_default``, from stop 49's H100 timings)."""
    monkeypatch.delenv(A.PDL_ENV, raising=False)
    monkeypatch.setattr(A, "pdl_unsupported", lambda dev: None)
    call = _prepare(monkeypatch, batch, heads, tokens)
    assert (call.variant, call.pdl) == ("v3" if heads == 128 else "v2", mode)


@pytest.mark.parametrize("quant,cbits,rbits,dot_bf16,bias,want", [
    (True, 4, 4, True, None, (128, 128)),   # the bfloat16 bit trick: 128 + code is exact below 8 bits
    (True, 2, 8, True, None, (128, 0)),     # 8-bit codes: 128 + 255 is no bfloat16 integer, no bias
    (True, 8, 8, True, None, (0, 0)),
    (True, 4, 4, False, None, (0, 0)),      # float32 dots take the codes as they are
    (True, 4, 4, False, 128, (128, 128)),   # forced (the interpreter's check of the bias algebra)
    (True, 8, 8, False, 128, (0, 0)),       # never for 8-bit codes
    (False, 16, 16, True, 128, (0, 0)),     # bf16 pages hold no codes
])
def test_v2_code_bias_by_bits_and_dot_dtype(quant, cbits, rbits, dot_bf16, bias, want):
    consts = A.v2_constexprs(quant, cbits, rbits, dot_bf16, code_bias=bias)
    assert (consts["CBIAS"], consts["RBIAS"]) == want


def test_pdl_needs_a_triton_with_an_nvidia_backend(monkeypatch):
    """A triton without the NVIDIA compiler module (a ROCm-only build) launches nothing with PDL."""
    import sys

    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.compiler", None)
    assert A._triton_launches_pdl.__wrapped__() is False


@pytest.fixture
def stubbed_gpu(monkeypatch):
    stub_triton_launcher(monkeypatch, sm_count=132)
    monkeypatch.delenv(A.VARIANT_ENV, raising=False)
    return monkeypatch


def _prepare_dtype(q_dtype, heads=16, **kw):
    """H ``heads`` B2 L4K C4R4 prepared (on the stubbed GPU) with ``q_dtype`` queries."""
    return _prepare_stubbed(2, heads, 4096, q_dtype=q_dtype, **kw)


@pytest.mark.parametrize("heads", [16, 128])
def test_float32_queries_on_a_gpu_run_kernel_v1(stubbed_gpu, heads):
    """On a GPU, kernels v2 and v3 take bfloat16 queries only (heuristics.V2_FLOAT32_ON_GPU): float32 queries run v1,
    bfloat16 ones v2 (H16) or v3 (H128); a forced v2 with float32 queries runs v1 too."""
    assert _prepare_dtype(torch.float32, heads).variant == "v1"
    assert _prepare_dtype(torch.bfloat16, heads).variant == ("v2" if heads == 16 else "v3")
    assert _prepare_dtype(torch.float32, heads, variant="v2").variant == "v1"


def test_protect_rows_override_wins_over_the_environment(stubbed_gpu):
    stubbed_gpu.setenv(A.PROTECT_ROWS_ENV, "64")
    assert _prepare_dtype(torch.bfloat16, 128).plan.protect_block_r == 64
    call = _prepare_dtype(torch.bfloat16, 128, overrides={"protect_block_r": 32})
    assert call.plan.protect_block_r == 32
