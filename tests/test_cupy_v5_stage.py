"""Model of kernel v5's stage (``backends/cupy/kernels/attention_v5.cu``): where its copies put a tile's
page sections and how its lanes read them back, checked without a GPU.

v5 keeps the content code rows of a staged tile in its own chunk order (``v5_cswz`` / ``v5_coff``), not
stage.cuh's: each lane reads ``BL / 16`` 16-byte chunks of two tokens' rows, and every load phase (8
lanes: tokens t, t + 1 x quads 0..3) has to hit 8 different 16-byte bank slots. The H200 profile of the
build that used stage.cuh's order measured 4-way conflicts on these loads for C4R4 (2-way for C2R4);
the model shows the same for that order, so the check can fail. The copies (``v5_issue_stage``) use
per-thread offsets fixed for the kernel plus immediates per chunk; the model checks that they land
every byte of the page sections where the reads expect it, once.
"""

from __future__ import annotations

import itertools

import pytest

import quantmla_core as qm
from quantmla_core.backends.cupy.attention import attention_defines, stage_bytes
from test_cupy_v5 import V5_BUILDS

T, NTH = 64, 128  # tokens per tile, threads of one worker
BUILDS = V5_BUILDS  # (format, d_c, d_r, group size, page size) of every v5 build the compile test checks


class Stage:
    """The kernel's stage constants for one build (stage.cuh's SO_* layout, v5's chunk order)."""

    def __init__(self, name: str, dc: int, dr: int, gs: int, page: int):
        fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
        d = attention_defines(fmt, "bfloat16")
        self.d = d
        self.CB, self.RB, self.P = d["QMLA_CB"], d["QMLA_RB"], d["QMLA_P"]
        self.NCT = self.CB // 16
        self.BL = self.CB // 4  # content code bytes of one lane of a quad, per token
        self.NGC = dc // d["QMLA_GC"]
        self.CSZ = 2 if d["QMLA_CSCALE_BF16"] else 4
        self.RSZ = 2 if d["QMLA_RSCALE_BF16"] else 4
        self.SEGT = min(self.P, T)
        self.SO_R = T * self.CB
        self.SO_CS = self.SO_R + T * self.RB
        self.SO_CZ = self.SO_CS + T * self.NGC * self.CSZ
        self.SO_RS = self.SO_CZ + T * self.NGC
        self.SO_RZ = self.SO_RS + T * self.RSZ
        self.bytes = stage_bytes(fmt, T, False)
        # (section offset in the page, in the stage, bytes per token) of the small sections, stage order
        self.small = [(d["QMLA_OFF_RC"], self.SO_R, self.RB), (d["QMLA_OFF_CS"], self.SO_CS, self.NGC * self.CSZ),
                      (d["QMLA_OFF_CZ"], self.SO_CZ, self.NGC), (d["QMLA_OFF_RS"], self.SO_RS, self.RSZ),
                      (d["QMLA_OFF_RZ"], self.SO_RZ, 1)]

    def cswz(self, t: int, u: int) -> int:
        """v5_cswz."""
        if self.NCT >= 16:
            return ((u >> 3) & 1) ^ ((t & 1) << 1)
        return t & 1 if self.NCT == 8 else 0

    def coff(self, t: int, u: int) -> int:
        """v5_coff: byte offset of content chunk u of token t in the stage."""
        return t * self.CB + ((u ^ self.cswz(t, u)) << 4)

    def coff_stage_cuh(self, t: int, u: int) -> int:
        """stage.cuh's qmla_coff order (what v5 read before stop 21)."""
        swz = (((t & 1) << 2) ^ (t & 6)) if self.NCT >= 8 else ((t >> 1) & 3)
        return t * self.CB + ((u ^ swz) << 4)


