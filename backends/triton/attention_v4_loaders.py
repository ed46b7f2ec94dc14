"""Kernel v4's loader partition (4 or 8 warps) and its per-format page dequantizers (Gluon, Hopper).

Per 64-token page ``i`` of the split, the loader writes the page's keys as bfloat16 into slot ``i % 2`` of the
shared tiles ``kc`` ``[2, 64, DC]`` (content) and ``kr`` ``[2, 64, DR]`` (RoPE), then runs the output product over
the high half of the content channels for the page before it (``acc_hi = acc_hi * alpha + P @ K[:, DC/2:]``, P and
alpha from the attender through shared memory). ``attention_v4_kernel`` describes the barrier protocol.

Content value = ``bf16(s * (code - zero))``: ``code - zero`` is exact in bfloat16 (``128 + code`` minus
``128 + zero``), and the bfloat16 scale times it is rounded once (the float32 product, exact, rounded to bfloat16:
kernel v3's and a BF16 cache's value). RoPE (float32 scales): the float32 product rounded to bfloat16, as v3.

Channel order (split-half packing, ``quantmla_core.formats``): byte ``j`` of a token's code row holds channel
``j + pl * BYTES`` in bits ``[pl * BITS, (pl + 1) * BITS)`` (``BYTES`` = bytes a row). A 32-bit word (bytes
``4w .. 4w + 3``, little-endian) shifted by ``8 * b + BITS * pl`` and masked in both 16-bit halves holds plane
``pl`` of bytes ``4w + b`` (low half) and ``4w + 2 + b`` (high half). ``tests/test_triton_v4_offline.py`` mirrors
these loads in NumPy against the reference decoder.
"""

from __future__ import annotations

GLUON_IMPORT_ERROR: str | None = None
try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_init
    _needs = (gluon.constexpr_function, gl.warp_specialize, gl.NVMMADistributedLayout, gl.NVMMASharedLayout,
              async_copy.async_copy_global_to_shared)  # older Gluon releases lack some: no kernel v4 there
except Exception as exc:  # a triton without Gluon (or without its Hopper module)
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

