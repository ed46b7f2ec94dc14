"""Model of kernel v5's operand loads (``v5_load_tile`` in ``backends/cupy/kernels/attention_v5.cu``),
checked without a GPU.

v5 has no stage in shared memory: lane (g8, q4) of warp ww loads, for its tokens 16 ww + g8 and
16 ww + g8 + 8 of a tile, its share of the content code bytes (BL q4 .. BL q4 + BL - 1, or with
QMLA_V5_QUAD_LOADS the 16-byte runs 16 q4 + 64 v), RoPE code bytes RBL q4 .., and the zero points and scales
of the groups its channels lie in (with quad loads all of the token's), from the page the block table names
for the warp's 16 tokens (one page id per warp). The model checks for every build the compile test checks that
the lanes of a worker load each byte of the tile's code rows once, from the page and slot that hold the
token, and that the groups the kernel loads are the groups of the channels it dequantizes with them; the
negative controls show that each check can fail. With QMLA_V5_HALVES 2 a worker is two warpgroups, half h taking
code bytes CBH h .. CBH h + CBH - 1 of each slice and RoPE bytes RBH h ..: the same checks over both halves, and the
channel maps of the query tiles and the partials.
"""

from __future__ import annotations

import itertools

import pytest

import quantmla_core as qm
from quantmla_core.backends.cupy.builds import attention_defines, v5_build_reasons, v5_quad_loads
from test_cupy_v5 import V5_BUILDS, V5_HALVES_BUILDS

T = 64  # tokens per tile (a worker's four warps, 16 tokens each)


