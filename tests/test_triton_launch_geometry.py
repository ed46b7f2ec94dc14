"""The Triton backend's launch geometry at the PERFORMANCE.md shapes, as ``attention.prepare`` decides it for an
sm_90 of 132 SMs (kernels stubbed, CPU): the split kernel's grid, the protected-tile kernel's parts and tiles, the
merge's grid and the partials it reads. RESULTS.md reasons from these numbers (stops 45 and 47); a change to the
launcher or the heuristics has to change them here, visibly. Also the order of a prepared call's launches and stream
operations (``QUANTMLA_TRITON_PROTECTED_STREAM``)."""

from __future__ import annotations

import contextlib

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
    f = qm.PackFormat.parse(fmt)
    pages = tokens // f.page_size
    cache = qm.MLACache.allocate(f, batch * pages, batch, sink, local, device="cpu")
    table = torch.arange(batch * pages, dtype=torch.int32).view(batch, pages)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return A.prepare(cache, table, lens, torch.arange(batch, dtype=torch.int32), batch, 1, heads, torch.bfloat16, 0.05)


@pytest.mark.parametrize("batch,heads,tokens,variant,split_grid,protect_grid,tiles,merge_grid", [
    # H16 B8 L4K: 32 splits of two 64-token tiles; 9 protected parts of one 16-token tile; 16 channel blocks
    (8, 16, 4096, "v2", (32, 8, 1), (8, 1, 9), 1, (8, 1, 16)),
    # H16 B32 L32K: 8 splits; protected tiles in 3 parts of 3 (one wave of 96 programs)
    (32, 16, 32768, "v2", (8, 32, 1), (32, 1, 3), 3, (32, 1, 16)),
    # H128 B8 L4K: kernel v3 (64 rows, 2 row blocks, 8 splits); 8 protected row blocks of 16 in 2 parts of 5
    (8, 128, 4096, "v3", (8, 8, 2), (8, 8, 2), 5, (8, 8, 16)),
    # H128 B32 L32K: the 256 protected programs fill the GPU alone: one part of all 9 tiles
    (32, 128, 32768, "v3", (2, 32, 2), (32, 8, 1), 9, (32, 8, 16)),
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


def _run_recording_streams(monkeypatch, capturing: bool, sink=4, local=128) -> list:
    """Run H16 B8 L4K's prepared call as on a CUDA device (kernels and streams stubbed) and return, in order, the
    launches and the stream operations: ("fork",), ("on", stream) ... ("off", stream), ("join", stream)."""
    found: list = []
    call = _prepare(monkeypatch, 8, 16, 4096, sink=sink, local=local, launches=found)
    events = found[0]  # the stubbed kernels record their launches here, the stream stubs beside them

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
    q, r = torch.randn((8, 16, 512)).to(torch.bfloat16), torch.randn((8, 16, 64)).to(torch.bfloat16)
    call.run(q, r, qm.MLACache.allocate(qm.PackFormat.parse("C4R4"), 8 * 64, 8, sink, local, device="cpu"))
    return [e if e[0] in ("fork", "on", "off", "join") else e[0] for e in events]


@pytest.mark.parametrize("env,capturing,side", [(None, True, False), (None, False, False), ("1", False, True),
                                                ("1", True, True), ("0", True, False)])
def test_protected_tiles_on_a_side_stream(monkeypatch, env, capturing, side):
    """``QUANTMLA_TRITON_PROTECTED_STREAM=1`` (unset: one stream, eager or captured): the protected-tile kernel runs on
    a second stream forked before the split launch (a fork after it would wait for the split kernel), and the merge
    is ordered after both."""
    if env is None:
        monkeypatch.delenv(A.PROTECTED_STREAM_ENV, raising=False)
    else:
        monkeypatch.setenv(A.PROTECTED_STREAM_ENV, env)
    events = _run_recording_streams(monkeypatch, capturing)
    if side:
        assert events == [("fork",), ("on", "side"), "protect_kernel", ("off", "side"), "split_kernel_v2",
                          ("join", "side"), "merge_kernel"]
    else:
        assert events == [("on", None), "protect_kernel", ("off", None), "split_kernel_v2", "merge_kernel"]


def test_no_side_stream_without_protected_tiles(monkeypatch):
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "1")
    assert _run_recording_streams(monkeypatch, True, sink=0, local=0) == ["split_kernel_v2", "merge_kernel"]


def test_protected_stream_knob_refuses_other_values(monkeypatch):
    monkeypatch.setenv(A.PROTECTED_STREAM_ENV, "yes")
    with pytest.raises(ValueError, match=r"QUANTMLA_TRITON_PROTECTED_STREAM: expected 0 or 1, got 'yes'"):
        _run_recording_streams(monkeypatch, True)
