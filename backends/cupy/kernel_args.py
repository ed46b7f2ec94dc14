"""Kernel arguments as ``cuLaunchKernel`` takes them, packed with one ``struct`` call.

A launch passes ``kernelParams``: an array of pointers, one per kernel parameter, each to a value
of the parameter's size. Here every value sits in one buffer at its natural alignment (the layout
of the kernel's parameter list), and the pointer array points into it. The layout is computed once
per tuple of argument types; each thread reuses one buffer per layout, which is safe because the
driver copies the values before ``cuLaunchKernel`` returns. This replaces CuPy's per-argument
conversion in ``Function.__call__`` (host time that short decode calls pay on every launch).
"""

from __future__ import annotations

import ctypes
import struct
import threading
from dataclasses import dataclass

import numpy as np

#: numpy scalar type -> ``struct`` code of the C parameter it fills (pointers travel as uint64)
_CODES = {np.uint64: "Q", np.int64: "q", np.uint32: "I", np.int32: "i", np.float32: "f"}


@dataclass(frozen=True)
class ArgLayout:
    """Byte layout of one parameter list: ``packer`` writes the values, ``offsets`` locate them."""

    packer: struct.Struct
    offsets: tuple[int, ...]


_LAYOUTS: dict[tuple[type, ...], ArgLayout] = {}
_LOCAL = threading.local()


def arg_layout(types: tuple[type, ...]) -> ArgLayout:
    """The layout of parameters of numpy scalar ``types`` (cached): each value aligned to its size.
    Raises ``TypeError`` naming the first argument of another type."""
    layout = _LAYOUTS.get(types)
    if layout is None:
        fmt, offset, offsets = "<", 0, []
        for i, t in enumerate(types):
            code = _CODES.get(t)
            if code is None:
                allowed = ", ".join(c.__name__ for c in _CODES)
                raise TypeError(f"kernel argument {i}: expected a numpy scalar ({allowed}), got {t.__name__}")
            size = struct.calcsize(code)
            pad = -offset % size
            fmt += "x" * pad + code
            offset += pad
            offsets.append(offset)
            offset += size
        layout = _LAYOUTS.setdefault(types, ArgLayout(struct.Struct(fmt), tuple(offsets)))
    return layout


class PackedArgs:
    """One buffer of parameter values and the ``kernelParams`` array pointing into it."""

    __slots__ = ("buffer", "params")

    def __init__(self, layout: ArgLayout):
        self.buffer = ctypes.create_string_buffer(max(1, layout.packer.size))
        base = ctypes.addressof(self.buffer)
        self.params = (ctypes.c_void_p * max(1, len(layout.offsets)))(*(base + o for o in layout.offsets))

    @property
    def address(self) -> int:
        """Address of the pointer array (``kernelParams``)."""
        return ctypes.addressof(self.params)


def pack_args(args: tuple, types: tuple[type, ...] | None = None) -> PackedArgs:
    """``args`` packed into this thread's buffer for their layout; valid until the thread packs the same
    layout again. ``args``: numpy scalars, or, with ``types`` (the numpy scalar type of each parameter),
    Python ints and floats as well (a launcher that knows its parameter list skips wrapping every
    pointer in a numpy scalar on every call)."""
    if types is None:
        types = tuple(map(type, args))
    elif len(types) != len(args):
        raise ValueError(f"kernel arguments: {len(args)} values for {len(types)} parameter types")
    layout = arg_layout(types)
    buffers = getattr(_LOCAL, "buffers", None)
    if buffers is None:
        buffers = _LOCAL.buffers = {}
    packed = buffers.get(types)
    if packed is None:
        packed = buffers[types] = PackedArgs(layout)
    layout.packer.pack_into(packed.buffer, 0, *args)
    return packed