if GLUON_IMPORT_ERROR is None:
    #: pages of this many tokens (one table entry, one pair of shared tiles)
    PAGE_TOKENS = gl.constexpr(64)
    #: triton 3.7 names the CTA barrier ``barrier``, 3.6 ``thread_barrier``
    _HAS_BARRIER = gl.constexpr(hasattr(gl, "barrier"))
    #: ``lop3`` LUT 0xEA: ``(x & mask) | 0x43004300``, then the halves as two bfloat16 ``128 + code``
    ASM_PAIR4 = gl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 983055, 1124090624, 0xEA; mov.b32 {$0, $1}, t; }")
    ASM_PAIR2 = gl.constexpr("{ .reg .b32 t; lop3.b32 t, $2, 196611, 1124090624, 0xEA; mov.b32 {$0, $1}, t; }")

    @gluon.jit
    def _partition_barrier():
        """A barrier of the calling partition's warps (``bar.sync`` on its named barrier inside a partition)."""
        if _HAS_BARRIER:
            gl.barrier()
        else:  # triton 3.6
            gl.thread_barrier()

    @gluon.constexpr_function
    def _acc_layout(N, WARPS=4):
        """The wgmma accumulator layout of a [64, N] float32 tile on ``WARPS`` warps: one warpgroup, or two that
        take halves of the N columns each."""
        groups = int(WARPS) // 4
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups],
                                         instr_shape=[16, int(N) // groups, 16])

    @gluon.constexpr_function
    def _rows_layout(PER_THREAD, COLS, WARPS):
        """A blocked layout of [64, COLS] (or more rows) with ``PER_THREAD`` consecutive columns a thread, the rows
        over ``WARPS`` warps."""
        lanes_c = int(COLS) // int(PER_THREAD)
        return gl.BlockedLayout([1, int(PER_THREAD)], [32 // lanes_c, lanes_c], [int(WARPS), 1], [1, 0])

    @gluon.jit
    def to_channel_order(x, N: gl.constexpr, C: gl.constexpr):
        """``x`` ``[N, C]`` in channel order rearranged so that column ``j`` holds channel ``channel_of(j)``
        (register moves within each thread's groups of 4 columns; C a multiple of 4). Gluon code cannot call
        ``common_kernels.to_channel_order``, the merge kernel's Triton twin."""
        y0, y1 = gl.split(gl.reshape(x, [N, C // 4, 2, 2]))  # columns 4q + 2a and 4q + 2a + 1
        c0, c2 = gl.split(y0)
        c1, c3 = gl.split(y1)
        return gl.reshape(gl.join(gl.join(c0, c1), gl.join(c2, c3)), [N, C])  # [.., i, o] = column i + 2 o

    @gluon.jit
    def page_of(table_row, j, num_pages, PAGE_BYTES: gl.constexpr, live=True):
        """Page ``j`` of the request (its tokens ``[64 j, 64 j + 64)``): its byte offset (0 for an id outside
        ``[0, num_pages)``, as kernel v2's ``tile_pages``) and whether the id is valid. ``live`` False: the table
        is not read (a page past the split's last) and the page is invalid."""
        page = gl.load(table_row + j, mask=live, other=-1)
        page_ok = (page >= 0) & (page < num_pages)
        return gl.where(page_ok, page, 0).to(gl.int64) * PAGE_BYTES, page_ok

    @gluon.jit
    def tokens_ok(tok, j, ps, pe, page_ok):
        """Which tokens ``tok`` (``[64]``, offsets in page ``j``) are in ``[ps, pe)`` on a valid page."""
        n = j * PAGE_TOKENS + tok
        return (n >= ps) & (n < pe) & page_ok

    @gluon.jit
    def _pages_for(n):
        """Pages of ``PAGE_TOKENS`` that ``n`` tokens fill."""
        return (n + PAGE_TOKENS - 1) // PAGE_TOKENS

    @gluon.jit
    def protected_pages(SINK, LOCAL):
        """Pages of 64 protected tokens a request: the sink's, then the local window's."""
        return _pages_for(SINK) + _pages_for(LOCAL)

    @gluon.jit
    def is_protected_page(i, n_tiles, n_prot):
        """Whether step ``i`` of a split's walk is a protected page: one of the ``n_prot`` after its ``n_tiles``
        packed pages. Not the dead page an empty split walks (``n_tiles + n_prot == 0``): every split but the last
        would then attend to the sink again."""
        return (i >= n_tiles) & (i < n_tiles + n_prot)

    @gluon.jit
    def protected_span(e, L, SINK, LOCAL, seq_ok):
        """Protected page ``e`` (:func:`protected_pages`) as scalars: its slot ``t`` holds position ``base + t``, a
        protected token where ``lo <= base + t < hi`` (``protect_kernel``'s rule: the first ``min(SINK, L)``
        positions, then the last ``LOCAL`` of ``L`` after them), and whether it is the sink's."""
        sink_pages = _pages_for(SINK)
        is_sink = e < sink_pages
        n_sink = gl.minimum(SINK, L)
        first_local = gl.maximum(L - LOCAL, n_sink)
        base = gl.where(is_sink, e * PAGE_TOKENS, first_local + (e - sink_pages) * PAGE_TOKENS)
        lo = gl.where(is_sink, 0, first_local)
        hi = gl.where(is_sink, n_sink, gl.minimum(L, first_local + LOCAL))
        return base, lo, gl.where(seq_ok, hi, lo), is_sink

    @gluon.jit
    def visible_span(i, j, page_ok, ps, pe, n_tiles, L, prot, INLINE_PROT: gl.constexpr):
        """Step ``i`` of the split's walk (page ``j``) as scalars: its slot ``t`` holds position ``base + t``, visible
        (before the causal limit) where ``lo <= base + t < hi``; past the packed pages, the protected page's span
        (``prot``: the kernel's protected-token tuple)."""
        base = j * PAGE_TOKENS
        lo = ps
        hi = gl.where(page_ok, pe, ps)
        if INLINE_PROT:
            seq_ok, SINK, LOCAL, n_prot = prot[3], prot[5], prot[6], prot[7]
            base_p, lo_p, hi_p, _ = protected_span(i - n_tiles, L, SINK, LOCAL, seq_ok)
            is_prot = is_protected_page(i, n_tiles, n_prot)
            base = gl.where(is_prot, base_p, base)
            lo = gl.where(is_prot, lo_p, lo)
            hi = gl.where(is_prot, hi_p, hi)
        return base, lo, hi

    @gluon.jit
    def finish_slot(i, n_tiles, prot, kc_s, kr_s, DC: gl.constexpr, DR: gl.constexpr, WARPS: gl.constexpr,
                    INLINE_PROT: gl.constexpr, CHANNEL_ORDER: gl.constexpr):
        """A filled key slot made ready for the caller's one arrival on its ``kfull``: for a protected page
        (``INLINE_PROT``; the slot holds the dead page's zeros) its bfloat16 rows copied in first, then every thread's
        fence and the partition's barrier."""
        if INLINE_PROT:
            sink_ptr, local_ptr, seq, seq_ok, L, SINK, LOCAL, n_prot = prot
            if is_protected_page(i, n_tiles, n_prot):
                _partition_barrier()
                _load_protected_page(sink_ptr, local_ptr, seq, seq_ok, i - n_tiles, L, SINK, LOCAL, kc_s, kr_s, DC,
                                     DR, WARPS, CHANNEL_ORDER)
        fence_async_shared()  # generic-proxy stores, read next by wgmma (async proxy)
        _partition_barrier()  # every thread's fence before the one arrival

    @gluon.jit
    def protected_rows(sink_ptr, local_ptr, seq, span, tok, SINK, LOCAL, D: gl.constexpr):
        """Slots ``tok`` of the protected page whose :func:`protected_span` is ``span``, of request slot ``seq``: each
        one's bfloat16 row ``[D]`` in the sink or window buffer (the window a ring by position; row 0 of the request
        where no protected token is there), and whether it holds a protected token."""
        base, lo, hi, is_sink = span
        n = base + tok
        ok = (n >= lo) & (n < hi)
        ring = n % gl.maximum(LOCAL, 1)
        row = gl.where(is_sink, seq * SINK + gl.where(ok, n, 0), seq * LOCAL + gl.where(ok, ring, 0))
        return gl.where(is_sink, sink_ptr, local_ptr) + row * D, ok

    @gluon.jit
    def _load_protected_page(sink_ptr, local_ptr, seq, seq_ok, e, L, SINK, LOCAL, kc_s, kr_s, DC: gl.constexpr,
                             DR: gl.constexpr, WARPS: gl.constexpr, CHANNEL_ORDER: gl.constexpr = False):
        """Protected page ``e`` of request slot ``seq`` copied from the bfloat16 sink / window rows ``[DC + DR]``
        (``cache.sink_buf`` / ``cache.local_buf``, the window a ring by position) into ``kc_s`` / ``kr_s``
        (``cp.async``, waited for; 0 for slots without a protected token). ``CHANNEL_ORDER`` (beside packed pages):
        in the packed tiles' channel order (``common_kernels.channel_of``), through registers, since the order moves
        2-byte values inside 8-byte groups, which no copy of whole chunks can do."""
        lay: gl.constexpr = _rows_layout(8, 64, WARPS)
        tok = gl.arange(0, 64, gl.SliceLayout(1, lay))
        col = gl.arange(0, 64, gl.SliceLayout(0, lay))
        span = protected_span(e, L, SINK, LOCAL, seq_ok)
        base, ok = protected_rows(sink_ptr, local_ptr, seq, span, tok, SINK, LOCAL, DC + DR)
        mask = ok[:, None] & (col < 64)[None, :]
        if CHANNEL_ORDER:
            for c in gl.static_range(DC // 64):
                x = gl.load(base[:, None] + (c * 64 + col)[None, :], mask=mask, other=0.0)
                kc_s.slice(c * 64, 64, dim=1).store(to_channel_order(x, 64, 64))
            x = gl.load(base[:, None] + (DC + col)[None, :], mask=mask, other=0.0)
            kr_s.store(to_channel_order(x, 64, DR))
        else:
            for c in gl.static_range(DC // 64):
                async_copy.async_copy_global_to_shared(kc_s.slice(c * 64, 64, dim=1),
                                                       base[:, None] + (c * 64 + col)[None, :], mask=mask)
            async_copy.async_copy_global_to_shared(kr_s, base[:, None] + (DC + col)[None, :], mask=mask)
            async_copy.commit_group()
            async_copy.wait_group(0)

    @gluon.jit
    def _pair(w, SHIFT: gl.constexpr, BITS: gl.constexpr):
        """Plane codes at bit ``SHIFT`` of both 16-bit halves of the words ``w`` as two bfloat16 ``128 + code``."""
        if BITS == 4:
            ASM: gl.constexpr = ASM_PAIR4
        else:
            ASM: gl.constexpr = ASM_PAIR2
        return gl.inline_asm_elementwise(ASM, "=h,=h,r", [w >> SHIFT], dtype=(gl.bfloat16, gl.bfloat16),
                                         is_pure=True, pack=1)

    @gluon.jit
    def _plane(w, pl: gl.constexpr, BITS: gl.constexpr, zb, s, N: gl.constexpr, W: gl.constexpr,
               F32_SCALE: gl.constexpr, CHANNEL_ORDER: gl.constexpr = False):
        """Plane ``pl`` of the words ``w`` ``[N, W]`` dequantized: bfloat16 ``[N, 4 * W]``, column ``j`` = byte ``j``,
        or with ``CHANNEL_ORDER`` byte ``channel_of(j)`` (bytes 1 and 2 of each word trade places). ``zb``:
        ``128 + zero`` (bfloat16 ``[N]``); ``s``: scales ``[N]`` (bfloat16, or float32 with ``F32_SCALE``: the float32
        product rounded to bfloat16)."""
        lo0, hi0 = _pair(w, BITS * pl, BITS)  # bytes 0 and 2 of each word
        lo1, hi1 = _pair(w, 8 + BITS * pl, BITS)  # bytes 1 and 3
        lo0 = _scaled(lo0, zb, s, F32_SCALE)
        hi0 = _scaled(hi0, zb, s, F32_SCALE)
        lo1 = _scaled(lo1, zb, s, F32_SCALE)
        hi1 = _scaled(hi1, zb, s, F32_SCALE)
        if CHANNEL_ORDER:  # [N, W, i, o] = byte i + 2 o: each register pair (lo, hi) of one word lands side by side,
            # which spares the byte permutes that the plain order costs (``common_kernels.channel_of``)
            k = gl.join(gl.join(lo0, lo1), gl.join(hi0, hi1))
        else:
            k = gl.join(gl.join(lo0, hi0), gl.join(lo1, hi1))  # [N, W, i, o] = byte 2i + o
        return gl.reshape(k, [N, 4 * W])

    @gluon.jit
    def _biased_zero(z):
        """uint8 zero points ``z`` (< 128: a format's zeros are at most 2^bits - 1) as bfloat16 ``128 + z``, by their
        bits: ``0x4300`` is 128, whose last mantissa bit is worth 1 (one integer OR, no float conversion)."""
        return (z.to(gl.int16) | 0x4300).to(gl.bfloat16, bitcast=True)

    @gluon.jit
    def _scaled(x, zb, s, F32_SCALE: gl.constexpr):
        """``s * ((128 + code) - (128 + zero))`` for bfloat16 ``x`` ``[N, W]`` and ``[N]`` zb, s."""
        k = x - zb[:, None]
        if F32_SCALE:
            return (k.to(gl.float32) * s[:, None]).to(gl.bfloat16)
        else:
            return k * s[:, None]

    @gluon.jit
    def _load_bf16_page(pages_ptr, page_off, j, ps, pe, page_ok, kc_s, kr_s, DC: gl.constexpr, DR: gl.constexpr,
                        C_OFF: gl.constexpr, R_OFF: gl.constexpr, WAIT: gl.constexpr = True, WARPS: gl.constexpr = 4):
        """BF16 pages: the page's content and RoPE values copied into ``kc_s`` / ``kr_s`` (``cp.async``; 0 for
        tokens not ``tok_ok``, whose slots may hold any bits), waited for (``WAIT`` False: in flight, one commit
        group)."""
        lay: gl.constexpr = _rows_layout(8, 64, WARPS)
        tok = gl.arange(0, 64, gl.SliceLayout(1, lay))
        col = gl.arange(0, 64, gl.SliceLayout(0, lay))
        ok = tokens_ok(tok, j, ps, pe, page_ok)[:, None] & (col < 64)[None, :]
        vals = pages_ptr.to(gl.pointer_type(gl.bfloat16))
        for c in gl.static_range(DC // 64):
            ptrs = vals + (page_off + C_OFF) // 2 + tok[:, None] * DC + (c * 64 + col)[None, :]
            async_copy.async_copy_global_to_shared(kc_s.slice(c * 64, 64, dim=1), ptrs, mask=ok)
        ptrs = vals + (page_off + R_OFF) // 2 + tok[:, None] * DR + col[None, :]
        async_copy.async_copy_global_to_shared(kr_s, ptrs, mask=ok)
        async_copy.commit_group()
        if WAIT:
            async_copy.wait_group(0)

    @gluon.jit
    def _load(ptrs, mask, other, MADE_UP: gl.constexpr = False):
        """``gl.load(ptrs, mask=mask, other=other)``; with ``MADE_UP`` (a probe build, wrong outputs) nothing is
        loaded: each element is made from its own address, so that no two are known to be equal."""
        if MADE_UP:
            return ((ptrs.to(gl.int64, bitcast=True) >> 1) & 127).to(ptrs.dtype.element_ty)
        else:
            return gl.load(ptrs, mask=mask, other=other)

    @gluon.jit
    def _code_raws(pages_ptr, page_off, j, ps, pe, page_ok, DC: gl.constexpr, DR: gl.constexpr, CBITS: gl.constexpr,
                   RBITS: gl.constexpr, C_CODES_OFF: gl.constexpr, R_CODES_OFF: gl.constexpr,
                   C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr, R_SCALES_OFF: gl.constexpr,
                   R_ZEROS_OFF: gl.constexpr, WARPS: gl.constexpr = 4, MADE_UP: gl.constexpr = False):
        """Packed page ``j``'s bytes, loaded (not yet used, so that the loads are in flight while the loader does
        other work): :func:`_code_words` and :func:`_code_params` (``MADE_UP``: see :func:`_load`)."""
        raws = _code_words(pages_ptr, page_off, j, ps, pe, page_ok, DC, CBITS, C_CODES_OFF, WARPS, MADE_UP)
        scales, zeros, rw, rs, rz = _code_params(pages_ptr, page_off, j, ps, pe, page_ok, DC, DR, RBITS, C_SCALES_OFF,
                                                 C_ZEROS_OFF, R_CODES_OFF, R_SCALES_OFF, R_ZEROS_OFF, WARPS, MADE_UP)
        return raws, scales, zeros, rw, rs, rz

    @gluon.jit
    def _code_words(pages_ptr, page_off, j, ps, pe, page_ok, DC: gl.constexpr, CBITS: gl.constexpr,
                    C_CODES_OFF: gl.constexpr, WARPS: gl.constexpr = 4, MADE_UP: gl.constexpr = False):
        """Packed page ``j``'s content words: ``[64, 16]`` uint32 per 64-byte chunk of the token rows. Tokens not in
        ``[ps, pe)`` or on an invalid page read 0."""
        CBYTES: gl.constexpr = DC * CBITS // 8
        NCH: gl.constexpr = CBYTES // 64
        wl: gl.constexpr = _rows_layout(4, 16, WARPS)  # [64, 16] words, 16 B a thread
        tok = gl.arange(0, 64, gl.SliceLayout(1, wl))
        ok = tokens_ok(tok, j, ps, pe, page_ok)
        wcol = gl.arange(0, 16, gl.SliceLayout(0, wl))
        words = pages_ptr.to(gl.pointer_type(gl.uint32))
        crow = (page_off + C_CODES_OFF) // 4 + tok * (CBYTES // 4)
        raws = ()
        for c in gl.static_range(NCH):
            raws = raws + (_load(words + crow[:, None] + (c * 16 + wcol)[None, :], ok[:, None], 0, MADE_UP),)
        return raws

    @gluon.jit
    def _code_params(pages_ptr, page_off, j, ps, pe, page_ok, DC: gl.constexpr, DR: gl.constexpr, RBITS: gl.constexpr,
                     C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr, R_CODES_OFF: gl.constexpr,
                     R_SCALES_OFF: gl.constexpr, R_ZEROS_OFF: gl.constexpr, WARPS: gl.constexpr = 4,
                     MADE_UP: gl.constexpr = False):
        """Packed page ``j``'s content scales (bfloat16) and zeros (uint8) ``[64]`` per group, RoPE words
        ``[64, RW]``, RoPE scale (float32) and zero ``[64]``. Tokens not in ``[ps, pe)`` or on an invalid page read 0
        (scale 0: their keys dequantize to 0)."""
        NG: gl.constexpr = DC // 64
        wl: gl.constexpr = _rows_layout(4, 16, WARPS)
        tok = gl.arange(0, 64, gl.SliceLayout(1, wl))
        ok = tokens_ok(tok, j, ps, pe, page_ok)
        words = pages_ptr.to(gl.pointer_type(gl.uint32))
        scales = _per_group(pages_ptr.to(gl.pointer_type(gl.bfloat16)) + (page_off + C_SCALES_OFF) // 2, ok, 0.0,
                            NG, WARPS, MADE_UP)
        zeros = _per_group(pages_ptr + (page_off + C_ZEROS_OFF), ok, 0, NG, WARPS, MADE_UP)

        RW: gl.constexpr = DR * RBITS // 8 // 4
        rl: gl.constexpr = _rows_layout(64 * RW // (32 * WARPS), RW, WARPS)  # 64 tokens of RW words, no repeats
        rtok = gl.arange(0, 64, gl.SliceLayout(1, rl))
        rok = tokens_ok(rtok, j, ps, pe, page_ok)
        rw = _load(words + ((page_off + R_CODES_OFF) // 4 + rtok * RW)[:, None]
                   + gl.arange(0, RW, gl.SliceLayout(0, rl))[None, :], rok[:, None], 0, MADE_UP)
        rs = _load(pages_ptr.to(gl.pointer_type(gl.float32)) + (page_off + R_SCALES_OFF) // 4 + rtok, rok, 0.0,
                   MADE_UP)
        rz = _load(pages_ptr + (page_off + R_ZEROS_OFF) + rtok, rok, 0, MADE_UP)
        return scales, zeros, rw, rs, rz

    @gluon.jit
    def _per_group(base, ok, other, NG: gl.constexpr, WARPS: gl.constexpr = 4, MADE_UP: gl.constexpr = False):
        """A per-token, per-group section ``[64, NG]`` (``NG`` = 8 groups, token-major from ``base``) as ``NG``
        tensors ``[64]`` in ``_rows_layout(4, 16, WARPS)``'s rows: one vector load of a token's row, then register
        splits (``other`` where ``ok`` is False)."""
        gl.static_assert(NG == 8, "kernel v4: 8 groups a token")
        lay: gl.constexpr = gl.BlockedLayout([1, NG], [8, 4], [WARPS, 1], [1, 0])  # wl's rows, a token's groups
        tok = gl.arange(0, 64, gl.SliceLayout(1, lay))
        g = gl.arange(0, NG, gl.SliceLayout(0, lay))
        row_ok = gl.convert_layout(ok, gl.SliceLayout(1, lay))
        x = _load(base + (tok * NG)[:, None] + g[None, :], row_ok[:, None], other, MADE_UP)
        c0, c1 = gl.split(gl.reshape(x, [64, 2, 2, 2]))  # group 4a + 2b + c: c
        b00, b01 = gl.split(c0)
        b10, b11 = gl.split(c1)
        g0, g4 = gl.split(b00)
        g2, g6 = gl.split(b01)
        g1, g5 = gl.split(b10)
        g3, g7 = gl.split(b11)
        rows: gl.constexpr = gl.SliceLayout(1, _rows_layout(4, 16, WARPS))
        out = ()
        for t in gl.static_range(8):
            out = out + (gl.convert_layout((g0, g1, g2, g3, g4, g5, g6, g7)[t], rows),)
        return out

    @gluon.jit
    def _store_code_page(raws, scales, zeros, rw, rs, rz, kc_s, kr_s, DC: gl.constexpr, DR: gl.constexpr,
                         CBITS: gl.constexpr, RBITS: gl.constexpr, CHANNEL_ORDER: gl.constexpr = False,
                         HALF: gl.constexpr = 2):
        """A packed page's bytes (:func:`_code_raws`) dequantized to bfloat16 into ``kc_s`` ``[64, DC]`` /
        ``kr_s`` ``[64, DR]`` (columns in ``channel_of`` order with ``CHANNEL_ORDER``).

        Content: a chunk is 64 bytes (16 words) of every token's row; plane ``pl`` of it is the 64 channels
        ``pl * CBYTES + 64 c + [0, 64)``, one quantization group, one [64, 64] slice of ``kc_s``.

        ``HALF`` 0: only the content channels ``[0, DC/2)`` (the planes below ``CPLANES / 2``) and the RoPE keys; 1:
        only the channels ``[DC/2, DC)``; 2: all."""
        CBYTES: gl.constexpr = DC * CBITS // 8
        CPLANES: gl.constexpr = 8 // CBITS
        NCH: gl.constexpr = CBYTES // 64
        for c in gl.static_range(NCH):
            for pl in gl.static_range(CPLANES):
                if HALF == 2 or (pl < CPLANES // 2) == (HALF == 0):  # all, or the half's planes
                    # the chunk's plane is group pl * CBYTES / 64 + c
                    zb = _biased_zero(zeros[pl * CBYTES // 64 + c])
                    k = _plane(raws[c], pl, CBITS, zb, scales[pl * CBYTES // 64 + c], 64, 16, False, CHANNEL_ORDER)
                    kc_s.slice(pl * CBYTES + 64 * c, 64, dim=1).store(k)
        if HALF != 1:
            _store_rope(rw, rs, rz, kr_s, DR, RBITS, CHANNEL_ORDER)

    @gluon.jit
    def _store_rope(rw, rs, rz, kr_s, DR: gl.constexpr, RBITS: gl.constexpr, CHANNEL_ORDER: gl.constexpr):
        """A packed page's RoPE words ``rw`` ``[64, RW]`` (float32 scales ``rs``, zeros ``rz``) dequantized into
        ``kr_s`` ``[64, DR]``."""
        # RoPE: RBYTES = DR / 2 bytes a row (8 words at DR 64); plane 0 = channels [0, DR/2), plane 1 the rest
        RW: gl.constexpr = DR * RBITS // 8 // 4
        rzb = _biased_zero(rz)
        k0 = _plane(rw, 0, RBITS, rzb, rs, 64, RW, True, CHANNEL_ORDER)
        k1 = _plane(rw, 1, RBITS, rzb, rs, 64, RW, True, CHANNEL_ORDER)
        kr = gl.reshape(gl.permute(gl.join(k0, k1), (0, 2, 1)), [64, DR])  # [n, plane, j] -> channel plane*DR/2 + j
        kr_s.store(kr)

    @gluon.jit
    def _pv_hi_issue(o, p_s, alpha_s, kc_s, pready, i, DC: gl.constexpr, RUN: gl.constexpr = True,
                     WARPS: gl.constexpr = 4):
        """Build 4: the loader's output product for page ``i`` (``o * alpha + P @ K[:, DC/2:]``, once P and alpha
        are ready) issued and left in flight: the accumulator, for :func:`_pv_hi_retire`. ``RUN`` False (a probe):
        ``o`` unchanged."""
        mbarrier.wait(pready, i & 1)
        if RUN:
            alpha = alpha_s.load(gl.SliceLayout(1, _acc_layout(DC // 2, WARPS)))
            return warpgroup_mma(p_s, kc_s.slice(DC // 2, DC // 2, dim=1), o * alpha[:, None], is_async=True)
        else:
            return warpgroup_mma_init(o)

    @gluon.jit
    def _pv_hi_retire(acc, pfree, live, WARPS: gl.constexpr = 4):
        """Build 4: waits for the output product :func:`_pv_hi_issue` left in flight and returns it, after freeing P
        (where ``live``: a product was issued). The key slot's high half is the loader's own to overwrite from here."""
        o = warpgroup_mma_wait(0, deps=[acc])
        if WARPS > 4:
            _partition_barrier()
        mbarrier.arrive(pfree, pred=live)
        return o

    @gluon.jit
    def _pv_hi(acc, p_s, alpha_s, kc_s, pready, pfree, kempty_s, i, DC: gl.constexpr, RUN: gl.constexpr = True,
               WARPS: gl.constexpr = 4):
        """The loader's output product for page ``i`` (its keys in ``kc_s``): waits for P and alpha, returns
        ``acc * alpha + P @ K[:, DC/2:]`` retired, then frees P and its half of the key slot. ``RUN`` False (a probe):
        the handoffs alone, ``acc`` unchanged. With 8 ``WARPS`` each warpgroup takes half the columns, and both
        retire theirs before the one arrival."""
        o_layout: gl.constexpr = _acc_layout(DC // 2, WARPS)
        mbarrier.wait(pready, i & 1)
        if RUN:
            alpha = alpha_s.load(gl.SliceLayout(1, o_layout))
            acc = warpgroup_mma(p_s, kc_s.slice(DC // 2, DC // 2, dim=1), acc * alpha[:, None], is_async=True)
            acc = warpgroup_mma_wait(0, deps=[acc])
        if WARPS > 4:
            _partition_barrier()
        mbarrier.arrive(pfree)
        mbarrier.arrive(kempty_s)
        return acc

    @gluon.jit
    def loader_partition(pages_ptr, table_row, num_pages, o_part_ptr, part, rb, R, ps, pe, j_lo, n_tiles,
                         bufs, bars, prot, QUANT: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr,
                         CBITS: gl.constexpr, RBITS: gl.constexpr, P: gl.constexpr, PAGE_BYTES: gl.constexpr,
                         C_CODES_OFF: gl.constexpr, R_CODES_OFF: gl.constexpr, C_SCALES_OFF: gl.constexpr,
                         C_ZEROS_OFF: gl.constexpr, R_SCALES_OFF: gl.constexpr, R_ZEROS_OFF: gl.constexpr,
                         BLOCK_R: gl.constexpr, PIPELINE: gl.constexpr = 0, PROBE: gl.constexpr = 0,
                         WARPS: gl.constexpr = 4, INLINE_PROT: gl.constexpr = False,
                         CHANNEL_ORDER: gl.constexpr = False):
        """Worker partition: fill key slot ``i % 2`` with page ``j_lo + i`` (after both output products of page
        ``i - 2`` freed it), then run the output product of page ``i - 1`` over channels ``[DC/2, DC)``; at the
        end write those channels of the partial output (after the attender published the final ``l``). Build 4
        (``PIPELINE``, packed pages): ``kempty`` counts the attender's arrival alone; the loader converts page ``i``'s
        low channels and RoPE keys, retires its product of page ``i - 2`` (the slot's high half), converts the high
        channels, hands the page over and issues the product of page ``i - 1`` without waiting for it.

        ``PROBE`` (measurement builds, wrong outputs): bit 0 skips the keys (no page bytes loaded, nothing written to
        the key slot), bit 1 the output product (the handoffs stay), bit 2 the packed pages' loads (their words are
        made up, :func:`_load`). Build 2 over BF16 pages (``PV_EARLY``) copies page i while it runs the output product
        of page i - 1 and arrives ``kfull`` after both. ``WARPS``: 4 (one warpgroup) or 8 (two, each converting half
        of the tokens and taking half of the output columns).
        ``INLINE_PROT``: after its ``n_tiles`` pages the split walks ``prot``'s ``n_prot`` protected pages (bfloat16
        rows of the sink and the window, :func:`_load_protected_page`; 0 but on the last split). ``CHANNEL_ORDER``
        (packed pages): key tiles, protected rows and the partial output in ``channel_of`` order."""
        kc, kr, q_s, qr_s, p_s, alpha_s, l_s = bufs
        kfull, kempty, pready, pfree, lfin = bars
        o_layout: gl.constexpr = _acc_layout(DC // 2, WARPS)
        acc = gl.zeros([BLOCK_R, DC // 2], gl.float32, o_layout)
        KEYS: gl.constexpr = PROBE % 2 == 0
        PV: gl.constexpr = PROBE // 2 % 2 == 0
        MADE_UP: gl.constexpr = PROBE // 4 == 1
        CODES: gl.constexpr = QUANT and KEYS
        # BF16 pages, build 2: page i's copy is issued before the output product of page i - 1 and waited for after it
        BF16_PAGES: gl.constexpr = KEYS and not QUANT
        PV_EARLY: gl.constexpr = BF16_PAGES and PIPELINE == 2
        # build 4: the output product of page i - 1 stays in flight while the loader converts page i + 1's low half
        ASYNC_PV: gl.constexpr = PIPELINE == 4
        gl.static_assert(QUANT or not ASYNC_PV, "kernel v4: build 4 reads packed pages")
        STORE_HALF: gl.constexpr = 0 if ASYNC_PV else 2
        if ASYNC_PV:  # an accumulator in flight across iterations (``o``: its retired value)
            acc = warpgroup_mma_init(acc)
        if CODES:
            if PIPELINE:  # page i's bytes are loaded during page i - 1's output product (one program an SM: nothing
                # else hides their latency)
                page_off, page_ok = page_of(table_row, j_lo, num_pages, PAGE_BYTES, n_tiles > 0)
                if PIPELINE == 2:  # the content words alone (fewer registers held across the output product)
                    raws = _code_words(pages_ptr, page_off, j_lo, ps, pe, page_ok, DC, CBITS, C_CODES_OFF, WARPS,
                                       MADE_UP)
                else:
                    raws, scales, zeros, rw, rs, rz = _code_raws(pages_ptr, page_off, j_lo, ps, pe, page_ok, DC, DR,
                                                                 CBITS, RBITS, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF,
                                                                 C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, WARPS, MADE_UP)
        n_prot = prot[7]
        n_iter = gl.maximum(n_tiles + n_prot, 1)  # the attender's count: an empty split walks one dead page
        for i in range(n_iter):
            slot = i % 2
            mbarrier.wait(kempty.index(slot), ((i // 2) & 1) ^ 1)  # fresh barriers pass parity 1
            if not KEYS:
                pass
            elif QUANT:
                if not PIPELINE:
                    page_off, page_ok = page_of(table_row, j_lo + i, num_pages, PAGE_BYTES, i < n_tiles)
                    raws, scales, zeros, rw, rs, rz = _code_raws(pages_ptr, page_off, j_lo + i, ps, pe, page_ok, DC,
                                                                 DR, CBITS, RBITS, C_CODES_OFF, R_CODES_OFF,
                                                                 C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF,
                                                                 WARPS, MADE_UP)
                if PIPELINE == 2:
                    scales, zeros, rw, rs, rz = _code_params(pages_ptr, page_off, j_lo + i, ps, pe, page_ok, DC, DR,
                                                             RBITS, C_SCALES_OFF, C_ZEROS_OFF, R_CODES_OFF,
                                                             R_SCALES_OFF, R_ZEROS_OFF, WARPS, MADE_UP)
                _store_code_page(raws, scales, zeros, rw, rs, rz, kc.index(slot), kr.index(slot), DC, DR, CBITS,
                                 RBITS, CHANNEL_ORDER, STORE_HALF)
            else:
                page_off, page_ok = page_of(table_row, j_lo + i, num_pages, PAGE_BYTES, i < n_tiles)
                _load_bf16_page(pages_ptr, page_off, j_lo + i, ps, pe, page_ok, kc.index(slot), kr.index(slot), DC,
                                DR, C_CODES_OFF, R_CODES_OFF, not PV_EARLY, WARPS)
                if PV_EARLY:  # the page's copy is in flight during the output product of the page before it
                    if i > 0:
                        acc = _pv_hi(acc, p_s, alpha_s, kc.index(1 - slot), pready, pfree, kempty.index(1 - slot),
                                     i - 1, DC, PV, WARPS)
                    async_copy.wait_group(0)
            if ASYNC_PV:  # the product of page i - 2 reads this slot's high half: retired before it is overwritten
                o = _pv_hi_retire(acc, pfree, i >= 2, WARPS)
                if KEYS:
                    _store_code_page(raws, scales, zeros, rw, rs, rz, kc.index(slot), kr.index(slot), DC, DR, CBITS,
                                     RBITS, CHANNEL_ORDER, 1)
            finish_slot(i, n_tiles, prot, kc.index(slot), kr.index(slot), DC, DR, WARPS, INLINE_PROT, CHANNEL_ORDER)
            mbarrier.arrive(kfull.index(slot))
            if CODES:
                if PIPELINE:
                    page_off, page_ok = page_of(table_row, j_lo + i + 1, num_pages, PAGE_BYTES, i + 1 < n_tiles)
                    if PIPELINE == 2:
                        raws = _code_words(pages_ptr, page_off, j_lo + i + 1, ps, pe, page_ok, DC, CBITS,
                                           C_CODES_OFF, WARPS, MADE_UP)
                    else:
                        raws, scales, zeros, rw, rs, rz = _code_raws(pages_ptr, page_off, j_lo + i + 1, ps, pe,
                                                                     page_ok, DC, DR, CBITS, RBITS, C_CODES_OFF,
                                                                     R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                                                     R_SCALES_OFF, R_ZEROS_OFF, WARPS, MADE_UP)
            if ASYNC_PV:
                if i > 0:
                    acc = _pv_hi_issue(o, p_s, alpha_s, kc.index(1 - slot), pready, i - 1, DC, PV, WARPS)
            elif not PV_EARLY:
                if i > 0:
                    acc = _pv_hi(acc, p_s, alpha_s, kc.index(1 - slot), pready, pfree, kempty.index(1 - slot), i - 1,
                                 DC, PV, WARPS)
        last = n_iter - 1
        if ASYNC_PV:  # the products of the last two pages
            o = _pv_hi_retire(acc, pfree, last >= 1, WARPS)
            o = _pv_hi_retire(_pv_hi_issue(o, p_s, alpha_s, kc.index(last % 2), pready, last, DC, PV, WARPS), pfree,
                              True, WARPS)
            acc = o
        else:
            acc = _pv_hi(acc, p_s, alpha_s, kc.index(last % 2), pready, pfree, kempty.index(last % 2), last, DC, PV,
                         WARPS)

        mbarrier.wait(lfin, 0)
        l_i = l_s.load(gl.SliceLayout(1, o_layout))
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        rows = rb * BLOCK_R + gl.arange(0, BLOCK_R, gl.SliceLayout(1, o_layout))
        cols = DC // 2 + gl.arange(0, DC // 2, gl.SliceLayout(0, o_layout))
        offs = (part + rows[:, None]) * DC + cols[None, :]
        gl.store(o_part_ptr + offs, acc / l_safe[:, None], mask=(rows < R)[:, None])
