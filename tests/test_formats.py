"""PackFormat: parsing, validation and the section layout of DESIGN.md §3.4."""

import pytest

from quantmla_core import PackFormat, compression_ratio, memory_bytes


def test_c4r4_default_layout_matches_design():
    f = PackFormat.parse("C4R4")
    assert (f.content_bits, f.rope_bits, f.latent_dim, f.rope_dim, f.group_size, f.page_size, f.version) == (4, 4, 512, 64, 64, 64, 1)
    assert f.sections == {
        "content_codes": (0, 16384),
        "rope_codes": (16384, 2048),
        "content_scales": (18432, 1024),
        "content_zeros": (19456, 512),
        "rope_scales": (19968, 256),
        "rope_zeros": (20224, 64),
    }
    assert f.page_bytes == 20352
    assert f.token_bytes == 318
    assert f.packed_token_bytes == 256 + 32 + 16 + 8 + 4 + 1
    assert f.bf16_token_bytes == (512 + 64) * 2
    assert PackFormat.parse("C2R4", latent_dim=256, rope_dim=32).bf16_token_bytes == (256 + 32) * 2


def test_sections_are_computed_once_and_handed_out_as_copies():
    """The layout is computed once per format (launchers read offsets on every call); a caller editing the dict it
    got cannot change the format, and a changed copy of the format gets its own layout."""
    import dataclasses
    import pickle

    f = PackFormat.parse("C4R4")
    got = f.sections
    got["content_codes"] = (128, 1)
    got.pop("rope_zeros")
    assert f.sections["content_codes"] == (0, 16384) and f.rope_zeros_offset == 20224 and f.page_bytes == 20352
    assert f._section_map is f._section_map
    small = dataclasses.replace(f, page_size=32)
    assert small.page_bytes == 10240 and small.sections["rope_codes"] == (8192, 1024)
    back = pickle.loads(pickle.dumps(f))
    assert back == f and hash(back) == hash(f) and back.sections == f.sections


@pytest.mark.parametrize("name,page_bytes", [("C2R4", 12160), ("BF16", 73728)])
def test_page_bytes(name, page_bytes):
    assert PackFormat.parse(name).page_bytes == page_bytes


def test_bf16_has_two_sections():
    f = PackFormat.parse("bf16")
    assert list(f.sections) == ["content_codes", "rope_codes"]
    assert f.sections["rope_codes"] == (65536, 8192)
    assert not f.quantized and f.name == "BF16"


@pytest.mark.parametrize("name", ["C4R4", "C2R4", "C4R8", "C8R8", "C2R2", "C8R2", "BF16"])
@pytest.mark.parametrize("dims", [(512, 64), (256, 32)])
@pytest.mark.parametrize("page_size", [16, 32, 64, 128])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_sections_aligned_disjoint_and_sized(name, dims, page_size, group):
    f = PackFormat.parse(name, latent_dim=dims[0], rope_dim=dims[1], group_size=group, page_size=page_size)
    end = 0
    for off, size in f.sections.values():
        assert off % 128 == 0 and off >= end
        end = off + size
    assert f.page_bytes % 128 == 0 and f.page_bytes >= end > f.page_bytes - 128
    assert f.page_bytes == f.token_bytes * page_size
    if f.quantized:
        assert f.rope_group_size == min(group, dims[1])
        assert f.content_groups * f.content_group_size == dims[0]
    assert PackFormat.from_dict(f.to_dict()) == f


def test_frozen():
    f = PackFormat.parse("C4R4")
    with pytest.raises(Exception):
        f.content_bits = 2


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(name="C3R4"), "format name"),
        (dict(name="C4"), "format name"),
        (dict(name="C4R4", page_size=48), "page_size"),
        (dict(name="C4R4", group_size=16), "group_size"),
        (dict(name="C4R4", latent_dim=500), "latent_dim"),
        (dict(name="C4R4", latent_dim=96, group_size=64), "latent_dim"),
        (dict(name="C4R4", version=2), "version"),
    ],
)
def test_invalid(kwargs, match):
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=match):
        PackFormat.parse(name, **kwargs)


def test_parse_type_error():
    with pytest.raises(TypeError, match="format name"):
        PackFormat.parse(44)


def test_memory_accounting_matches_design():
    c4 = PackFormat.parse("C4R4")
    L = 131072
    assert memory_bytes(c4, L) == 2048 * 20352 + 132 * 576 * 2
    assert compression_ratio(c4, L) == pytest.approx(3.6095, abs=1e-3)
    assert compression_ratio(PackFormat.parse("C2R4"), L) >= 6.0
    assert memory_bytes(c4, 0) == 132 * 1152
    assert memory_bytes(c4, 65) == 2 * 20352 + 132 * 1152
    # BF16's side is its pages alone (73,728 B per 64 tokens); at one page the protection buffers dominate
    assert compression_ratio(c4, 64) == 73728 / (20352 + 132 * 1152)
    assert compression_ratio(c4, 64, sink=0, local=0) == 73728 / 20352
    with pytest.raises(ValueError, match="seq_len"):
        memory_bytes(c4, -1)


def test_scale_dtypes_are_fixed_by_layout_version_1():
    with pytest.raises(ValueError, match="content_scale_dtype/rope_scale_dtype"):
        PackFormat(4, 4, content_scale_dtype="float32")
