"""A NumPy model of the CuPy writer's lane layout (``kernels/writer.cu``), checked on the CPU.

The kernel gives lane l the values ``p * NB + l * CB + u`` of every plane p, reduces group ranges
with xor shuffles over GL lanes (after combining PG planes where a group spans planes), lets one
leader lane per group store its scale and zero point, and packs its CB bytes alone. The model
below restates those formulas (pinned to the kernel text) and checks them against the
reference's groups and split-half packing for every format and dims the backend serves.
"""

from __future__ import annotations

import numpy as np
import pytest

import quantmla_core as qm
from quantmla_core import reference as ref
from quantmla_core.backends.cupy import KERNEL_DIR

SOURCE = (KERNEL_DIR / "writer.cu").read_text()
#: the kernel lines the model restates; a change there must be mirrored here
PINNED = (
    "static constexpr int K = BITS >= 16 ? 1 : 8 / BITS;",
    "static constexpr int NB = D / K;",
    "static constexpr int CB = NB >= 32 ? NB / 32 : 1;",
    "static constexpr int LANES = NB / CB;",
    "constexpr bool SPAN = G > NB;",
    "constexpr int PG = SPAN ? G / NB : 1;",
    "constexpr int GL = SPAN ? 32 : G / CB;",
    "const int g = SPAN ? p / PG : p * (NB / G) + lane * CB / G;",
    "const bool leader = SPAN ? lane == 0 : (lane * CB) % G == 0 && lane < S::LANES;",
    "load_run<S::CB>(row + p * S::NB + lane * S::CB, x[p]);",
    "bytes[u] |= (u32)q << (p * BITS);",
    "store_bytes<CB>(codes + off * NB + lane * CB, bytes);",
)


def _lanes(d: int, bits: int) -> tuple[int, int, int, int]:
    k = 1 if bits >= 16 else 8 // bits
    nb = d // k
    cb = nb // 32 if nb >= 32 else 1
    return k, nb, cb, nb // cb


def _paths() -> list[tuple[str, int, int, int]]:
    """(format/dims label, D, bits, G) of every quantized path the CuPy backend writes."""
    out = []
    for name in ("C4R4", "C2R4", "C8R8", "C4R8", "C2R2"):
        for dc, dr in ((512, 64), (256, 32)):
            for gs in (64, 128):
                try:
                    f = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs)
                except ValueError:
                    continue
                out.append((f"{name}-{dc}-g{gs}-content", dc, f.content_bits, f.content_group_size))
                out.append((f"{name}-{dr}-g{gs}-rope", dr, f.rope_bits, f.rope_group_size))
    return sorted(set(out))


def test_model_is_pinned_to_the_kernel():
    for line in PINNED:
        assert line in SOURCE, f"writer.cu no longer contains: {line}"


@pytest.mark.parametrize("label,d,bits,g", _paths(), ids=lambda v: str(v))
def test_lane_layout_covers_groups_and_packing(label, d, bits, g):
    k, nb, cb, lanes = _lanes(d, bits)
    assert lanes <= 32 and g % cb == 0
    span = g > nb
    pg = g // nb if span else 1
    gl = 32 if span else g // cb
    # 1. every value exactly once
    owner = {}
    for p in range(k):
        for lane in range(lanes):
            for u in range(cb):
                e = p * nb + lane * cb + u
                assert e not in owner
                owner[e] = (p, lane)
    assert sorted(owner) == list(range(d))
    true_group = {e: e // g for e in range(d)}
    # 2. the group index the kernel stores for (p, lane), and the lanes its shuffles reach
    for p in range(k):
        for lane in range(lanes):
            kernel_g = p // pg if span else p * (nb // g) + lane * cb // g
            run = [p * nb + lane * cb + u for u in range(cb)]
            assert {true_group[e] for e in run} == {kernel_g}
            planes = range(p - p % pg, p - p % pg + pg)
            reached = {lane ^ m for m in range(gl)} if gl > 1 else {lane}  # xor offsets 1, 2, .. < GL
            covered = {pe * nb + ln * cb + u for pe in planes for ln in reached if ln < lanes for u in range(cb)}
            assert covered == {e for e in range(d) if true_group[e] == kernel_g}, (p, lane)
    # 3. one leader per group
    leaders = [(p // pg if span else p * (nb // g) + lane * cb // g)
               for p in range(0, k, pg) for lane in range(32)
               if (lane == 0 if span else (lane * cb) % g == 0 and lane < lanes)]
    assert sorted(leaders) == list(range(d // g))
    # 4. the bytes a lane packs are the reference's split-half bytes
    codes = np.random.default_rng(d + bits + g).integers(0, 1 << bits, d).astype(np.uint8)
    packed = np.zeros(nb, np.uint32)
    for p in range(k):
        for lane in range(lanes):
            for u in range(cb):
                packed[lane * cb + u] |= int(codes[p * nb + lane * cb + u]) << (p * bits)
    assert np.array_equal(packed.astype(np.uint8), ref.pack(codes, bits))
