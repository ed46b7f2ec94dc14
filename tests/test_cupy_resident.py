"""``backends.cupy.resident_ctas`` on the CPU, with a stand-in ``cupy`` module: the driver's occupancy per SM times
the SM count, cached per kernel and launch shape; the sm_90 register and shared-memory arithmetic where the driver
query fails; never fewer than one CTA an SM (every split plan divides by it)."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest

from quantmla_core.backends import cupy as C


class _Driver:
    def __init__(self, per_sm):
        self.per_sm, self.asked = per_sm, []

    def occupancyMaxActiveBlocksPerMultiprocessor(self, ptr, threads, smem):  # noqa: N802 (CuPy's name)
        self.asked.append((ptr, threads, smem))
        if isinstance(self.per_sm, Exception):
            raise self.per_sm
        return self.per_sm


@pytest.fixture
def driver(monkeypatch):
    """A stand-in ``cupy`` whose driver answers what the test sets; the cache starts empty."""
    d = _Driver(3)
    fake = SimpleNamespace(cuda=SimpleNamespace(Device=lambda index: contextlib.nullcontext(), driver=d))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(C, "_RESIDENT", {})
    return d


def _fn(ptr=7, regs=255, static_smem=0):
    return SimpleNamespace(kernel=SimpleNamespace(ptr=ptr), num_regs=regs, shared_size_bytes=static_smem)


def test_the_drivers_occupancy_times_the_sm_count_cached_per_launch_shape(driver):
    fn = _fn()
    assert C.resident_ctas(fn, 128, 4096, 0, 132) == 3 * 132
    assert driver.asked == [(7, 128, 4096)]  # the loaded function's handle, the block and the dynamic shared bytes
    driver.per_sm = 1
    assert C.resident_ctas(fn, 128, 4096, 0, 132) == 3 * 132  # cached: not asked again
    assert C.resident_ctas(fn, 256, 4096, 0, 132) == 132  # another block size is another launch shape
    assert C.resident_ctas(fn, 128, 8192, 0, 132) == 132
    assert driver.asked[1:] == [(7, 256, 4096), (7, 128, 8192)]


def test_at_least_one_cta_an_sm(driver):
    driver.per_sm = 0  # a launch the driver says cannot be resident still runs, one CTA an SM at a time
    assert C.resident_ctas(_fn(), 1024, 200_000, 0, 132) == 132


def test_the_sm90_arithmetic_where_the_driver_query_fails(driver):
    driver.per_sm = RuntimeError("no occupancy API")
    # 255 registers x 128 threads: two CTAs by registers; the static shared bytes count with the dynamic ones
    assert C.resident_ctas(_fn(regs=255), 128, 57088, 0, 132) == 2 * 132
    assert C.resident_ctas(_fn(ptr=8, regs=32, static_smem=60 * 1024), 128, 40 * 1024, 0, 132) == 2 * 132
    assert C.resident_ctas(_fn(ptr=9, regs=32), 128, 40 * 1024, 0, 132) == 5 * 132