class Lanes:
    """The kernel's load constants for one build."""

    def __init__(self, name: str, dc: int, dr: int, gs: int, page: int, quad: bool = False, halves: int = 1):
        fmt = qm.PackFormat.parse(name, latent_dim=dc, rope_dim=dr, group_size=gs, page_size=page)
        assert not quad or v5_quad_loads(fmt, 2, True), "quad loads serve 4-bit d_c 512 with 64-channel groups"
        assert not v5_build_reasons(fmt, 2, halves) and not (quad and halves > 1)
        self.fmt, self.quad, self.halves = fmt, quad, halves
        d = attention_defines(fmt, "bfloat16")
        self.CB, self.RB, self.P, self.GC = d["QMLA_CB"], d["QMLA_RB"], d["QMLA_P"], d["QMLA_GC"]
        self.CBH, self.RBH = self.CB // halves, self.RB // halves  # a half's code bytes of each slice, per token
        self.BL, self.RBL = self.CBH // 4, self.RBH // 4  # code bytes of one lane of a quad, per token
        self.KCH = 8 // d["QMLA_CBITS"]  # codes per byte (slices)
        self.NGL = self.BL // self.GC if self.BL >= self.GC else 1  # groups of a lane's share of a slice

    def share_byte(self, i: int, q4: int) -> int:
        """v5_share_byte: the byte of a content code row (of each slice) that byte i of lane q4's share is."""
        return 16 * q4 + 64 * (i >> 4) + (i & 15) if self.quad else self.BL * q4 + i

    def group_loaded(self, c: int, q4: int, gl: int, h: int = 0) -> int:
        """grp of v5_load_tile: the group whose zero point and scale land in cz/cs[tk][c][gl] (half h)."""
        return (self.CB * c + self.CBH * h + self.BL * q4) // self.GC + gl

    def group_used(self, bp: int) -> int:
        """gl of the QK loop: the loaded group that byte pair bp of a lane's share is dequantized with."""
        return 2 * bp // self.GC if self.BL >= self.GC else 0

    def quad_group(self, c: int, ks: int) -> int:
        """With quad loads, the token's group whose zero point and scale v5_quad_group picks for slice c at content
        k-step ks (refreshed where ks % 8 == 0, with v = ks / 8)."""
        return (self.CB // self.GC) * c + (ks - ks % 8) // 8


def _lane_tokens(rows_per_warp: int = 16):
    """(warp, lane, token of the tile) for both tokens of every lane: tq = {16 ww + g8, 16 ww + g8 + 8}
    (rows_per_warp 32: a warp taking 32 tokens, g8 and g8 + 16, as a control)."""
    for ww, lane, tk in itertools.product(range(T // rows_per_warp), range(32), range(2)):
        g8 = lane >> 2
        yield ww, lane, rows_per_warp * ww + g8 + rows_per_warp // 2 * tk


BUILD_IDS = {"ids": lambda v: "-".join(map(str, v))}
#: every build, and with quad loads those that have them (a sixth tuple element True), and with two halves those
#: that have them (a seventh element 2)
LOAD_BUILDS = [b + (False,) for b in V5_BUILDS] + [
    b + (True,) for b in V5_BUILDS
    if v5_quad_loads(qm.PackFormat.parse(b[0], latent_dim=b[1], rope_dim=b[2], group_size=b[3], page_size=b[4]), 2, True)
] + [b + (False, 2) for b in V5_HALVES_BUILDS]


@pytest.mark.parametrize("build", LOAD_BUILDS, **BUILD_IDS)
def test_lanes_load_every_code_byte_of_a_tile_once(build):
    ln = Lanes(*build)
    content: dict[tuple[int, int], int] = {}
    rope: dict[tuple[int, int], int] = {}
    for (_ww, lane, t), h in itertools.product(_lane_tokens(), range(ln.halves)):
        q4 = lane & 3
        for i in range(ln.BL):
            key = (t, ln.CBH * h + ln.share_byte(i, q4))
            content[key] = content.get(key, 0) + 1
        for i in range(ln.RBL):
            key = (t, ln.RBH * h + ln.RBL * q4 + i)
            rope[key] = rope.get(key, 0) + 1
    assert sorted(content) == [(t, j) for t in range(T) for j in range(ln.CB)] and set(content.values()) == {1}
    assert sorted(rope) == [(t, j) for t in range(T) for j in range(ln.RB)] and set(rope.values()) == {1}


def _warp_page_misses(ln: Lanes, rows_per_warp: int, first_tile: int = 0) -> int:
    """Tokens a lane would read from the wrong page or slot: the kernel takes the warp's page,
    block_table[(tt + 16 ww) / P], and for its token n = tt + t_lane + 8 tk (rows_per_warp 32: + 16 tk) the slot
    (tt + t_lane) % P + 8 tk, its first token's slot and the step between its tokens."""
    misses = 0
    step = rows_per_warp // 2
    for tt in range(first_tile, 4 * max(ln.P, T), T):  # tile starts: multiples of 64, across several pages
        for ww, _lane, t in _lane_tokens(rows_per_warp):
            if rows_per_warp == 16:
                assert t in (16 * ww + (_lane >> 2), 16 * ww + (_lane >> 2) + 8)
            n = tt + t
            t_lane = rows_per_warp * ww + (_lane >> 2)
            page_of_warp = (tt + rows_per_warp * ww) // ln.P
            slot = (tt + t_lane) % ln.P + (n - tt - t_lane)
            assert n - tt - t_lane in (0, step)
            misses += page_of_warp != n // ln.P or slot != n % ln.P
    return misses


@pytest.mark.parametrize("build", V5_BUILDS, **BUILD_IDS)
def test_a_warps_tokens_lie_on_its_page(build):
    ln = Lanes(*build)
    assert _warp_page_misses(ln, 16) == 0
    if ln.P < 32:  # a warp of 32 tokens would reach into the next page
        assert _warp_page_misses(ln, 32) > 0


def test_one_slot_per_lane_needs_aligned_tiles():
    """Negative control: the slot s0 + 8 of a lane's second token holds only while tiles start on 16-token
    boundaries; tiles starting 8 tokens in (16-token pages) put it past its page."""
    ln = Lanes("C4R4", 512, 64, 64, 16)
    assert _warp_page_misses(ln, 16) == 0
    assert _warp_page_misses(ln, 16, first_tile=8) > 0


@pytest.mark.parametrize("build", LOAD_BUILDS, **BUILD_IDS)
def test_loaded_groups_are_the_groups_of_the_dequantized_channels(build):
    """Byte j of a content code row holds channel j + CB c in slice c; byte pair bp of lane q4's share
    is bytes share_byte(2 bp (+ 1), q4) (BL q4 + 2 bp (+ 1) without quad loads), dequantized at k-step
    SPC bp + sp with the group the kernel loaded for it (with quad loads, the one v5_quad_group picked)."""
    ln = Lanes(*build)
    spc = ln.KCH // 2
    for q4, c, bp, e, h in itertools.product(range(4), range(ln.KCH), range(ln.BL // 2), range(2), range(ln.halves)):
        channel = ln.CB * c + ln.CBH * h + ln.share_byte(2 * bp + e, q4)
        if ln.quad:
            assert ln.quad_group(c, spc * bp + c // 2) == channel // ln.GC, (q4, c, bp, e)
        else:
            gl = ln.group_used(bp)
            assert gl < ln.NGL
            assert ln.group_loaded(c, q4, gl, h) == channel // ln.GC, (q4, c, bp, e, h)


def test_quad_groups_need_the_quad_share():
    """Negative control: the groups v5_quad_group picks do not fit lanes that load their own BL contiguous bytes."""
    ln, plain = Lanes("C4R4", 512, 64, 64, 64, True), Lanes("C4R4", 512, 64, 64, 64)
    wrong = sum(ln.quad_group(c, bp) != (ln.CB * c + plain.share_byte(2 * bp, q4)) // ln.GC
                for q4, c, bp in itertools.product(range(4), range(2), range(32)))
    assert wrong > 0


def test_a_wrong_group_index_is_caught():
    """Negative control: taking lane q4's group as CB c / GC + q4 (right only where a share is one group)
    mislabels channels in some build."""
    wrong = 0
    for build in V5_BUILDS:
        ln = Lanes(*build)
        for q4, c, bp in itertools.product(range(4), range(ln.KCH), range(ln.BL // 2)):
            channel = ln.CB * c + ln.BL * q4 + 2 * bp
            wrong += (ln.CB * c) // ln.GC + q4 + ln.group_used(bp) != channel // ln.GC
    assert wrong > 0


def packed_group(c: int, q4: int, half=lambda q4: q4 >> 1) -> tuple[int, int]:
    """QMLA_V5_PACKED_GROUPS (2-bit d_c 512, 64-channel groups): the token's groups whose zero point (byte
    2 (c & 1) + q4 / 2 of word c >> 1 of the eight) and scale (half q4 / 2 of word c of the eight bf16) lane q4 picks
    for slice c (``half``: the kernel's q4 / 2, replaced in the negative control)."""
    return 4 * (c >> 1) + 2 * (c & 1) + half(q4), 2 * c + half(q4)


def test_packed_groups_are_the_lanes_groups():
    """With packed zero points and scales, the picked group of each slice is the group the lane's share lies in, for
    both the zero point and the scale; taking q4 & 1 for q4 / 2 would not be."""
    ln = Lanes("C2R4", 512, 64, 64, 64)
    assert ln.NGL == 1
    for c, q4 in itertools.product(range(ln.KCH), range(4)):
        assert packed_group(c, q4) == (ln.group_loaded(c, q4, 0),) * 2, (c, q4)
    assert any(packed_group(c, q4, lambda q: q & 1) != (ln.group_loaded(c, q4, 0),) * 2
               for c, q4 in itertools.product(range(ln.KCH), range(4)))


def test_model_matches_kernel_source():
    """Pin the expressions this model encodes to the kernel text."""
    from quantmla_core.backends.cupy import KERNEL_DIR

    src = " ".join((KERNEL_DIR / "attention_v5.cu").read_text().split())
    for expr in (
        "#define BL (CBH / 4)",
        "#define RBL (RBH / 4)",
        "#define CBH (CB / NHV)",
        "#define RBH (RB / NHV)",
        "#define NGL ((BL >= QMLA_GC) ? BL / QMLA_GC : 1)",
        "const int tq[2] = {16 * ww + g8, 16 * ww + g8 + 8};",
        "return qmla_table_page(tt + 16 * ww, bt_row, L, max_pages);",
        "q.s0 = QMLA_SLOT(tt + t_lane);",
        "q.ok[0] = page_ok && tt + t_lane < L;",  # zero points and scales 0 past L or off the pool
        "q.ok[1] = page_ok && tt + t_lane + 8 < L;",
        "const u32 s = q.s0 + 8 * tk;",
        "x = *(const uint4*)(q.page + QMLA_OFF_CC + s * CB + CBH * q.h + v5_share_byte(16 * v, q4));",
        "q.h = NHV == 1 ? 0 : h;",
        "const int wg = NHV == 1 ? wgi : wgi / NHV, hv = NHV == 1 ? 0 : wgi % NHV;",
        "return QUAD ? 16 * q4 + 64 * (i >> 4) + (i & 15) : BL * q4 + i;",
        "if (ks % 8 == 0) {",
        "v5_quad_group(off2[r & 1][r >> 1][0], s2[r & 1][r >> 1][0], cur, r & 1, r >> 1, ks / 8, c43 | 0x80u);",
        "const u32 c43 = 0x43u | ((u32)L << 8);",  # so cc3's low byte, the zero point pairs' high byte, is 0xc3
        "const int g = (CB / QMLA_GC) * c + v;",
        "off2 = __byte_perm(r.zw[tk][g >> 2], cc3, 0x4040 | (g & 3) | ((g & 3) << 8));",
        "s2 = __byte_perm(r.sw[tk][g >> 1], 0u, (g & 1) ? 0x3232 : 0x1010);",
        "const uint2 z = ok ? *(const uint2*)(q.page + QMLA_OFF_CZ + s * NGC) : make_uint2(0u, 0u);",
        "const uint4 sc = ok ? *(const uint4*)(q.page + QMLA_OFF_CS + s * NGC * 2) : make_uint4(0u, 0u, 0u, 0u);",
        "const u32 z = __byte_perm(cur.zw[tk][c >> 1], 0u, 0x4440 | (2 * (c & 1) + (q4 >> 1)));",
        "const u32 cs = __byte_perm(cur.sw[tk][c], 0u, (q4 & 2) ? 0x4432 : 0x4410);",
        "#define PACKED (QUAD || QMLA_V5_PACKED_GROUPS)",
        "x = *(const uint2*)(q.page + QMLA_OFF_RC + s * RB + RBH * q.h + RBL * q4);",
        "r.wr[tk][0] = *(const u32*)(q.page + QMLA_OFF_RC + s * RB + RBH * q.h + RBL * q4);",
        "const int grp = (CB * c + CBH * q.h + BL * q4) / QMLA_GC + gl;",
        "gl = (BL >= QMLA_GC) ? 2 * bp / QMLA_GC : 0;",
        "const u32 x = (cur.wc[tk][bp >> 1] >> (CBITS * c)) & CMASK;",
        "v5_load_tile(rg, pages, pgn, num_pages, t0 + NWG * T, hv, L, tq[0], q4);",
        "pgn = v5_warp_page(t0 + 2 * NWG * T, ww, bt_row, L, max_pages);",
    ):
        assert expr in src, f"attention_v5.cu no longer contains: {expr}"
    stage = " ".join((KERNEL_DIR / "stage.cuh").read_text().split())
    for expr in ("const u32 j = (u32)n / QMLA_P;", "return (n < L && j < (u32)max_pages) ? bt_row[j] : -1;",
                 "#define QMLA_SLOT(n) ((u32)(n) % QMLA_P)"):
        assert expr in stage, f"stage.cuh no longer contains: {expr}"


# ---------------------------------------------------------------- protected tiles: bf16 rows into A fragments
# A protected tile's lanes load their QK A fragments from the bf16 protection rows instead of dequantizing codes:
# a[j][tk + 2 kh] of chunk kc holds the pair of QK channels 16 ks + 8 kh + 2 q4 (+ 1), ks = KCK kc + j, which lies at
# physical channel v5_qk_channel(16 ks + 8 kh + 2 q4) of token tk's row. "pairs" loads each register on its own,
# "vec" (QMLA_V5_PROT_VEC) a chunk's pairs of one token and slice in one load of W words.


def qk_channel(ln: Lanes, DC: int, DR: int, lc: int, h: int = 0) -> int:
    """attention_v5.cu's v5_qk_channel: the physical channel of half h's QK channel lc."""
    ks, k = lc >> 4, lc & 15
    q, e, hi = (k & 7) >> 1, k & 1, k >> 3
    spc, ksc = ln.KCH // 2, DC // ln.halves // 16
    if ks < ksc:
        return ln.CB * (2 * (ks % spc) + hi) + ln.CBH * h + ln.share_byte(2 * (ks // spc) + e, q)
    return DC + ln.RB * hi + ln.RBH * h + ln.RBL * q + 2 * (ks - ksc) + e


def protected_loads(ln: Lanes, DC: int, DR: int, kck: int, vec: bool, word_kstep=lambda w, sp, spc: spc * w + sp,
                    q4: int = 0, h: int = 0):
    """{(kc, j, r): (token tk, element offset of the pair in the row)} for lane q4 of half h and the loads as (tk,
    element offset, words): the kernel's expressions (``word_kstep``: the k-step of a chunk that word w of slice pair
    sp's load fills, for the negative control)."""
    DC_h, DR_h = DC // ln.halves, DR // ln.halves
    crow, rrow = ln.CBH * h, DC + ln.RBH * h  # crow[tk], rrow[tk] less the row and RBL q4
    spc, ksc, ksteps = ln.KCH // 2, DC_h // 16, (DC_h + DR_h) // 16
    regs, loads = {}, []
    for kc in range(-(-ksteps // kck)):
        for r in range(4):
            tk, kh = r & 1, r >> 1
            if not vec:
                for j in range(kck):
                    ks = kck * kc + j
                    if ks < ksc:
                        off = crow + ln.CB * (2 * (ks % spc) + kh) + ln.share_byte(2 * (ks // spc), q4)
                    elif ks < ksteps:
                        off = rrow + ln.RBL * q4 + ln.RB * kh + 2 * (ks - ksc)
                    else:
                        continue
                    loads.append((tk, off, 1))
                    regs[(kc, j, r)] = (tk, off)
            elif kck * kc < ksc:
                w_n = kck // spc
                for sp in range(spc):
                    base = crow + ln.CB * (2 * sp + kh) + ln.share_byte(2 * (kck * kc // spc), q4)
                    loads.append((tk, base, w_n))
                    for w in range(w_n):
                        regs[(kc, word_kstep(w, sp, spc), r)] = (tk, base + 2 * w)
            elif kck * kc < ksteps:
                w_n = min(kck, DR_h // 16)
                base = rrow + ln.RBL * q4 + ln.RB * kh + 2 * (kck * kc - ksc)
                loads.append((tk, base, w_n))
                for w in range(w_n):
                    regs[(kc, w, r)] = (tk, base + 2 * w)
    return regs, loads


@pytest.mark.parametrize("vec", [False, True], ids=["pairs", "vec"])
@pytest.mark.parametrize("workers", [2, 3, 4])
@pytest.mark.parametrize("build", LOAD_BUILDS, **BUILD_IDS)
def test_protected_loads_fill_the_fragments_qk_reads(build, workers, vec):
    """Every A-fragment register of every k-step of every lane q4 (of each half) gets the pair v5_qk_channel names,
    and with vec every load is aligned to its size (rows 2 (d_c + d_r) bytes apart)."""
    name, dc, dr = build[:3]
    ln = Lanes(*build)
    if ln.quad and workers == 3:
        pytest.skip("three workers never load a quad at a time (v5_quad_loads)")
    why = v5_build_reasons(ln.fmt, workers, ln.halves)
    if why:
        pytest.skip(f"v5 builds no {workers} workers of {ln.halves} warpgroups here: {'; '.join(why)}")
    kck = 2 if workers >= 3 or ln.halves > 1 else 4  # QMLA_V5_KCHUNK
    dc_h, dr_h = dc // ln.halves, dr // ln.halves
    for q4, h in itertools.product(range(4), range(ln.halves)):
        regs, loads = protected_loads(ln, dc, dr, kck, vec, q4=q4, h=h)
        assert regs == _fragments_qk_reads(ln, dc, dr, kck, q4, h)
        spc = ln.KCH // 2
        content_loads = dc_h // 16 // kck * 4 * spc if vec else dc_h // 16 * 4
        rope_loads = -(-(dr_h // 16) // kck) * 4 if vec else dr_h // 16 * 4
        assert len(loads) == content_loads + rope_loads
        if vec:
            row_bytes = 2 * (dc + dr)
            for tk, off, words in loads:
                assert words in (1, 2, 4) and all(x % (4 * words) == 0 for x in (2 * off, row_bytes)), (off, words)


def _fragments_qk_reads(ln: Lanes, dc: int, dr: int, kck: int, q4: int = 0, h: int = 0) -> dict:
    """{(kc, j, r): (tk, physical channel)}: a[j][tk + 2 kh] of chunk kc holds QK channels 16 ks + 8 kh + 2 q4 (+ 1)
    of half h."""
    want = {}
    for ks in range((dc + dr) // ln.halves // 16):
        for r in range(4):
            tk, kh = r & 1, r >> 1
            want[(ks // kck, ks % kck, r)] = (tk, qk_channel(ln, dc, dr, 16 * ks + 8 * kh + 2 * q4, h))
    return want


@pytest.mark.parametrize("build", LOAD_BUILDS, **BUILD_IDS)
def test_query_tiles_and_partials_cover_every_channel_once(build):
    """The queries each half's QK reads, and the partial-output channels its PV rows go back to, are v5_qk_channel of
    its channels: over the halves every physical channel once (the queries: each of d_c + d_r, in the pairs the
    prologue stages, pair lp of a row being pair lp - hq DTH / 2 of half hq = lp / (DTH / 2)); the pairs are adjacent
    channels (one 4-byte load each)."""
    name, dc, dr = build[:3]
    ln = Lanes(*build)
    dth = (dc + dr) // ln.halves
    staged = []
    for lp in range((dc + dr) // 2):
        hq = lp // (dth // 2)
        pc = qk_channel(ln, dc, dr, 2 * (lp - hq * (dth // 2)), hq)
        assert qk_channel(ln, dc, dr, 2 * (lp - hq * (dth // 2)) + 1, hq) == pc + 1 and pc % 2 == 0
        staged += [pc, pc + 1]
    assert sorted(staged) == list(range(dc + dr))
    # the partials: row 16 ww + g8 + 8 h2 of PV block mb is QK channel 64 mb + 16 ww + g8 + 8 h2 of the half
    out = [qk_channel(ln, dc, dr, 64 * mb + r, h) for h in range(ln.halves) for mb in range(dc // ln.halves // 64)
           for r in range(64)]
    assert sorted(out) == list(range(dc))
    # control: a half that forgot its offset (CBH h) writes half 0's channels twice
    if ln.halves > 1:
        wrong = [qk_channel(ln, dc, dr, 64 * mb + r, 0) for _h in range(2) for mb in range(dc // 128) for r in range(64)]
        assert sorted(wrong) != list(range(dc))


def test_protected_load_model_catches_a_wrong_word_order():
    """Control: word w of a vec load put into k-step sp W + w (instead of SPC w + sp) fills the wrong fragments
    for 2-bit content (two slice pairs per byte pair), and is harmless for 4-bit content (one)."""
    for name, kck, caught in (("C2R4", 4, True), ("C2R4", 8, True), ("C4R4", 4, False)):
        ln = Lanes(name, 512, 64, 64, 64)
        regs, _ = protected_loads(ln, 512, 64, kck, True, word_kstep=lambda w, sp, spc: sp * (kck // spc) + w)
        assert (regs != _fragments_qk_reads(ln, 512, 64, kck)) == caught


def test_protected_load_model_matches_kernel_source():
    """Pin the expressions of protected_loads to the kernel text."""
    from quantmla_core.backends.cupy import KERNEL_DIR

    src = " ".join((KERNEL_DIR / "attention_v5.cu").read_text().split())
    for expr in (
        "crow[tk] = row + CBH * hv;",
        "rrow[tk] = row + DC + RBH * hv + RBL * q4;",
        "if (ks < KSC) return CB * (2 * (ks % SPC) + hi) + CBH * h + v5_share_byte(2 * (ks / SPC) + e, q);",
        "return DC + RB * hi + RBH * h + RBL * q + 2 * (ks - KSC) + e;",
        "const int hq = NHV == 1 ? 0 : lp / (DTH / 2), pc = v5_qk_channel(2 * (lp - hq * (DTH / 2)), hq);",
        "const int hq = NHV == 1 ? 0 : lp / (DTH / 2), lph = lp - hq * (DTH / 2);",
        "ch = v5_qk_channel(64 * mb + 16 * ww + g8 + 8 * ((k >> 1) & 1), hv);",
        "a[jj][r] = __ldg((const u32*)(crow[tk] + CB * (2 * (ks % SPC) + kh) + v5_share_byte(2 * (ks / SPC), q4)));",
        "a[jj][r] = __ldg((const u32*)(rrow[tk] + RB * kh + 2 * (ks - KSC)));",
        "constexpr int W = KCK / SPC;",
        "v5_load_words<W>(v, crow[tk] + CB * (2 * sp + kh) + v5_share_byte(2 * (KCK * kc / SPC), q4));",
        "for (int w = 0; w < W; ++w) a[SPC * w + sp][r] = v[w];",
        "constexpr int W = (KCK < DRH / 16) ? KCK : DRH / 16;",
        "v5_load_words<W>(v, rrow[tk] + RB * kh + 2 * (KCK * kc - KSC));",
        "for (int w = 0; w < W; ++w) a[w][r] = v[w];",
        "if (KCK * kc < KSC) {",
    ):
        assert expr in src, f"attention_v5.cu no longer contains: {expr}"
