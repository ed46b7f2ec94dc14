"""Small ``@triton.jit`` helpers shared by the writer and attention kernels.

bfloat16 values are moved as their uint16 bit patterns and widened/narrowed with integer
ops, which is exact, portable, and also right in the Triton interpreter (whose bfloat16
arithmetic is not).
"""

from __future__ import annotations

import triton
import triton.language as tl

#: largest finite bfloat16 (stored scales are clamped to it, DESIGN.md §3.1)
BF16_MAX: tl.constexpr = tl.constexpr(3.3895313892515355e38)
FLOAT32_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
#: 2^64 and 2^-64, exact in float32: the writer's pre-scaling of reciprocals and values
TWO_POW_64: tl.constexpr = tl.constexpr(18446744073709551616.0)
TWO_POW_M64: tl.constexpr = tl.constexpr(5.421010862427522e-20)
#: 1.5 * 2^23: a float32 in [MAGIC, MAGIC + 2^22) holds the integer (value - MAGIC) in its low
#: mantissa bits, so adding it rounds a value to an integer (half to even)
MAGIC: tl.constexpr = tl.constexpr(12582912.0)


@triton.jit
def bf16_bits_to_f32(bits):
    """uint16/int bfloat16 bit patterns -> float32 values (exact)."""
    return (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> uint16 bit pattern of the nearest bfloat16 (round half to even)."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.to(tl.uint16)


@triton.jit
def load_f32(ptr, offs, mask, IS_BF16: tl.constexpr):
    """Load float32 or bfloat16 values (``ptr`` typed as stored) as float32; masked lanes read 0."""
    if IS_BF16:
        p16 = ptr.to(tl.pointer_type(tl.uint16))
        return bf16_bits_to_f32(tl.load(p16 + offs, mask=mask, other=0))
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_f32(ptr, offs, x, mask, IS_BF16: tl.constexpr):
    """Store float32 ``x`` as float32, or as bfloat16 rounded half to even."""
    if IS_BF16:
        p16 = ptr.to(tl.pointer_type(tl.uint16))
        tl.store(p16 + offs, f32_to_bf16_bits(x), mask=mask)
    else:
        tl.store(ptr + offs, x, mask=mask)


@triton.jit
def channel_of(j):
    """The channel that column ``j`` of kernel v4's key tiles holds with ``CHANNEL_ORDER`` (``attention_v4_loaders``'
    ``_plane`` and ``to_channel_order``): ``j`` with bits 0 and 1 swapped, so columns ``4q .. 4q + 3`` hold channels
    ``4q, 4q + 2, 4q + 1, 4q + 3``. Its own inverse: the merge kernel reads the protected parts (plain order) through
    it."""
    return (j & -4) | ((j & 1) << 1) | ((j >> 1) & 1)


@triton.jit
def to_channel_order(x, N: tl.constexpr, C: tl.constexpr):
    """``x`` ``[N, C]`` rearranged so that column ``j`` holds column ``channel_of(j)`` (C a multiple of 4): plain
    order into the channel order and, the map being its own inverse, back (``attention_v4_loaders.to_channel_order``
    in Gluon)."""
    y0, y1 = tl.split(tl.reshape(x, [N, C // 4, 2, 2]))  # columns 4q + 2a and 4q + 2a + 1
    c0, c2 = tl.split(y0)
    c1, c3 = tl.split(y1)
    return tl.reshape(tl.join(tl.join(c0, c1), tl.join(c2, c3)), [N, C])


@triton.jit
def rint(x):
    """Round half to even for |x| < 2**22 (codes and zero points are far below that): adding and
    removing 1.5 * 2**23 leaves no fraction bits, and the float32 add itself rounds half to even."""
    return (x + MAGIC) - MAGIC


@triton.jit
def pdl_launch_dependents(PDL: tl.constexpr):
    """With PDL (programmatic dependent launch, sm_90+): let the next kernel on the stream, launched with
    ``launch_pdl``, start its programs now; they wait in :func:`pdl_wait` for this kernel to finish. Nothing
    without PDL (the branch is not compiled: ROCm and the interpreter never see the instruction)."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0 unused", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """With PDL: wait until the kernel before this one on the stream has finished and its writes are visible
    (a no-op on a launch without ``launch_pdl``). Nothing without PDL."""
    if PDL:
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0 unused", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
