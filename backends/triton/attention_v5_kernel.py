"""Split-KV decode attention, kernel v5: few query rows a request, the 64 tokens of a page as the ``wgmma`` M
dimension (warp-specialized Gluon, Hopper sm_90a).

A drop-in for ``attention_v4_kernel.split_kernel_v4`` (same positional arguments and constexpr names, the same
partial outputs, in ``channel_of`` order with ``CHANNEL_ORDER``) for ``BLOCK_R`` = 16 or 32 query rows a program:
grid ``(NSPLIT, B, cdiv(R, BLOCK_R))``. Kernel v4 puts the query rows in the M dimension of its ``wgmma`` (64 rows):
at H = 16 three quarters of its products and softmax work are padding. Here (CuPy kernel v5's design) the products
are transposed so that the rows are N:

* ``S^T [64, BLOCK_R] = K [64, 576] @ Q^T``: 9 ``wgmma`` (A = the key tile, B = the queries, both K-major);
* base-2 online softmax down the columns (one column a query row);
* ``O^T [512, BLOCK_R] = O^T * alpha + K^T [512, 64] @ P^T [64, BLOCK_R]`` (A = the key tile read MN-major).

Partitions, per 64-token page ``i`` of the split, key slot ``s = i % 2``:

* converter (worker, ``LOADER_WARPS`` 4 or 8): holds page ``i``'s bytes in registers (loaded ``AHEAD`` pages
  earlier), waits ``kempty[s]``, writes the page's keys as bfloat16 into ``kc[s]`` / ``kr[s]`` (kernel v4's
  dequantizers: ``attention_v4_loaders``), arrives ``kfull[s]``, issues the loads of page ``i + AHEAD``;
* attender (default partition, 4 warps): waits ``kfull[s]``, issues QK, retires it together with the output
  product of page ``i - 1`` and arrives ``kempty`` of that page's slot, runs the softmax, writes P^T, issues the
  output product of page ``i`` (retired at page ``i + 1``). At the end it writes the partial output and lse.
* ``ATTENDERS`` 2 (16 rows): attender ``w`` (0: the default partition, 1: a 4-warp worker) takes pages ``w, w + 2,
  ...`` on key slot ``w``: waits ``kfull[w]``, QK, softmax, P^T into its own P tile, the output product, retires
  it and arrives ``kempty[w]``. Attender 0 loads the queries and arrives ``qready`` (attender 1 waits for it); at
  the end attender 1 stores its unnormalised output, maximum and sum and arrives ``mdone``, and attender 0 merges
  them into its own before writing the partial. The converter walks an even count of pages.

Barriers (``mbarrier``, parity waits; fresh barriers pass a wait for parity 1): ``kfull[2]``, ``kempty[2]`` (and
with two attenders ``qready``, ``mdone``), one arrival each; every key barrier completes one phase a page. A split
without pages walks one dead page (no table read, every token invisible), as in kernel v4: with a zero-trip path
ptxas serializes the ``wgmma`` (C7515). ``tests/test_triton_v5_protocol.py`` models both schedules.

Shared memory (``BLOCK_R`` 16): kc 128 KB + kr 16 KB + Q 18 KB + P 2 KB and the softmax's reduction scratch; two
attenders add a second P tile and attender 1's sums (32 KB): 203,448 B. Registers: the output accumulator is
``512 * BLOCK_R / 128`` floats a thread (64 at 16 rows, 128 at 32).
"""

from __future__ import annotations

from .attention_v4_loaders import GLUON_IMPORT_ERROR

#: warps of the launch (the attender partition); the converter partition adds ``LOADER_WARPS``
V5_NUM_WARPS = 4

