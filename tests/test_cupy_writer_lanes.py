"""A NumPy model of the CuPy writer's lane layout (``kernels/writer.cu``), checked on the CPU.

The kernel gives lane l the values ``p * NB + l * CB + u`` of every plane p and reduces group
ranges with xor shuffles over GL lanes: where a group spans planes, after combining its PG planes;
otherwise (K > 1 planes) by a reduce-scatter that leaves lane l with one plane's group, whose
parameters it alone computes and hands to the lanes that need them. One leader lane per group
stores its scale and zero point, and each lane packs its CB bytes alone from the codes' float bits.
The model below restates those formulas (pinned to the kernel text) and checks them against the
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
    "constexpr bool SCATTER = !SPAN && K > 1;",
    "const bool upper = lane & o;",
    "const float send_lo = upper ? lo[i] : lo[i + o], send_hi = upper ? hi[i] : hi[i + o];",
    "const float keep_lo = upper ? lo[i + o] : lo[i], keep_hi = upper ? hi[i + o] : hi[i];",
    "for (int o = K; o < GL; o <<= 1) {",
    "const int pl = lane % K;",
    "if (lane % GL < K) store_group<SCALE_BF16>(scales, zeros, off * NG + (pl * NB + lane * CB) / G, s, zf);",
    "const int src = (lane & ~(K - 1)) | p;",
    "#define MAGIC 12582912.0f",
    "const float q = fminf(fmaxf(fmaf(x[p][u] * 0x1p-64f, r[p], mz[p]), MAGIC), MAGIC + M);",
    "bytes[u] += __float_as_uint(q) << (p * BITS);",
    "__byte_perm(__byte_perm(b[4 * i], b[4 * i + 1], 0x0040u), __byte_perm(b[4 * i + 2], b[4 * i + 3], 0x0040u),",
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
    def run(p, lane):
        return {p * nb + lane * cb + u for u in range(cb)} if lane < lanes else set()

    def members(g):
        return {e for e in range(d) if true_group[e] == g}

    scatter = not span and k > 1
    if scatter:
        # 2a. reduce-scatter: lane l keeps plane l % K over K lanes, then a butterfly over K .. GL / 2
        held = [[run(p, lane) for p in range(k)] for lane in range(32)]
        o = k // 2
        while o >= 1:
            nxt = []
            for lane in range(32):
                upper = bool(lane & o)
                partner = held[lane ^ o]
                # keep one half, receive the partner's send (the same half: its bit o is the opposite)
                nxt.append([(held[lane][i + o] if upper else held[lane][i])
                            | (partner[i + o] if upper else partner[i]) for i in range(o)])
            held = nxt
            o //= 2
        acc = [h[0] for h in held]
        o = k
        while o < gl:
            acc = [acc[lane] | acc[lane ^ o] for lane in range(32)]
            o *= 2
        group_of = [((lane % k) * nb + lane * cb) // g for lane in range(32)]
        for lane in range(32):
            assert acc[lane] == members(group_of[lane]), lane
            for p in range(k):  # the lane whose group parameters plane p of this lane uses
                src = (lane & ~(k - 1)) | p
                assert {true_group[e] for e in run(p, lane)} == {group_of[src]}, (lane, p)
        leaders = [((lane % k) * nb + lane * cb) // g for lane in range(32) if lane % gl < k]
    else:
        # 2b. the group index the kernel stores for (p, lane), and the lanes its shuffles reach
        for p in range(k):
            for lane in range(lanes):
                kernel_g = p // pg if span else p * (nb // g) + lane * cb // g
                assert {true_group[e] for e in run(p, lane)} == {kernel_g}
                planes = range(p - p % pg, p - p % pg + pg)
                reached = {lane ^ m for m in range(gl)} if gl > 1 else {lane}  # xor offsets 1, 2, .. < GL
                covered = {e for pe in planes for ln in reached for e in run(pe, ln)}
                assert covered == members(kernel_g), (p, lane)
        leaders = [(p // pg if span else p * (nb // g) + lane * cb // g)
                   for p in range(0, k, pg) for lane in range(32)
                   if (lane == 0 if span else (lane * cb) % g == 0 and lane < lanes)]
    # 3. one leader per group
    assert sorted(leaders) == list(range(d // g))
    # 4. the bytes a lane packs are the reference's split-half bytes: the low byte of the sum of
    #    the codes' float bits (MAGIC + q) shifted by p * BITS (uint32 arithmetic)
    codes = np.random.default_rng(d + bits + g).integers(0, 1 << bits, d).astype(np.uint32)
    magic_bits = np.float32(12582912.0).view(np.uint32)
    packed = [0] * nb
    for p in range(k):
        for lane in range(lanes):
            for u in range(cb):
                q_bits = int(np.float32(12582912.0 + float(codes[p * nb + lane * cb + u])).view(np.uint32))
                assert q_bits - int(magic_bits) == codes[p * nb + lane * cb + u]
                packed[lane * cb + u] = (packed[lane * cb + u] + (q_bits << (p * bits))) & 0xFFFFFFFF
    low_bytes = np.array([w & 0xFF for w in packed], np.uint8)
    assert np.array_equal(low_bytes, ref.pack(codes.astype(np.uint8), bits))
