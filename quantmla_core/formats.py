"""Packed page formats: the single source of truth for the cache byte layout.

A page is one row of the ``uint8`` cache array ``[num_pages, page_bytes]`` and holds
``page_size`` (P) tokens. Quantized formats store six sections, each contiguous,
token-major, and starting at a 128-byte-aligned offset (layout version 1)::

    offset 0                      content codes   P x (d_c * b_c / 8)  uint8, split-half packed
    content_codes_offset + ...    RoPE codes      P x (d_r * b_r / 8)  uint8, split-half packed
    content_scales_offset         content scales  P x (d_c / G_c)      bfloat16 (little endian)
    content_zeros_offset          content zeros   P x (d_c / G_c)      uint8
    rope_scales_offset            RoPE scales     P x (d_r / G_r)      float32 (little endian)
    rope_zeros_offset             RoPE zeros      P x (d_r / G_r)      uint8
    page_bytes = end of last section rounded up to 128

For C4R4, d_c=512, d_r=64, G=64, P=64 the offsets are 0, 16384, 18432, 19456, 19968,
20224 and ``page_bytes`` = 20352 (318 B/token against 1152 B/token in BF16).

Split-half packing (layout version 1): within one token's d-wide vector packed at b bits,
byte j holds elements ``j, j + d/k, j + 2d/k, ...`` (k = 8 / b elements per byte), element
``j + i*d/k`` in bits ``[i*b, (i+1)*b)``. 8-bit codes are stored as they are.

The ``BF16`` format (the in-library baseline) has two sections, content values then RoPE
values, both bfloat16, and no scales: 73728 B per 64-token page at the default dims.

Group sizes: a group never spans two tokens; a vector shorter than the group size
(d_r = 32 with G = 64) forms a single group (``rope_group_size`` is then ``d_r``).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

SECTION_ALIGN = 128
LAYOUT_VERSIONS = (1,)
VALID_BITS = (2, 4, 8)
VALID_PAGE_SIZES = (16, 32, 64, 128)
VALID_GROUP_SIZES = (32, 64, 128)

_NAME_RE = re.compile(r"^C([248])R([248])$")


def _align(n: int, a: int = SECTION_ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class PackFormat:
    """Layout of one packed MLA cache page (see the module docstring for the byte map).

    Build with :meth:`parse`. ``content_bits``/``rope_bits`` are 2, 4 or 8 for quantized
    formats and 16 for ``BF16`` (``quantized`` is then False).
    """

    content_bits: int
    rope_bits: int
    latent_dim: int = 512
    rope_dim: int = 64
    group_size: int = 64
    page_size: int = 64
    version: int = 1
    content_scale_dtype: str = field(default="bfloat16")
    rope_scale_dtype: str = field(default="float32")

    # ------------------------------------------------------------------ construction
    @classmethod
    def parse(
        cls,
        name: str,
        latent_dim: int = 512,
        rope_dim: int = 64,
        group_size: int = 64,
        page_size: int = 64,
        version: int = 1,
    ) -> "PackFormat":
        """Parse ``"C4R4"``, ``"C2R4"``, ``"C4R8"``, ``"C8R8"``, ``"C2R2"``, ... or ``"BF16"``."""
        if not isinstance(name, str):
            raise TypeError(f"format name: expected a str like 'C4R4' or 'BF16', got {type(name).__name__}")
        key = name.strip().upper()
        if key == "BF16":
            return cls(16, 16, latent_dim, rope_dim, group_size, page_size, version)
        m = _NAME_RE.match(key)
        if not m:
            raise ValueError(
                f"format name: expected 'C<b>R<b>' with bits in {VALID_BITS} (e.g. 'C4R4') or 'BF16', got {name!r}"
            )
        return cls(int(m.group(1)), int(m.group(2)), latent_dim, rope_dim, group_size, page_size, version)

    def __post_init__(self) -> None:
        for arg, bits in (("content_bits", self.content_bits), ("rope_bits", self.rope_bits)):
            if bits not in VALID_BITS and bits != 16:
                raise ValueError(f"{arg}: expected one of {VALID_BITS} (or 16 for BF16), got {bits}")
        if (self.content_bits == 16) != (self.rope_bits == 16):
            raise ValueError(
                f"content_bits/rope_bits: BF16 must apply to both paths, got content_bits={self.content_bits}, "
                f"rope_bits={self.rope_bits}"
            )
        if (self.content_scale_dtype, self.rope_scale_dtype) != ("bfloat16", "float32"):
            raise ValueError(
                "content_scale_dtype/rope_scale_dtype: layout version 1 stores bfloat16 content scales and float32 "
                f"RoPE scales, got {self.content_scale_dtype!r}/{self.rope_scale_dtype!r}"
            )
        if self.version not in LAYOUT_VERSIONS:
            raise ValueError(f"version: expected one of {LAYOUT_VERSIONS}, got {self.version}")
        if self.page_size not in VALID_PAGE_SIZES:
            raise ValueError(f"page_size: expected one of {VALID_PAGE_SIZES}, got {self.page_size}")
        if self.group_size not in VALID_GROUP_SIZES:
            raise ValueError(f"group_size: expected one of {VALID_GROUP_SIZES}, got {self.group_size}")
        for arg, dim in (("latent_dim", self.latent_dim), ("rope_dim", self.rope_dim)):
            if not isinstance(dim, int) or dim <= 0 or dim % 32:
                raise ValueError(f"{arg}: expected a positive multiple of 32, got {dim}")
        if self.quantized:
            if self.latent_dim % self.content_group_size:
                raise ValueError(
                    f"latent_dim: expected a multiple of group_size={self.group_size}, got {self.latent_dim}"
                )
            if self.rope_dim % self.rope_group_size:
                raise ValueError(f"rope_dim: expected a multiple of group_size={self.group_size}, got {self.rope_dim}")

    # ------------------------------------------------------------------ naming
    @property
    def name(self) -> str:
        return "BF16" if not self.quantized else f"C{self.content_bits}R{self.rope_bits}"

    @property
    def quantized(self) -> bool:
        return self.content_bits != 16

    def __str__(self) -> str:
        return (
            f"{self.name}(d_c={self.latent_dim}, d_r={self.rope_dim}, G={self.group_size}, "
            f"P={self.page_size}, v{self.version})"
        )

    # ------------------------------------------------------------------ per-token sizes
    @property
    def content_group_size(self) -> int:
        return min(self.group_size, self.latent_dim)

    @property
    def rope_group_size(self) -> int:
        return min(self.group_size, self.rope_dim)

    @property
    def content_groups(self) -> int:
        """Groups per token in the content path (``d_c / G_c``)."""
        return self.latent_dim // self.content_group_size if self.quantized else 0

    @property
    def rope_groups(self) -> int:
        return self.rope_dim // self.rope_group_size if self.quantized else 0

    @property
    def content_code_bytes(self) -> int:
        """Bytes of one token's content codes (or BF16 values)."""
        return self.latent_dim * self.content_bits // 8

    @property
    def rope_code_bytes(self) -> int:
        return self.rope_dim * self.rope_bits // 8

    @property
    def content_scale_bytes(self) -> int:
        """Bytes of one token's content scales (bfloat16 each)."""
        return self.content_groups * 2

    @property
    def content_zero_bytes(self) -> int:
        return self.content_groups

    @property
    def rope_scale_bytes(self) -> int:
        """Bytes of one token's RoPE scales (float32 each)."""
        return self.rope_groups * 4

    @property
    def rope_zero_bytes(self) -> int:
        return self.rope_groups

    @property
    def packed_token_bytes(self) -> int:
        """Bytes one token occupies across all sections, without alignment padding."""
        return (
            self.content_code_bytes
            + self.rope_code_bytes
            + self.content_scale_bytes
            + self.content_zero_bytes
            + self.rope_scale_bytes
            + self.rope_zero_bytes
        )

    # ------------------------------------------------------------------ page sections
    def _section_sizes(self) -> tuple[tuple[str, int], ...]:
        p = self.page_size
        sizes = [("content_codes", p * self.content_code_bytes), ("rope_codes", p * self.rope_code_bytes)]
        if self.quantized:
            sizes += [
                ("content_scales", p * self.content_scale_bytes),
                ("content_zeros", p * self.content_zero_bytes),
                ("rope_scales", p * self.rope_scale_bytes),
                ("rope_zeros", p * self.rope_zero_bytes),
            ]
        return tuple(sizes)

    @functools.cached_property
    def _section_map(self) -> dict[str, tuple[int, int]]:
        # computed once per format (the layout is immutable); every launch reads offsets and page_bytes
        out: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in self._section_sizes():
            out[name] = (offset, size)
            offset = _align(offset + size)
        return out

    @property
    def sections(self) -> dict[str, tuple[int, int]]:
        """``{section name: (byte offset in page, byte size)}`` in page order (a new dict each call)."""
        return dict(self._section_map)

    def _offset(self, section: str) -> int:
        entry = self._section_map.get(section)
        if entry is None:
            raise AttributeError(f"format {self.name} has no section {section!r}")
        return entry[0]

    @property
    def content_codes_offset(self) -> int:
        return self._offset("content_codes")

    @property
    def rope_codes_offset(self) -> int:
        return self._offset("rope_codes")

    @property
    def content_scales_offset(self) -> int:
        return self._offset("content_scales")

    @property
    def content_zeros_offset(self) -> int:
        return self._offset("content_zeros")

    @property
    def rope_scales_offset(self) -> int:
        return self._offset("rope_scales")

    @property
    def rope_zeros_offset(self) -> int:
        return self._offset("rope_zeros")

    @property
    def page_bytes(self) -> int:
        last_offset, last_size = next(reversed(self._section_map.values()))
        return _align(last_offset + last_size)

    @property
    def token_bytes(self) -> int:
        """Page bytes per token, alignment padding included (``page_bytes / page_size``)."""
        return self.page_bytes // self.page_size

    @property
    def bf16_token_bytes(self) -> int:
        """Bytes per token of the unquantized BF16 cache at the same dims."""
        return (self.latent_dim + self.rope_dim) * 2

    def to_dict(self) -> dict:
        """JSON-friendly description (used when saving a cache or transforms)."""
        return {
            "name": self.name,
            "latent_dim": self.latent_dim,
            "rope_dim": self.rope_dim,
            "group_size": self.group_size,
            "page_size": self.page_size,
            "version": self.version,
        }

    @classmethod
    def from_dict(cls, d: dict) -> "PackFormat":
        return cls.parse(
            d["name"], d["latent_dim"], d["rope_dim"], d["group_size"], d["page_size"], d.get("version", 1)
        )