#: the kernel (a Gluon function), None where ``GLUON_IMPORT_ERROR`` says why this triton cannot build it
split_kernel_v5 = None

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    from .attention_v4_kernel import _add, _load_q, _max, _split_range
    from .attention_v4_loaders import (_acc_layout, _code_raws, _load_bf16_page, _partition_barrier,
                                       _store_code_page, finish_slot, page_of, protected_pages, visible_span)

    #: the converter's registers a thread (``setmaxnreg``) with 8 warps, by ``BLOCK_R``: the attender keeps (65,536 -
    #: 256 x this) / 128, 208 at 16 rows and 256 at 32, where its output takes 128 floats a thread (offline sm_90a,
    #: triton 3.7.1: at 152 the 32-row attender spilled 92 bytes; at 128 a converter 2 pages ahead spilled 20)
    LOADER8_REGS = gl.constexpr({16: 152, 32: 128})
    #: ... with 4 warps (8 warps of 232 and 256 fill the register file)
    LOADER4_REGS = gl.constexpr(232)
    #: with two attenders (16 rows), the converter's and attender 1's registers by the converter's warps (attender 0
    #: keeps the rest). The build caps every partition at the launch's 168 (12 warps) or 128 (16 warps) a thread;
    #: offline sm_90a, C4R4 / C2R4, 4 converter warps: 72 / 96 bytes spilled (loop-invariant scalars of the
    #: attenders), 8: 124-132
    LOADER2A_REGS = gl.constexpr({4: 168, 8: 112})
    ATTENDER2_REGS = gl.constexpr({4: 168, 8: 144})

    @gluon.jit
    def pages_each(n_walk, ATTENDERS: gl.constexpr):
        """Pages each of ``ATTENDERS`` attenders takes of a split's ``n_walk`` packed and protected pages: at least
        one (an empty split walks a dead page) and as many as the other (an odd walk of two ends on a dead page)."""
        return gl.maximum((n_walk + ATTENDERS - 1) // ATTENDERS, 1)

    @gluon.jit
    def _qk_issue(kc_s, kr_s, q_s, qr_s, s0, DC: gl.constexpr):
        """``S^T = K Q^T`` of a key slot (``DC / 64 + 1`` asynchronous ``wgmma``, not waited for)."""
        s = warpgroup_mma(kc_s.slice(0, 64, dim=1), q_s.slice(0, 64, dim=1).permute((1, 0)), s0, use_acc=False,
                          is_async=True)
        for c in gl.static_range(1, DC // 64):
            s = warpgroup_mma(kc_s.slice(c * 64, 64, dim=1), q_s.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                              is_async=True)
        return warpgroup_mma(kr_s, qr_s.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _softmax_step(s, i, j, page_ok, ps, pe, n_tiles, L, prot, toks, limit, m_i, l_i, sm_scale_log2,
                      INLINE_PROT: gl.constexpr):
        """Step ``i`` (page ``j``) of the base-2 online softmax down the columns of the scores ``s`` ``[64, R]``:
        (P, alpha, the new maxima and sums)."""
        base, lo, hi = visible_span(i, j, page_ok, ps, pe, n_tiles, L, prot, INLINE_PROT)
        n = base + toks
        vis = ((n >= lo) & (n < hi))[:, None] & (n[:, None] < limit[None, :])
        # the scale (> 0, checked at the API) after the maximum, so that scale and subtraction fuse into one FFMA
        sc = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.reduce(sc, 0, _max) * sm_scale_log2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc * sm_scale_log2 - m_safe[None, :])
        l_i = l_i * alpha + gl.reduce(p, 0, _add)
        return p, alpha, m_new, l_i

    @gluon.jit
    def _pv_issue(p, alpha, o, kc_s, p_s):
        """P^T into ``p_s`` (bfloat16 ``[R, 64]``, K-major), then ``O^T * alpha + K^T P^T`` issued (not waited for)."""
        p_s.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        _partition_barrier()
        return warpgroup_mma(kc_s.permute((1, 0)), p_s.permute((1, 0)), o * alpha[None, :], is_async=True)

    @gluon.jit
    def attender_partition(q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H, S_Q, L,
                           sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC: gl.constexpr, DR: gl.constexpr,
                           PAGE_BYTES: gl.constexpr, BLOCK_R: gl.constexpr, INLINE_PROT: gl.constexpr = False,
                           CHANNEL_ORDER: gl.constexpr = False, WHO: gl.constexpr = 0, ATTENDERS: gl.constexpr = 1,
                           ATTEND: gl.constexpr = True):
        """Attender ``WHO`` of ``ATTENDERS``: ``S^T``, the softmax down its columns and ``O^T`` over all ``DC``
        channels, for every page of the split (one attender) or every other one from page ``WHO`` (two, each on
        key slot ``WHO``). Attender 0 (the default partition) loads the queries and writes the partial output
        (float32 ``[BLOCK_R, DC]`` rows of ``o_part``) and the log2-sum-exp, with attender 1's sums merged in.
        ``ATTEND`` False (a probe build): pages are handed back unread."""
        kc, kr, q_s, qr_s, p_s, o_s, m_s, l_s = bufs
        kfull, kempty, qready, mdone = bars
        lay: gl.constexpr = _acc_layout(BLOCK_R)  # [64 tokens, BLOCK_R] scores and [DC, BLOCK_R] output alike
        col_l: gl.constexpr = gl.SliceLayout(0, lay)  # one value a query row
        tok_l: gl.constexpr = gl.SliceLayout(1, lay)

        if WHO == 0:
            ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
            qrows = rb * BLOCK_R + gl.arange(0, BLOCK_R, gl.SliceLayout(1, ql))
            qcols = gl.arange(0, 64, gl.SliceLayout(0, ql))
            _load_q(q_base, qrows, qrows < R, qcols, q_s, DC, CHANNEL_ORDER, BLOCK_R)
            _load_q(qr_base, qrows, qrows < R, qcols, qr_s, DR, CHANNEL_ORDER, BLOCK_R)
            fence_async_shared()  # every thread's stores, then the warpgroup's barrier, before the wgmma reads them
            _partition_barrier()
            if ATTENDERS == 2:
                mbarrier.arrive(qready)
        else:
            mbarrier.wait(qready, 0)

        rows = rb * BLOCK_R + gl.arange(0, BLOCK_R, col_l)
        limit = L - S_Q + rows // H + 1  # row r (query r // H) sees tokens n < limit
        toks = gl.arange(0, 64, tok_l)
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, col_l)
        l_i = gl.zeros([BLOCK_R], gl.float32, col_l)
        s0 = gl.zeros([64, BLOCK_R], gl.float32, lay)
        p_mine = p_s.index(WHO)
        n_walk = prot[7] + n_tiles
        if not ATTEND:  # a probe build: each page handed back unread
            for k in range(pages_each(n_walk, ATTENDERS)):
                i = ATTENDERS * k + WHO
                mbarrier.wait(kfull.index(i % 2), (i // 2) & 1)
                mbarrier.arrive(kempty.index(i % 2))
            o = gl.zeros([DC, BLOCK_R], gl.float32, lay)
        elif ATTENDERS == 1:
            acc = warpgroup_mma_init(gl.zeros([DC, BLOCK_R], gl.float32, lay))
            for i in range(pages_each(n_walk, 1)):
                slot = i % 2
                j = j_lo + i
                _, page_ok = page_of(table_row, j, num_pages, PAGE_BYTES, i < n_tiles)
                mbarrier.wait(kfull.index(slot), (i // 2) & 1)
                kc_s = kc.index(slot)
                s = _qk_issue(kc_s, kr.index(slot), q_s, qr_s, s0, DC)
                s, o = warpgroup_mma_wait(0, deps=[s, acc])  # also retires the output product of page i - 1
                mbarrier.arrive(kempty.index(1 - slot), pred=i > 0)
                p, alpha, m_i, l_i = _softmax_step(s, i, j, page_ok, ps, pe, n_tiles, L, prot, toks, limit, m_i, l_i,
                                                   sm_scale_log2, INLINE_PROT)
                acc = _pv_issue(p, alpha, o, kc_s, p_mine)
            o = warpgroup_mma_wait(0, deps=[acc])
        else:  # pages WHO, WHO + 2, ...: while one attender runs its softmax, the other's products run
            o = gl.zeros([DC, BLOCK_R], gl.float32, lay)
            for k in range(pages_each(n_walk, 2)):
                i = 2 * k + WHO
                j = j_lo + i
                _, page_ok = page_of(table_row, j, num_pages, PAGE_BYTES, i < n_tiles)
                mbarrier.wait(kfull.index(WHO), k & 1)
                # slot == WHO, through an opaque move: with a constant slot LLVM hoists the descriptors of the 68
                # wgmma out of the loop, where they take registers for the whole walk (offline: 712 bytes spilled)
                slot = gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [i % 2], dtype=gl.int32, is_pure=False,
                                                 pack=1)
                kc_s = kc.index(slot)
                s = _qk_issue(kc_s, kr.index(slot), q_s, qr_s, s0, DC)
                s = warpgroup_mma_wait(0, deps=[s])
                p, alpha, m_i, l_i = _softmax_step(s, i, j, page_ok, ps, pe, n_tiles, L, prot, toks, limit, m_i, l_i,
                                                   sm_scale_log2, INLINE_PROT)
                acc = _pv_issue(p, alpha, o, kc_s, p_mine)
                o = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(kempty.index(WHO))  # the slot's next page: two pages on
        if ATTENDERS == 2:
            if WHO == 1:  # the unnormalised sums handed to attender 0
                o_s.store(o)
                m_s.store(m_i)
                l_s.store(l_i)
                _partition_barrier()
                mbarrier.arrive(mdone)
            else:
                mbarrier.wait(mdone, 0)
                m1 = m_s.load(col_l)
                m_new = gl.maximum(m_i, m1)
                m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
                a0 = gl.exp2(m_i - m_safe)
                a1 = gl.exp2(m1 - m_safe)
                l_i = l_i * a0 + l_s.load(col_l) * a1
                m_i = m_new
                o = o * a0[None, :] + o_s.load(lay) * a1[None, :]
        if WHO == 0:
            l_safe = gl.where(l_i > 0.0, l_i, 1.0)
            chans = gl.arange(0, DC, tok_l)
            gl.store(o_part_ptr + (part + rows[None, :]) * DC + chans[:, None], o / l_safe[None, :],
                     mask=(rows < R)[None, :])
            lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(lse_part_ptr + part + rows, lse2, mask=rows < R)

    @gluon.jit
    def _page_bytes(pages_ptr, table_row, num_pages, j, live, ps, pe, DC: gl.constexpr, DR: gl.constexpr,
                    CBITS: gl.constexpr, RBITS: gl.constexpr, PAGE_BYTES: gl.constexpr, C_CODES_OFF: gl.constexpr,
                    R_CODES_OFF: gl.constexpr, C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr,
                    R_SCALES_OFF: gl.constexpr, R_ZEROS_OFF: gl.constexpr, WARPS: gl.constexpr):
        """Packed page ``j``'s bytes (``attention_v4_loaders._code_raws``; ``live`` False: no table read, zeros)."""
        page_off, page_ok = page_of(table_row, j, num_pages, PAGE_BYTES, live)
        return _code_raws(pages_ptr, page_off, j, ps, pe, page_ok, DC, DR, CBITS, RBITS, C_CODES_OFF, R_CODES_OFF,
                          C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, WARPS)

    @gluon.jit
    def converter_partition(pages_ptr, table_row, num_pages, ps, pe, j_lo, n_tiles, bufs, bars, prot,
                            QUANT: gl.constexpr, DC: gl.constexpr, DR: gl.constexpr, CBITS: gl.constexpr,
                            RBITS: gl.constexpr, PAGE_BYTES: gl.constexpr, C_CODES_OFF: gl.constexpr,
                            R_CODES_OFF: gl.constexpr, C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr,
                            R_SCALES_OFF: gl.constexpr, R_ZEROS_OFF: gl.constexpr, WARPS: gl.constexpr = 8,
                            AHEAD: gl.constexpr = 1, INLINE_PROT: gl.constexpr = False,
                            CHANNEL_ORDER: gl.constexpr = False, ATTENDERS: gl.constexpr = 1,
                            KEYS: gl.constexpr = True):
        """Worker partition: fills key slot ``i % 2`` with page ``j_lo + i`` as bfloat16 once the attender's output
        product of page ``i - 2`` freed it. Packed pages: each page's bytes are loaded ``AHEAD`` (1 or 2) pages before
        its turn, into registers. BF16 pages: copied (``cp.async``) when the slot is free. ``INLINE_PROT``: after its
        ``n_tiles`` pages the split walks ``prot``'s protected pages (0 but on the last split). Two ``ATTENDERS``
        take an even count of pages (a dead one after an odd walk). ``KEYS`` False (a probe build): the slots are
        handed over unwritten."""
        kc, kr = bufs[0], bufs[1]
        kfull, kempty = bars[0], bars[1]
        n_prot = prot[7]
        n_walk = ATTENDERS * pages_each(n_tiles + n_prot, ATTENDERS)  # the attenders' pages together
        gl.static_assert(AHEAD == 1 or AHEAD == 2, "kernel v5: page bytes 1 or 2 pages ahead")
        if not KEYS:
            for i in range(n_walk):
                mbarrier.wait(kempty.index(i % 2), ((i // 2) & 1) ^ 1)
                mbarrier.arrive(kfull.index(i % 2))
        else:
            if QUANT:
                cur = _page_bytes(pages_ptr, table_row, num_pages, j_lo, n_tiles > 0, ps, pe, DC, DR, CBITS, RBITS,
                                  PAGE_BYTES, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF,
                                  R_ZEROS_OFF, WARPS)
                if AHEAD == 2:
                    nxt = _page_bytes(pages_ptr, table_row, num_pages, j_lo + 1, n_tiles > 1, ps, pe, DC, DR, CBITS,
                                      RBITS, PAGE_BYTES, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                      R_SCALES_OFF, R_ZEROS_OFF, WARPS)
            for i in range(n_walk):
                slot = i % 2
                mbarrier.wait(kempty.index(slot), ((i // 2) & 1) ^ 1)  # fresh barriers pass parity 1
                if QUANT:
                    raws, scales, zeros, rw, rs, rz = cur
                    _store_code_page(raws, scales, zeros, rw, rs, rz, kc.index(slot), kr.index(slot), DC, DR, CBITS,
                                     RBITS, CHANNEL_ORDER)
                else:
                    page_off, page_ok = page_of(table_row, j_lo + i, num_pages, PAGE_BYTES, i < n_tiles)
                    _load_bf16_page(pages_ptr, page_off, j_lo + i, ps, pe, page_ok, kc.index(slot), kr.index(slot), DC,
                                    DR, C_CODES_OFF, R_CODES_OFF, True, WARPS)
                finish_slot(i, n_tiles, prot, kc.index(slot), kr.index(slot), DC, DR, WARPS, INLINE_PROT, CHANNEL_ORDER)
                mbarrier.arrive(kfull.index(slot))
                if QUANT:
                    k = i + AHEAD
                    later = _page_bytes(pages_ptr, table_row, num_pages, j_lo + k, k < n_tiles, ps, pe, DC, DR, CBITS,
                                        RBITS, PAGE_BYTES, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                        R_SCALES_OFF, R_ZEROS_OFF, WARPS)
                    if AHEAD == 2:
                        cur = nxt
                        nxt = later
                    else:
                        cur = later

    @gluon.jit
    def split_kernel_v5(
        q_ptr,  # [B, R, DC] bfloat16, contiguous
        qr_ptr,  # [B, R, DR]
        pages_ptr,  # uint8 [num_pages, PAGE_BYTES]
        table_ptr,  # int32 [B, max_pages]
        lens_ptr,  # [B] int
        o_part_ptr,  # float32 [B, NSPLIT, R, DC] (columns in channel_of order with CHANNEL_ORDER)
        lse_part_ptr,  # float32 [B, NSPLIT, R] (log2 units)
        stride_table,
        num_pages,
        sm_scale_log2,
        R,
        H,
        S_Q,
        SINK,
        LOCAL,
        NSPLIT,
        Q_BF16: gl.constexpr,
        DOT_BF16: gl.constexpr,
        QUANT: gl.constexpr,
        DC: gl.constexpr,
        DR: gl.constexpr,
        CBITS: gl.constexpr,
        RBITS: gl.constexpr,
        CG: gl.constexpr,
        RG: gl.constexpr,
        CCW: gl.constexpr,
        RCW: gl.constexpr,
        P: gl.constexpr,
        PAGE_BYTES: gl.constexpr,
        C_CODES_OFF: gl.constexpr,
        R_CODES_OFF: gl.constexpr,
        C_SCALES_OFF: gl.constexpr,
        C_ZEROS_OFF: gl.constexpr,
        R_SCALES_OFF: gl.constexpr,
        R_ZEROS_OFF: gl.constexpr,
        C_SCALE_BF16: gl.constexpr,
        R_SCALE_BF16: gl.constexpr,
        CBIAS: gl.constexpr,
        RBIAS: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_R: gl.constexpr,
        PREFETCH: gl.constexpr = False,
        PROBE_SKIP_PV: gl.constexpr = False,
        PDL: gl.constexpr = False,
        WORDS: gl.constexpr = 0,
        WORD_LANES: gl.constexpr = 1,
        TILE_GROUPS: gl.constexpr = False,
        LOADER_REGS: gl.constexpr = 0,
        LOADER_WARPS: gl.constexpr = 8,
        AHEAD: gl.constexpr = 1,
        INLINE_PROT: gl.constexpr = False,
        CHANNEL_ORDER: gl.constexpr = False,
        ATTENDERS: gl.constexpr = 1,
        PROBE: gl.constexpr = 0,
        sink_ptr=None,  # [max_seqs, SINK, DC + DR] bfloat16 (INLINE_PROT)
        local_ptr=None,  # [max_seqs, LOCAL, DC + DR] bfloat16, a ring by position
        ids_ptr=None,  # [B] int: each request's slot in them
        max_seqs=1,
    ):
        """One (split, request, block of ``BLOCK_R`` query rows): the partial normalised output
        ``o_part[b, split, rows]`` (float32 ``[BLOCK_R, DC]``) and log2-sum-exp ``lse_part[b, split, rows]`` over the
        split's tokens, as ``split_kernel_v4``. v3's code-path switches are accepted and ignored. ``LOADER_WARPS``
        (4 or 8): the converter's warps; ``LOADER_REGS``: their registers after ``setmaxnreg`` (0:
        :data:`LOADER8_REGS` by ``BLOCK_R``, or :data:`LOADER4_REGS`). ``AHEAD``: pages between a page's loads and its
        conversion.
        ``INLINE_PROT``, ``CHANNEL_ORDER``: as kernel v4's. ``ATTENDERS`` 2 (16 rows): two attending warpgroups
        take every other page, each on its own key slot. ``PROBE`` (measurement builds, wrong outputs): 1 hands the
        key slots over unwritten (no page loaded or converted), 2 hands them back unread (no products, no softmax)."""
        gl.static_assert(BLOCK_R == 16 or BLOCK_R == 32, "kernel v5: 16 or 32 query rows a program")
        gl.static_assert(P == 64 and BLOCK_N % 64 == 0, "kernel v5: 64-token pages")
        gl.static_assert(DC == 512 and DR == 64, "kernel v5: d_c 512, d_r 64")
        gl.static_assert(not QUANT or ((CBITS == 4 or CBITS == 2) and RBITS == 4), "kernel v5: C4R4, C2R4, BF16")
        gl.static_assert(not QUANT or (CG == 64 and RG == DR), "kernel v5: groups of 64 channels, one RoPE group")
        gl.static_assert(not QUANT or (C_SCALE_BF16 and not R_SCALE_BF16),
                         "kernel v5: bfloat16 content and float32 RoPE scales")
        gl.static_assert(QUANT or not CHANNEL_ORDER, "kernel v5: the channel order is packed pages' alone")
        gl.static_assert(LOADER_WARPS == 4 or LOADER_WARPS == 8, "kernel v5: a converter of 4 or 8 warps")
        gl.static_assert(ATTENDERS == 1 or (ATTENDERS == 2 and BLOCK_R == 16), "kernel v5: 2 attenders at 16 rows")
        gl.static_assert(PROBE >= 0 and PROBE <= 2, "kernel v5: probe builds 1 and 2")
        pid_s = gl.program_id(0)
        b = gl.program_id(1)
        rb = gl.program_id(2)
        L = gl.load(lens_ptr + b).to(gl.int32)
        ps, pe, j_lo, n_tiles = _split_range(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)
        table_row = table_ptr + b.to(gl.int64) * stride_table
        part = (b.to(gl.int64) * NSPLIT + pid_s) * R

        kl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DC], gl.bfloat16)
        rl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16)
        ql: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, DC], gl.bfloat16)
        qrl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], gl.bfloat16)
        pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, 64], gl.bfloat16)
        kc = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DC], kl)
        kr = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DR], rl)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, DC], ql)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, DR], qrl)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [ATTENDERS, BLOCK_R, 64], pl)
        kfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(kfull.index(s), count=1)
            mbarrier.init(kempty.index(s), count=1)
        if ATTENDERS == 2:  # attender 1's unnormalised output and (max, sum) for attender 0's merge
            o_s = gl.allocate_shared_memory(gl.float32, [DC, BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            m_s = gl.allocate_shared_memory(gl.float32, [BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            handoff = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())  # queries ready, merge
            for s in gl.static_range(2):
                mbarrier.init(handoff.index(s), count=1)
            qready = handoff.index(0)
            mdone = handoff.index(1)
        else:  # unused
            o_s = p_s
            m_s = p_s
            l_s = p_s
            qready = kfull.index(0)
            mdone = kfull.index(0)

        if INLINE_PROT:  # the last split also attends to the request's protected tokens (no protected-tile kernel)
            seq = gl.load(ids_ptr + b).to(gl.int64)
            seq_ok = (seq >= 0) & (seq < max_seqs)
            seq = gl.where(seq_ok, seq, 0)
            n_prot = gl.where(pid_s == NSPLIT - 1, protected_pages(SINK, LOCAL), 0)
            prot = (sink_ptr, local_ptr, seq, seq_ok, L, SINK, LOCAL, n_prot)
        else:
            prot = (pages_ptr, pages_ptr, 0, False, L, SINK, LOCAL, 0)
        bufs = (kc, kr, q_s, qr_s, p_s, o_s, m_s, l_s)
        bars = (kfull, kempty, qready, mdone)
        if LOADER_REGS == 0 and ATTENDERS == 2:
            REGS: gl.constexpr = LOADER2A_REGS[LOADER_WARPS]
        elif LOADER_REGS == 0 and LOADER_WARPS == 8:
            REGS: gl.constexpr = LOADER8_REGS[BLOCK_R]
        elif LOADER_REGS == 0:
            REGS: gl.constexpr = LOADER4_REGS
        else:
            REGS: gl.constexpr = LOADER_REGS
        q_base = q_ptr + b.to(gl.int64) * R * DC
        qr_base = qr_ptr + b.to(gl.int64) * R * DR
        # the argument lists are spelled out in each call: a tuple held in a variable loses its constexprs here
        if ATTENDERS == 1:
            gl.warp_specialize([
                (attender_partition, (q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H,
                                      S_Q, L, sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC, DR,
                                      PAGE_BYTES, BLOCK_R, INLINE_PROT, CHANNEL_ORDER, 0, 1, PROBE != 2)),
                (converter_partition, (pages_ptr, table_row, num_pages, ps, pe, j_lo, n_tiles, bufs, bars, prot, QUANT,
                                       DC, DR, CBITS, RBITS, PAGE_BYTES, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF,
                                       C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, LOADER_WARPS, AHEAD, INLINE_PROT,
                                       CHANNEL_ORDER, 1, PROBE != 1)),
            ], [LOADER_WARPS], [REGS])
        else:
            gl.warp_specialize([
                (attender_partition, (q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H,
                                      S_Q, L, sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC, DR,
                                      PAGE_BYTES, BLOCK_R, INLINE_PROT, CHANNEL_ORDER, 0, 2, PROBE != 2)),
                (attender_partition, (q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H,
                                      S_Q, L, sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC, DR,
                                      PAGE_BYTES, BLOCK_R, INLINE_PROT, CHANNEL_ORDER, 1, 2, PROBE != 2)),
                (converter_partition, (pages_ptr, table_row, num_pages, ps, pe, j_lo, n_tiles, bufs, bars, prot, QUANT,
                                       DC, DR, CBITS, RBITS, PAGE_BYTES, C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF,
                                       C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, LOADER_WARPS, AHEAD, INLINE_PROT,
                                       CHANNEL_ORDER, 2, PROBE != 1)),
            ], [4, LOADER_WARPS], [ATTENDER2_REGS[LOADER_WARPS], REGS])
