"""``backends.cupy.launch`` and ``external_stream`` on the CPU with a stand-in ``cupy``: the driver's
``cuLaunchKernel`` gets the function handle, grid and block padded to three sizes, the shared bytes, the stream's
handle and the packed arguments' address; a launch for another device than the current one switches to it; the
stream is torch's current one unless given, wrapped once per (device, handle)."""

from __future__ import annotations

import contextlib
import ctypes
import struct
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from quantmla_core.backends import cupy as C


@pytest.fixture
def fake(monkeypatch):
    rec = SimpleNamespace(launches=[], devices=[], wrapped=[], current=0)

    @contextlib.contextmanager
    def device(index):
        rec.devices.append(index)
        yield

    def launch_kernel(fptr, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # the kernel's parameters as the driver would read them: one pointer per argument
        ptrs = (ctypes.c_void_p * 2).from_address(params)
        first = ctypes.c_uint64.from_address(ptrs[0]).value
        second = struct.unpack("<i", ctypes.string_at(ptrs[1], 4))[0]
        rec.launches.append((fptr, (gx, gy, gz), (bx, by, bz), smem, stream, extra, (first, second)))

    def external(ptr, index):
        rec.wrapped.append((ptr, index))
        return SimpleNamespace(ptr=ptr)

    fake = SimpleNamespace(cuda=SimpleNamespace(
        Device=device, ExternalStream=external,
        runtime=SimpleNamespace(getDevice=lambda: rec.current),
        driver=SimpleNamespace(launchKernel=launch_kernel)))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(C, "_STREAMS", {})
    monkeypatch.setattr(C, "_RAW_STREAM", [lambda dev: 1000 + dev])  # torch's current stream handle of a device
    return rec


FN = SimpleNamespace(kernel=SimpleNamespace(ptr=0xABC))


def test_launch_passes_the_launch_shape_stream_and_packed_arguments(fake):
    C.launch(FN, (5,), (128,), (np.uint64(0xDEAD0000), np.int32(-7)), 0, smem=4096)
    (fptr, grid, block, smem, stream, extra, args), = fake.launches
    assert (fptr, grid, block, smem, stream, extra) == (0xABC, (5, 1, 1), (128, 1, 1), 4096, 1000, 0)
    assert args == (0xDEAD0000, -7)
    assert fake.devices == []  # already the current device: no switch
    C.launch(FN, (2, 3, 4), (32, 2), (0xBEEF, 9), 0, types=(np.uint64, np.int32))
    assert fake.launches[-1][1:3] == ((2, 3, 4), (32, 2, 1)) and fake.launches[-1][-1] == (0xBEEF, 9)


def test_launch_on_another_device_switches_to_it_and_uses_its_stream(fake):
    C.launch(FN, (1,), (32,), (np.uint64(1), np.int32(2)), 1)
    assert fake.devices == [1] and fake.launches[-1][4] == 1001


def test_a_given_stream_is_used_and_streams_are_wrapped_once_a_handle(fake):
    given = SimpleNamespace(ptr=77)
    C.launch(FN, (1,), (32,), (np.uint64(1), np.int32(2)), 0, stream=given)
    assert fake.launches[-1][4] == 77 and fake.wrapped == []
    a = C.external_stream(0)
    assert C.external_stream(0) is a and fake.wrapped == [(1000, 0)]
    assert C.external_stream(0, SimpleNamespace(cuda_stream=55)).ptr == 55
    same_handle = SimpleNamespace(cuda_stream=55)
    assert C.external_stream(1, same_handle) is not C.external_stream(0, same_handle)
    assert fake.wrapped == [(1000, 0), (55, 0), (55, 1)]  # a handle is wrapped per device
