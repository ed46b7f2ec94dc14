"""Golden bytes of a worked example (DESIGN.md §3.1, §3.3, §3.4): the layout, pinned by hand.

Format C4R4 with d_c=64, d_r=32, G=32, P=16 (page map: content codes 0..512, RoPE codes
512..768, content scales 768, content zeros 896, RoPE scales 1024, RoPE zeros 1152; 1280 B).
Token: content group 0 = (i % 16) - 3 (lo -3, hi 12 -> s = 1.0, z = 3, q = i % 16), group 1 =
0.5 * ((i % 16) - 3) (s = 0.5, z = 3, same codes); RoPE = 2 * (i % 16) - 6 (s = 2.0, z = 3).
Split-half 4-bit: byte j = q[j] | q[j + d/2] << 4 = 0x11 * (j % 16).
"""

import numpy as np
import pytest
import torch

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.quantizer import quantize

WRITERS = ["reference", "torch"]


def _token():
    i = np.arange(32)
    content = np.concatenate([(i % 16) - 3.0, 0.5 * ((i % 16) - 3.0)]).astype(np.float32)
    rope = (2.0 * (i % 16) - 6.0).astype(np.float32)
    return content, rope


def _write_one(fmt, content, rope, backend, slot=5):
    cache = qm.MLACache.allocate(fmt, 2, 1, sink=0, local=0, device="cpu")
    cache.pages.fill_(0xEE)
    qm.write(cache, torch.from_numpy(content)[None], torch.from_numpy(rope)[None],
             slot_mapping=torch.tensor([slot]), seq_ids=torch.tensor([0]), positions=torch.tensor([0]),
             seq_lens=torch.tensor([1]), backend=backend)
    return cache.pages[0].numpy()


@pytest.mark.parametrize("backend", WRITERS)
def test_c4r4_golden_bytes(backend):
    fmt = qm.PackFormat.parse("C4R4", latent_dim=64, rope_dim=32, group_size=32, page_size=16)
    assert fmt.sections == {
        "content_codes": (0, 512), "rope_codes": (512, 256), "content_scales": (768, 64),
        "content_zeros": (896, 32), "rope_scales": (1024, 64), "rope_zeros": (1152, 16),
    }
    assert fmt.page_bytes == 1280
    page = _write_one(fmt, *_token(), backend)
    t = 5
    expect_codes = bytes(0x11 * (j % 16) for j in range(32))
    assert page[t * 32 : t * 32 + 32].tobytes() == expect_codes
    assert page[512 + t * 16 : 512 + t * 16 + 16].tobytes() == bytes(0x11 * j for j in range(16))
    assert page[768 + t * 4 : 768 + t * 4 + 4].tobytes() == bytes([0x80, 0x3F, 0x00, 0x3F])  # bf16 1.0, 0.5
    assert page[896 + t * 2 : 896 + t * 2 + 2].tobytes() == bytes([3, 3])
    assert page[1024 + t * 4 : 1024 + t * 4 + 4].tobytes() == bytes([0, 0, 0, 0x40])  # float32 2.0
    assert page[1152 + t] == 3
    # neighbouring slots untouched
    assert page[4 * 32 : 5 * 32].tobytes() == b"\xee" * 32 and page[1152 + 4] == 0xEE


@pytest.mark.parametrize("backend", WRITERS)
def test_c2r4_golden_content_codes(backend):
    """2-bit: byte j = q[j] | q[j+16] << 2 | q[j+32] << 4 | q[j+48] << 6 with q[n] = n % 4."""
    fmt = qm.PackFormat.parse("C2R4", latent_dim=64, rope_dim=32, group_size=32, page_size=16)
    i = np.arange(32)
    content = np.concatenate([(i % 4) - 1.0, 0.5 * ((i % 4) - 1.0)]).astype(np.float32)
    rope = (2.0 * (i % 16) - 6.0).astype(np.float32)
    page = _write_one(fmt, content, rope, backend, slot=0)
    assert page[:16].tobytes() == bytes(0x55 * (j % 4) for j in range(16))
    off = fmt.content_scales_offset
    assert page[off : off + 4].tobytes() == bytes([0x80, 0x3F, 0x00, 0x3F])
    assert page[fmt.content_zeros_offset : fmt.content_zeros_offset + 2].tobytes() == bytes([1, 1])


@pytest.mark.parametrize("backend", WRITERS)
def test_bf16_format_golden(backend):
    fmt = qm.PackFormat.parse("BF16", latent_dim=64, rope_dim=32, page_size=16)
    content = np.full(64, 1.0, np.float32)
    content[1] = -2.0
    rope = np.full(32, 0.5, np.float32)
    page = _write_one(fmt, content, rope, backend, slot=1)
    assert page[128:132].tobytes() == bytes([0x80, 0x3F, 0x00, 0xC0])  # 1.0, -2.0
    off = fmt.rope_codes_offset + 64
    assert page[off : off + 2].tobytes() == bytes([0x00, 0x3F])


def test_round_half_to_even():
    """x/s exactly .5 rounds to even: with s = 1, z = 0, 2.5 -> 2 and 3.5 -> 4."""
    x = np.zeros(32, np.float32)
    x[:4] = [2.5, 3.5, 0.5, 15.0]
    codes, s, z = ref.quantize_groups(x, 4, 32, "float32")
    assert s[0] == 1.0 and z[0] == 0
    assert codes[:4].tolist() == [2, 4, 0, 15]
    tq, ts, tz = quantize(torch.from_numpy(x), 4, 32, torch.float32)
    assert tq[:4].tolist() == [2, 4, 0, 15]