def _worst_read_conflict(st: Stage, coff, base: int) -> int:
    """Largest number of lanes of one 8-lane phase of a staged-code load (uint4) on one 16-byte bank slot,
    over the warps, the two tokens of a lane and the chunk index v (the kernel's loop in the tile's top)."""
    worst = 1
    for ww, tk, v in itertools.product(range(4), range(2), range(st.BL // 16)):
        for phase in range(4):
            slots = []
            for lane in range(8 * phase, 8 * phase + 8):
                g8, q4 = lane >> 2, lane & 3
                t = 16 * ww + g8 + 8 * tk  # tq[tk]
                slots.append(((base + coff(t, (st.BL // 16) * q4 + v)) // 16) % 8)
            worst = max(worst, max(slots.count(s) for s in set(slots)))
    return worst


@pytest.mark.parametrize("build", BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_staged_code_reads_are_conflict_free(build):
    st = Stage(*build)
    for base in (0, 16, 64):  # the stage's offset in its 128-byte bank window (W_STG % 128 is 16)
        assert _worst_read_conflict(st, st.coff, base) == 1
    # the order each row had before (stage.cuh's): the model sees the conflicts the profile measured
    expected = {16: 4, 8: 2}.get(st.NCT, 1)
    assert _worst_read_conflict(st, st.coff_stage_cuh, 0) == expected


@pytest.mark.parametrize("build", BUILDS, ids=lambda v: "-".join(map(str, v)))
def test_copies_land_every_byte_where_the_reads_expect_it(build):
    """Content: thread tid's chunk k of segment sg goes from page byte 16 (tid + NTH k) (+ the segment's
    slot) to c_dst + k (NTH / NCT) CB + sg SEGT CB, which must be v5_coff of its token and chunk; the small
    sections by stage.cuh's qmla_small_chunk. Every stage byte of the tile is written exactly once, from the page byte the
    layout names."""
    st = Stage(*build)
    nseg, ch_c = T // st.SEGT, st.SEGT * st.CB // 16
    ncc = -(-ch_c // NTH)
    written: dict[int, tuple[int, int]] = {}  # stage byte -> (segment, page byte)

    def put(dst: int, src: int, sg: int) -> None:
        for i in range(16):
            assert dst + i not in written, f"stage byte {dst + i} written twice"
            written[dst + i] = (sg, src + i)

    for sg, tid in itertools.product(range(nseg), range(NTH)):
        ct = tid // st.NCT
        c_dst, c_src = st.coff(ct, tid % st.NCT), 16 * tid
        for k in range(ncc):
            r = tid + k * NTH
            if r >= ch_c:
                continue
            dst = c_dst + k * (NTH // st.NCT) * st.CB + sg * st.SEGT * st.CB
            t, u = sg * st.SEGT + r // st.NCT, r % st.NCT
            assert dst == st.coff(t, u), (tid, k, sg)  # the immediates reach the same chunk order
            put(dst, st.d["QMLA_OFF_CC"] + c_src + 16 * NTH * k, sg)
        small = [(src + 16 * i, dst + 16 * i, w) for src, dst, w in st.small for i in range(st.SEGT * w // 16)]
        for k in range(-(-len(small) // NTH)):
            r = tid + k * NTH
            if r < len(small):  # the guard against CH_SMALL
                src, dst, w = small[r]
                put(dst + sg * st.SEGT * w, src, sg)
    assert sorted(written) == list(range(st.SO_RZ + T))  # the whole stage but its padding
    for t in range(T):  # each token's content row holds its page row, in v5's chunk order
        sg, slot = t // st.SEGT, t % st.SEGT
        for u in range(st.NCT):
            for i in range(16):
                assert written[st.coff(t, u) + i] == (sg, st.d["QMLA_OFF_CC"] + slot * st.CB + 16 * u + i)
    for off, so, w in st.small:
        for t, i in itertools.product(range(T), range(w)):
            assert written[so + t * w + i] == (t // st.SEGT, off + (t % st.SEGT) * w + i)
    assert st.SO_RZ + T <= st.bytes


def test_model_matches_kernel_source():
    """Pin the expressions this model encodes to the kernel text."""
    from quantmla_core.backends.cupy import KERNEL_DIR

    src = " ".join((KERNEL_DIR / "attention_v5.cu").read_text().split())
    for expr in (
        "if constexpr (NCT >= 16) return ((u >> 3) & 1) ^ ((t & 1) << 1);",
        "else if constexpr (NCT == 8) return t & 1;",
        "return t * CB + ((u ^ v5_cswz(t, u)) << 4);",
        "v5_cp16<K * (NTH / NCT) * CB, K * NTH * 16>(dst, src);",
        "const int ct = tid / NCT;",
        "const u32 c_dst = stg_s + v5_coff(ct, tid % NCT);",
        "const int c_src = 16 * tid;",
        "v5_copy_content<0>(c_dst + boff + sg * SEGT * CB, page + QMLA_OFF_CC + slot0 * CB + c_src, tid);",
        "for (int k = 0; k < NSK; ++k) sk[k] = qmla_small_chunk(tid + k * NTH);",
        '"r"(stg_s + boff + sk[k].dst + sg * SEGT * sk[k].wtok), "l"(page + sk[k].src + slot0 * sk[k].wtok)',
        "const int tq[2] = {16 * ww + g8, 16 * ww + g8 + 8};",
        "const uint4 x = *(const uint4*)(stt + v5_coff(t, (BL / 16) * q4 + v));",
        "#define W_STG (W_FLG + 16)",
    ):
        assert expr in src, f"attention_v5.cu no longer contains: {expr}"
