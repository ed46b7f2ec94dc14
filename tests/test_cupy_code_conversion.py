"""The 2-bit code conversion of CuPy kernel v5's ``QMLA_CODES_IN_PLACE`` (``common.cuh``'s
``qmla_code2_in_place``), checked without a GPU.

Converting a code where it lies in its byte (bf16 128 + 2^p code, zero point at 2^p, scale divided by 2^p) gives
the same bf16 as shifting it to bit 0 first (bf16 128 + code), which is bf16(s (code - z)), for every byte, slice,
zero point and a spread of scales. The model follows the kernel's bit operations and rounds bf16 products to
nearest even, as ``fma.rn.bf16x2`` does; the byte moves (prmt selectors) are checked against a model of prmt. A
negative control shows that converting the top slice at its own bit 6 (one bit of the code in the exponent) is
caught.
"""

from __future__ import annotations

import numpy as np
import pytest

from quantmla_core.backends.cupy import KERNEL_DIR


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float64 values -> bf16 bits, rounded to nearest even (the values here are exact in float32)."""
    f = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((f + 0x7FFF + ((f >> 16) & 1)) >> 16).astype(np.uint32)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).view(np.float32).astype(np.float64)


def byte_perm(x: int, y: int, sel: int) -> int:
    """CUDA's __byte_perm / PTX prmt (default mode): byte i of the result is byte (sel >> 4 i) & 7 of y:x."""
    src = (y << 32) | x
    return sum(((src >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))


def code_pos(c: int) -> int:
    """common.cuh's qmla_code_pos."""
    return 2 * c if c < 3 else 4


def half_in_place(byte: np.ndarray, c: int, pos=code_pos) -> np.ndarray:
    """One half of qmla_code2_in_place: the byte in the half's low byte (qmla_pair_bytes), shifted by 2 for the
    top slice when its code goes to bit 4, masked to the slice's code and or-ed with the exponent byte 0x43."""
    y = byte >> (2 * c - pos(c))
    return (y & (3 << pos(c))) | 0x4300


def dequantize_in_place(byte, c, z, s_bits, pos=code_pos):
    """bf16 bits of the kernel's (128 + 2^p code) - (128 + 2^p z), times s / 2^p, rounded once."""
    p = pos(c)
    d = bf16_value(half_in_place(byte, c, pos)) + bf16_value(0xC300 | (z << p))  # fma(c2, 1, off2): exact
    s_p = bf16_value(s_bits) * bf16_value(0x3F80 - (p << 7))  # qmla_s2_in_place's multiplier, from its bits
    assert np.array_equal(bf16_value(bf16_bits(s_p)), s_p)  # exact: a power of two, normal scales
    return bf16_bits(d * s_p)


def dequantize_reference(byte, c, z, s_bits):
    """bf16(s (code - z)) with the code shifted to bit 0 (the 4-bit path's and the old 2-bit path's result)."""
    code = (byte >> (2 * c)) & 3
    return bf16_bits((code.astype(np.float64) - z) * bf16_value(s_bits))


def scale_bits() -> np.ndarray:
    rng = np.random.default_rng(7)
    spread = rng.uniform(-30, 10, 4000)
    s = np.exp2(spread) * rng.uniform(1, 2, spread.size)
    s = np.concatenate([s, [1e-8 / 3, 1.0, 3.0, 0.0078125, 65504.0]])  # DESIGN 3.1's smallest scale, powers, a max
    return np.unique(bf16_bits(s))


@pytest.mark.parametrize("c", range(4))
@pytest.mark.parametrize("z", range(4))
def test_in_place_conversion_is_bit_identical(c, z):
    byte = np.arange(256, dtype=np.uint32)[:, None]
    s = scale_bits()[None, :]
    got = dequantize_in_place(byte, c, z, s)
    want = dequantize_reference(byte, c, z, s)
    assert np.array_equal(got, want), f"slice {c}, zero point {z}: {(got != want).sum()} values differ"


def test_zero_scale_stays_zero():
    """Tokens past L load zero scales and codes: their keys must stay 0 (no NaN into PV), which holds while the
    scale is divided by multiplying with a finite multiplier (an infinite one, 0x7f80, would give NaN)."""
    for c in range(4):
        got = dequantize_in_place(np.arange(256, dtype=np.uint32), c, 0, np.uint32(0))
        assert np.all(bf16_value(got) == 0.0)


def test_top_slice_at_its_own_bit_is_caught():
    """Control: converting slice 3 at its own bit 6 puts the code's high bit into the exponent (bf16 0x4380 is
    256, not 128 + 128), so the model must see different results."""
    byte = np.arange(256, dtype=np.uint32)[:, None]
    s = scale_bits()[None, :]
    got = dequantize_in_place(byte, 3, 1, s, pos=lambda c: 2 * c)
    assert not np.array_equal(got, dequantize_reference(byte, 3, 1, s))


def test_byte_moves_of_the_kernel():
    """The selectors pinned below do what the conversion needs: qmla_m43 gives 0x43004300 from any word with low
    byte 0x43 (c43 = 0x43 | L << 8), and qmla_pair_bytes puts bytes 0, 1 (2, 3) in the low bytes of the halves.
    Control: the byte order reversed (0x4040) gives 0x00430043."""
    for length in (0, 1, 4097, 1 << 20):
        c43 = 0x43 | (length << 8) & 0xFFFFFFFF
        assert byte_perm(c43, 0, 0x0404) == 0x43004300
        assert byte_perm(c43, 0, 0x4040) == 0x00430043
    w = 0xD4C3B2A1
    for sel, (lo, hi) in ((0x1100, (0xA1, 0xB2)), (0x3322, (0xC3, 0xD4))):
        d = byte_perm(w, w, sel)
        assert (d & 0xFF, (d >> 16) & 0xFF) == (lo, hi)


def test_model_matches_kernel_source():
    """Pin the expressions this model encodes to the kernel texts."""
    common = " ".join((KERNEL_DIR / "common.cuh").read_text().split())
    for expr in (
        "qmla_code_pos(int c) { return c < 3 ? 2 * c : 4; }",
        'asm("prmt.b32 %0, %1, %1, %2;" : "=r"(d) : "r"(w), "n"(HI ? 0x3322 : 0x1100));',
        "return ((c == 3 ? y >> 2 : y) & (0x00030003u << qmla_code_pos(c))) | m43;",
        "return 0xc300c300u | (z << p) | (z << (16 + p));",
        "return p ? fma_bf16x2(s2, (0x3f80u - ((u32)p << 7)) * 0x10001u, 0x80008000u) : s2;",
        "qmla_m43(u32 x) { return __byte_perm(x, 0u, 0x0404); }",
    ):
        assert expr in common, f"common.cuh no longer contains: {expr}"
    for name in ("attention_v5.cu",):
        src = " ".join((KERNEL_DIR / name).read_text().split())
        assert all(x in src for x in ("#define QMLA_CODES_IN_PLACE 0", "qmla_code2_in_place(", "qmla_pair_bytes<")), name
        assert "const u32 m43 = qmla_m43(" in src, f"{name}: m43 = 0x43004300 from a register"
