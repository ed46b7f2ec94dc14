"""The CuPy writer's launcher on the CPU: kernels compiled and launched are recorded instead (no GPU needed).

One warp per token (``WRITER_WARPS`` tokens a block), index arrays as contiguous int64, input rows 16-byte aligned
(the kernel's vector loads), the cache's geometry as the scalar arguments, nothing launched for no tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core.backends.cupy import WRITER_WARPS
from quantmla_core.backends.cupy import writer as W


@pytest.fixture
def recorded(monkeypatch):
    kernels, launches, pointed = [], [], []

    def get_kernel(source, kernel, defines, dev, smem=0, arch=None):
        kernels.append((source, kernel, dict(defines)))
        return (source, kernel)

    def device_pointer(x):
        pointed.append(x)
        return int(x.data_ptr())

    monkeypatch.setattr(W, "get_kernel", get_kernel)
    monkeypatch.setattr(W, "launch", lambda fn, grid, block, args, dev: launches.append((fn, grid, block, args, dev)))
    monkeypatch.setattr(W, "device_pointer", device_pointer)
    monkeypatch.setattr(W, "_KERNELS", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return kernels, launches, pointed


def _inputs(n: int, fmt: qm.PackFormat, dtype=torch.float32, misaligned: bool = False):
    g = torch.Generator().manual_seed(n)
    d = fmt.latent_dim
    flat = torch.randn(n * d + 1, generator=g).to(dtype)
    latent = (flat[1:] if misaligned else flat[:-1]).view(n, d)
    k_rope = torch.randn(n, fmt.rope_dim, generator=g).to(dtype)
    slots = torch.arange(n, dtype=torch.int32)
    ids = torch.zeros(n, dtype=torch.int32)
    return latent, k_rope, slots, ids, torch.arange(n, dtype=torch.int32), torch.tensor([n, 0], dtype=torch.int32)


FMT = qm.PackFormat.parse("C4R4", latent_dim=256, rope_dim=32)


@pytest.mark.parametrize("n", [1, WRITER_WARPS - 1, WRITER_WARPS, WRITER_WARPS + 1, 37])
def test_one_warp_per_token_and_the_cache_geometry(recorded, n):
    kernels, launches, pointed = recorded
    cache = qm.MLACache.allocate(FMT, 3, 2, 4, 8, "cpu")
    W.write(cache, *_inputs(n, FMT))
    assert [(s, k) for s, k, _ in kernels] == [("writer.cu", "qmla_write")]
    assert kernels[0][2]["QMLA_IN_BF16"] == 0 and kernels[0][2]["QMLA_WRITER_WARPS"] == WRITER_WARPS
    (fn, grid, block, args, dev), = launches
    assert grid == (-(-n // WRITER_WARPS),) and grid[0] * WRITER_WARPS >= n > (grid[0] - 1) * WRITER_WARPS
    assert block == (WRITER_WARPS * 32,) and dev == 0
    scalars = [int(a) for a in args[9:]]
    assert scalars == [n, 3 * FMT.page_size, 2, 4, 8]
    assert [type(a) for a in args[9:]] == [np.int32, np.int64, np.int32, np.int32, np.int32]
    slots, ids, pos, lens = pointed[2:6]
    for x in (slots, ids, pos, lens):
        assert x.dtype == torch.int64 and x.is_contiguous()
    assert pointed[6] is cache.pages and pointed[7] is cache.sink_buf and pointed[8] is cache.local_buf


def test_no_tokens_build_and_launch_nothing(recorded):
    kernels, launches, _ = recorded
    cache = qm.MLACache.allocate(FMT, 3, 2, 4, 8, "cpu")
    W.write(cache, *_inputs(0, FMT))
    assert kernels == [] and launches == []


def test_rows_are_16_byte_aligned_and_copied_only_when_not(recorded):
    _, _, pointed = recorded
    cache = qm.MLACache.allocate(FMT, 3, 2, 4, 8, "cpu")
    aligned = _inputs(5, FMT)
    W.write(cache, *aligned)
    assert pointed[0] is aligned[0] and pointed[0].data_ptr() % 16 == 0
    pointed.clear()
    shifted = _inputs(5, FMT, misaligned=True)
    assert shifted[0].data_ptr() % 16 == 4
    W.write(cache, *shifted)
    assert pointed[0] is not shifted[0] and pointed[0].data_ptr() % 16 == 0 and torch.equal(pointed[0], shifted[0])


def test_bfloat16_inputs_build_the_bf16_kernel_once(recorded):
    kernels, launches, _ = recorded
    cache = qm.MLACache.allocate(FMT, 3, 2, 4, 8, "cpu")
    W.write(cache, *_inputs(3, FMT, torch.bfloat16))
    W.write(cache, *_inputs(4, FMT, torch.bfloat16))
    assert len(kernels) == 1 and kernels[0][2]["QMLA_IN_BF16"] == 1 and len(launches) == 2


def test_a_cache_that_is_not_contiguous_is_refused(recorded):
    cache = qm.MLACache.allocate(FMT, 3, 2, 4, 8, "cpu")
    wide = torch.zeros(3, 2 * FMT.page_bytes, dtype=torch.uint8)
    strided = qm.MLACache(FMT, wide[:, : FMT.page_bytes], cache.sink_buf, cache.local_buf, 2, 4, 8)
    with pytest.raises(ValueError, match="cache.pages: the CuPy backend writes in place and needs a contiguous tensor"):
        W.write(strided, *_inputs(2, FMT))
