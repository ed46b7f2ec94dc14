"""The CuPy launcher's argument packing (``backends/cupy/kernel_args.py``): the byte layout of a
parameter list, the pointer array cuLaunchKernel reads, errors, per-thread buffers, and (GPU) a
kernel that echoes its parameters back."""

from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np
import pytest

from quantmla_core.backends.cupy.kernel_args import arg_layout, pack_args
from test_cupy_backend import gpu

u64, i64, i32, u32, f32 = np.uint64, np.int64, np.int32, np.uint32, np.float32

#: a parameter list in the order the C ABI pads: (pointer, int, pointer, float, long long, int, unsigned)
MIXED = (u64(0x1122334455667788), i32(-5), u64(0xDEADBEEF00), f32(1.5), i64(-(1 << 40)), i32(7), u32(0xFFFFFFFE))


def test_layout_golden_bytes():
    """Each value at its natural alignment, little-endian, padding zero: the layout of the same C
    parameter list (pointer at 0, int at 8, pointer at 16 after 4 padding bytes, ...)."""
    layout = arg_layout(tuple(map(type, MIXED)))
    assert layout.offsets == (0, 8, 16, 24, 32, 40, 44)
    assert layout.packer.size == 48
    packed = pack_args(MIXED)
    raw = bytes(packed.buffer)[:48]
    golden = bytes.fromhex(
        "8877665544332211"  # u64
        "fbffffff" "00000000"  # i32 -5, padding to 8
        "00efbeadde000000"  # u64
        "0000c03f" "00000000"  # f32 1.5, padding
        "0000000000ffffff"  # i64 -(1 << 40)
        "07000000"  # i32 7
        "feffffff"  # u32
    )
    assert raw == golden, raw.hex()


def test_params_point_at_the_values():
    packed = pack_args(MIXED)
    ctype = {u64: ctypes.c_uint64, i64: ctypes.c_int64, i32: ctypes.c_int32, u32: ctypes.c_uint32, f32: ctypes.c_float}
    got = [ctype[type(a)].from_address(packed.params[k]).value for k, a in enumerate(MIXED)]
    assert got == [a.item() for a in MIXED]
    assert packed.address == ctypes.addressof(packed.params)


@pytest.mark.parametrize("bad,name", [(3, "int"), (np.float64(1.0), "float64"), ("x", "str"), (np.int8(1), "int8")])
def test_unsupported_argument_is_named(bad, name):
    """A Python int (no size) or a type no kernel parameter has is refused, naming the position."""
    with pytest.raises(TypeError, match=rf"kernel argument 2: expected a numpy scalar \(uint64, int64, uint32, "
                                        rf"int32, float32\), got {name}"):
        pack_args((u64(1), i32(2), bad))


def test_buffers_are_reused_per_thread_and_layout():
    """One thread packs the same layout into one buffer (the driver copies it at launch); another
    thread, or another layout, gets its own, so concurrent launches never share a buffer."""
    first = pack_args(MIXED)
    again = pack_args((u64(1), i32(2), u64(3), f32(4), i64(5), i32(6), u32(7)))
    assert again is first
    other_layout = pack_args((i32(1), u64(2)))
    assert other_layout is not first and arg_layout((i32, u64)).offsets == (0, 8)
    seen = []
    t = threading.Thread(target=lambda: seen.append(pack_args(MIXED)))
    t.start()
    t.join()
    assert seen[0] is not first
    # the other thread's values did not land in this thread's buffer
    values = pack_args((u64(9), i32(0), u64(0), f32(0), i64(0), i32(0), u32(0)))
    assert struct.unpack_from("<Q", values.buffer, 0)[0] == 9


def test_empty_parameter_list():
    packed = pack_args(())
    assert arg_layout(()).offsets == () and packed.address != 0


ECHO = r"""
extern "C" __global__ void echo(unsigned long long a, int b, const void* c, float d, long long e, int f,
                                unsigned int g, unsigned long long* out) {
    out[0] = a; out[1] = (unsigned long long)(long long)b; out[2] = (unsigned long long)c;
    out[3] = __float_as_uint(d); out[4] = (unsigned long long)e; out[5] = (unsigned long long)(long long)f;
    out[6] = g; out[7] = blockDim.x * gridDim.y;
}
"""


@gpu
def test_launch_passes_every_parameter_type():
    """``launch`` (cuLaunchKernel on the packed buffer) hands a kernel each value where its C
    parameter list expects it, on torch's current stream, with 2-D grids."""
    import cupy
    import torch

    from quantmla_core.backends.cupy import launch

    fn = cupy.RawModule(code=ECHO).get_function("echo")
    out = torch.full((8,), -1, dtype=torch.int64, device="cuda")
    args = MIXED[:2] + (u64(0xABCDEF0),) + MIXED[3:] + (u64(out.data_ptr()),)
    launch(fn, (1, 3), (32,), args, torch.cuda.current_device())
    torch.cuda.synchronize()
    got = [int(v) & (2**64 - 1) for v in out.tolist()]
    assert got == [0x1122334455667788, 2**64 - 5, 0xABCDEF0, struct.unpack("<I", struct.pack("<f", 1.5))[0],
                   2**64 - (1 << 40), 7, 0xFFFFFFFE, 96]


def test_typed_python_numbers_pack_as_their_numpy_scalars():
    """With the parameter types given, Python ints and floats pack to the bytes of the numpy scalars
    of those types (float32 rounded as numpy rounds); a count that does not match the types is refused."""
    types = tuple(map(type, MIXED))
    plain = tuple(int(v) if not isinstance(v, np.floating) else float(v) for v in MIXED)
    assert bytes(pack_args(plain, types).buffer) == bytes(pack_args(MIXED).buffer)
    x = 0.05 * 1.4426950408889634  # not a float32: both round it the same way
    assert bytes(pack_args((x,), (f32,)).buffer)[:4] == f32(x).tobytes()
    with pytest.raises(ValueError, match="3 values for 2 parameter types"):
        pack_args((1, 2, 3), (u64, i32))
    with pytest.raises(TypeError, match="kernel argument 1"):
        pack_args((1, 2), (u64, float))
