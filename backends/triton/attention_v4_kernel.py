"""Split-KV decode attention, kernel v4: kernel v3's partials from a warp-specialized Gluon kernel (Hopper, sm_90a).

A drop-in for ``attention_v3_kernel.split_kernel_v3`` (same positional arguments and constexpr names, grid
``(NSPLIT, B, cdiv(R, 64))``, the same partial outputs, in ``channel_of`` order with ``CHANNEL_ORDER``, as the merge
kernel's ``CHANNEL_ORDER`` reads them) for bfloat16 queries, d_c 512, d_r 64, 64-token pages,
formats BF16, C4R4 and C2R4. Launch with ``num_warps=V4_NUM_WARPS`` (4: the attender); the loader's 4 or 8 warps
(``LOADER_WARPS``) come on top. Gluon has no interpreter: the module imports on any triton, and ``split_kernel_v4``
exists only where ``GLUON_IMPORT_ERROR`` is None (else it is None).

One program = 64 query rows of one request, two partitions (the attender, one warpgroup; the loader, one warpgroup
or two that share its work), per 64-token page ``i`` of the split (``split_tiles``' 128-token tiles walked as two
pages), key slot ``s = i % 2``:

* loader (worker, ``attention_v4_loaders``): waits ``kempty[s]``, writes the page's keys as bfloat16 into
  ``kc[s]`` ``[64, 512]`` / ``kr[s]`` ``[64, 64]``, arrives ``kfull[s]``; then, for page ``i - 1``: waits
  ``pready``, ``acc_hi = acc_hi * alpha + P @ K[:, 256:]`` (retired), arrives ``pfree`` and ``kempty``.
* attender (default partition, here): Q ``[64, 512 + 64]`` in shared memory once; waits ``kfull[s]``;
  ``S = Q K^T`` (9 async ``warpgroup_mma``, m64n64, K = 64 each), retired together with its own output product of
  page ``i - 1`` (then arrives ``kempty`` for it); mask, base-2 online softmax; waits ``pfree``, writes P
  (bfloat16 ``[64, 64]``) and alpha, arrives ``pready``; ``acc_lo = acc_lo * alpha + P @ K[:, :256]`` (async,
  retired at the next page's QK). At the end it publishes ``l`` (``lfin``) for the loader's half of the output.

That order is builds 0 and 3 (``PIPELINE``, chosen per format by ``heuristics.V4_PIPELINE``, which says what each
build changes); builds 1, 2 and 4 retire the attender's product of page ``i - 1`` and arrive its ``kempty`` before
QK(i). Build 4 (packed pages) leaves the loader's product in flight: ``kempty`` takes the attender's arrival alone,
and the loader retires its product of page ``i - 2`` between converting page ``i``'s low and high channels. A split
without pages walks one dead page (no table read, every token invisible): without a zero-trip path ptxas keeps
the wgmmas pipelined.

Barriers (``mbarrier``, parity waits; fresh barriers pass a wait for parity 1): ``kfull[2]`` (1 arrival),
``kempty[2]`` (2: one per output half; build 4: 1), ``pready``, ``pfree``, ``lfin`` (1 each). Every barrier
completes one phase a page, and no side can run two phases ahead of the other: the attender's P of page ``i`` needs
``pfree`` of ``i - 1``; the loader's refill of slot ``s`` needs both products of page ``i - 2``.

Shared memory: kc 128 KB + kr 16 KB + Q 72 KB + P 8 KB + alpha and l 512 B = 229,888 B; with the barriers and the
scalars the partitions capture, 230,172 B of the 232,448 a block may take (offline sm_90a, triton 3.6 and 3.7).
"""

from __future__ import annotations

from .attention_v4_loaders import GLUON_IMPORT_ERROR

#: warps of the launch (the attender partition); the loader partition adds 4
V4_NUM_WARPS = 4

#: the kernel (a Gluon function), None where ``GLUON_IMPORT_ERROR`` says why this triton cannot build it
split_kernel_v4 = None

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    from .attention_v4_loaders import (_acc_layout, loader_partition, page_of, protected_pages, to_channel_order,
                                       visible_span)

    #: registers of each loader thread (``setmaxnreg``) with 8 loader warps: the attender keeps (65,536 - 256 x this)
    #: / 128
    LOADER8_REGS = gl.constexpr(136)

    # row reductions through gl.reduce: triton 3.6's gl.max / gl.sum wrap triton.language functions, which cannot
    # be built while TRITON_INTERPRET=1 (the test session's setting)
    @gluon.jit
    def _max(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _add(a, b):
        return a + b

    @gluon.jit
    def _split_range(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N: gl.constexpr):
        """``attention_kernel.split_tiles``: the packed token range ``[ps, pe)`` and split ``pid_s``'s tiles
        ``[t_lo, t_hi)`` of BLOCK_N tokens, as the 64-token pages ``[j_lo, j_lo + n_tiles)`` that hold visible
        tokens."""
        ps = gl.minimum(SINK, L)
        pe = gl.maximum(L - LOCAL, ps)
        tb0 = ps // BLOCK_N
        tb1 = (pe + BLOCK_N - 1) // BLOCK_N
        per = (tb1 - tb0 + NSPLIT - 1) // NSPLIT
        t_lo = tb0 + pid_s * per
        t_hi = gl.minimum(t_lo + per, tb1)
        PER_TILE: gl.constexpr = BLOCK_N // 64
        j_lo = gl.maximum(t_lo * PER_TILE, ps // 64)
        j_hi = gl.minimum(t_hi * PER_TILE, (pe + 63) // 64)
        return ps, pe, j_lo, gl.maximum(j_hi - j_lo, 0)

    @gluon.jit
    def _load_q(q_base, rows, row_ok, cols, q_s, D: gl.constexpr, CHANNEL_ORDER: gl.constexpr = False,
                N: gl.constexpr = 64):
        """Query rows ``[N, D]`` (0 past R) as bfloat16 into ``q_s``, 64 channels at a time (``CHANNEL_ORDER``: in
        the packed key tiles' channel order, ``channel_of``)."""
        for c in gl.static_range(D // 64):
            x = gl.load(q_base + rows[:, None] * D + (c * 64 + cols)[None, :], mask=row_ok[:, None], other=0.0)
            if CHANNEL_ORDER:
                x = to_channel_order(x, N, 64)
            q_s.slice(c * 64, 64, dim=1).store(x.to(gl.bfloat16))

    @gluon.jit
    def attender_partition(q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H, S_Q, L,
                           sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC: gl.constexpr, DR: gl.constexpr,
                           PAGE_BYTES: gl.constexpr, BLOCK_R: gl.constexpr, PIPELINE: gl.constexpr = 0,
                           INLINE_PROT: gl.constexpr = False, CHANNEL_ORDER: gl.constexpr = False):
        """Default partition: scores, softmax and the output product over channels ``[0, DC/2)``; writes those
        channels of the partial output and the log2-sum-exp. ``CHANNEL_ORDER``: the key tiles hold channels in
        ``channel_of`` order, so the queries are loaded through it and the output columns stay in it."""
        kc, kr, q_s, qr_s, p_s, alpha_s, l_s = bufs
        kfull, kempty, pready, pfree, lfin = bars
        s_layout: gl.constexpr = _acc_layout(64)
        o_layout: gl.constexpr = _acc_layout(DC // 2)
        row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_row_l: gl.constexpr = gl.SliceLayout(1, o_layout)

        ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qrows = rb * BLOCK_R + gl.arange(0, BLOCK_R, gl.SliceLayout(1, ql))
        qcols = gl.arange(0, 64, gl.SliceLayout(0, ql))
        _load_q(q_base, qrows, qrows < R, qcols, q_s, DC, CHANNEL_ORDER)
        _load_q(qr_base, qrows, qrows < R, qcols, qr_s, DR, CHANNEL_ORDER)
        fence_async_shared()

        rows = rb * BLOCK_R + gl.arange(0, BLOCK_R, row_l)
        limit = L - S_Q + rows // H + 1  # row r (query r // H) sees tokens n < limit
        toks = gl.arange(0, 64, gl.SliceLayout(0, s_layout))
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, row_l)
        l_i = gl.zeros([BLOCK_R], gl.float32, row_l)
        acc = warpgroup_mma_init(gl.zeros([BLOCK_R, DC // 2], gl.float32, o_layout))
        s0 = gl.zeros([BLOCK_R, 64], gl.float32, s_layout)
        # builds 1, 2 and 4 retire the product of page i - 1 before QK(i); builds 0 and 3 beside it
        EARLY: gl.constexpr = PIPELINE != 0 and PIPELINE != 3
        n_prot = prot[7]
        for i in range(gl.maximum(n_tiles + n_prot, 1)):  # see split_kernel_v4: an empty split attends to one dead page
            slot = i % 2
            j = j_lo + i
            _, page_ok = page_of(table_row, j, num_pages, PAGE_BYTES, i < n_tiles)
            if EARLY:  # retire the product of page i - 1 before this page's QK: its key slot goes back to the
                # loader now, not after QK (the loader's next page waits for it), and no wgmma is issued beside an
                # unretired one
                o = warpgroup_mma_wait(0, deps=[acc])
                mbarrier.arrive(kempty.index(1 - slot), pred=i > 0)
            mbarrier.wait(kfull.index(slot), (i // 2) & 1)
            kc_s = kc.index(slot)
            s = warpgroup_mma(q_s.slice(0, 64, dim=1), kc_s.slice(0, 64, dim=1).permute((1, 0)), s0,
                              use_acc=False, is_async=True)
            for c in gl.static_range(1, DC // 64):
                s = warpgroup_mma(q_s.slice(c * 64, 64, dim=1), kc_s.slice(c * 64, 64, dim=1).permute((1, 0)), s,
                                  is_async=True)
            s = warpgroup_mma(qr_s, kr.index(slot).permute((1, 0)), s, is_async=True)
            if EARLY:
                s = warpgroup_mma_wait(0, deps=[s])
            else:
                s, o = warpgroup_mma_wait(0, deps=[s, acc])  # also retires the product of page i - 1
                mbarrier.arrive(kempty.index(1 - slot), pred=i > 0)

            # slot t holds position base + t, visible where lo <= base + t < hi (scalars: no per-token work)
            base, lo, hi = visible_span(i, j, page_ok, ps, pe, n_tiles, L, prot, INLINE_PROT)
            n = base + toks
            vis = ((n >= lo) & (n < hi))[None, :] & (n[None, :] < limit[:, None])
            # the scale (> 0, checked at the API) after the maximum, so that scale and subtraction fuse into one FFMA
            sc = gl.where(vis, s, float("-inf"))
            m_new = gl.maximum(m_i, gl.reduce(sc, 1, _max) * sm_scale_log2)
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m_i - m_safe)
            p = gl.exp2(sc * sm_scale_log2 - m_safe[:, None])
            l_i = l_i * alpha + gl.reduce(p, 1, _add)
            m_i = m_new

            mbarrier.wait(pfree, (i & 1) ^ 1)  # the loader's product of page i - 1 is done with P and alpha
            p_s.store(p.to(gl.bfloat16))
            alpha_s.store(alpha)
            fence_async_shared()
            mbarrier.arrive(pready)
            o = o * gl.convert_layout(alpha, o_row_l, assert_trivial=True)[:, None]
            acc = warpgroup_mma(p_s, kc_s.slice(0, DC // 2, dim=1), o, is_async=True)

        l_s.store(l_i)
        mbarrier.arrive(lfin)
        o = warpgroup_mma_wait(0, deps=[acc])
        l_o = gl.convert_layout(l_i, o_row_l, assert_trivial=True)
        l_safe = gl.where(l_o > 0.0, l_o, 1.0)
        orows = rb * BLOCK_R + gl.arange(0, BLOCK_R, o_row_l)
        cols = gl.arange(0, DC // 2, gl.SliceLayout(0, o_layout))
        gl.store(o_part_ptr + (part + orows[:, None]) * DC + cols[None, :], o / l_safe[:, None],
                 mask=(orows < R)[:, None])
        lse2 = gl.where(l_i > 0.0, m_i + gl.log2(gl.where(l_i > 0.0, l_i, 1.0)), float("-inf"))
        gl.store(lse_part_ptr + part + rows, lse2, mask=rows < R)

    @gluon.jit
    def split_kernel_v4(
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
        PIPELINE: gl.constexpr = 0,
        PROBE: gl.constexpr = 0,
        LOADER_WARPS: gl.constexpr = 4,
        INLINE_PROT: gl.constexpr = False,
        CHANNEL_ORDER: gl.constexpr = False,
        sink_ptr=None,  # [max_seqs, SINK, DC + DR] bfloat16 (INLINE_PROT)
        local_ptr=None,  # [max_seqs, LOCAL, DC + DR] bfloat16, a ring by position
        ids_ptr=None,  # [B] int: each request's slot in them
        max_seqs=1,
    ):
        """One (split, request, block of 64 query rows): the partial normalised output ``o_part[b, split, rows]``
        (float32 ``[64, DC]``) and log2-sum-exp ``lse_part[b, split, rows]`` over the split's packed tokens, as
        ``split_kernel_v3``. v3's code-path switches (``DOT_BF16``, ``CCW``, ``WORDS``, ...) are accepted and
        ignored; ``PROBE_SKIP_PV`` and ``PDL`` are not implemented. ``LOADER_REGS``: the loader's registers after
        ``setmaxnreg`` (0: 232 for BF16 pages; packed ones keep 256, as the attender does: 4 + 4 warps of 256 fill the
        64K-register file, and the packed loader holds the next page's bytes beside the dequantization). ``PIPELINE``:
        the build (``heuristics.V4_PIPELINE``). ``PROBE`` (measurement builds, wrong outputs; ``loader_partition``):
        the loader skips the keys (bit 0) and / or its output product (bit 1). ``LOADER_WARPS`` (4 or 8,
        ``heuristics.V4_LOADER_WARPS``): the loader's warps; with 8 its threads keep ``LOADER8_REGS`` registers.
        ``CHANNEL_ORDER`` (packed pages, ``heuristics.v4_channel_order``): key tiles in ``channel_of`` order, which
        spares the loader's byte permutes a page; queries and protected rows are rearranged to match, and the partial
        output keeps the order for the merge kernel's ``CHANNEL_ORDER``."""
        gl.static_assert(BLOCK_R == 64, "kernel v4: 64 query rows a program")
        gl.static_assert(P == 64 and BLOCK_N % 64 == 0, "kernel v4: 64-token pages")
        gl.static_assert(DC == 512 and DR == 64, "kernel v4: d_c 512, d_r 64")
        gl.static_assert(not QUANT or ((CBITS == 4 or CBITS == 2) and RBITS == 4), "kernel v4: C4R4, C2R4, BF16")
        gl.static_assert(not QUANT or (CG == 64 and RG == DR), "kernel v4: groups of 64 channels, one RoPE group")
        gl.static_assert(not QUANT or (C_SCALE_BF16 and not R_SCALE_BF16),
                         "kernel v4: bfloat16 content and float32 RoPE scales")
        gl.static_assert(QUANT or not CHANNEL_ORDER, "kernel v4: the channel order is packed pages' alone")
        if PIPELINE:  # v3's grid (NSPLIT, B, row blocks) taken in launch order with the row blocks fastest: the
            # programs reading the same pages (one per row block) start together, so the second read hits L2
            n_rb = gl.num_programs(2)
            lin = gl.program_id(0) + NSPLIT * (gl.program_id(1) + gl.num_programs(1) * gl.program_id(2))
            rb = lin % n_rb
            pid_s = (lin // n_rb) % NSPLIT
            b = lin // (n_rb * NSPLIT)
        else:
            pid_s = gl.program_id(0)
            b = gl.program_id(1)
            rb = gl.program_id(2)
        L = gl.load(lens_ptr + b).to(gl.int32)
        # Both partitions walk at least one page: a split without pages takes one dead page (no table read, every
        # token invisible, keys 0). With a zero-trip path the attender's output accumulator would reach its last
        # wgmma wait from plain register moves, and ptxas then serializes every wgmma of the kernel (C7515).
        ps, pe, j_lo, n_tiles = _split_range(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)
        table_row = table_ptr + b.to(gl.int64) * stride_table
        part = (b.to(gl.int64) * NSPLIT + pid_s) * R

        kl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DC], gl.bfloat16)
        rl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DR], gl.bfloat16)
        pl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, 64], gl.bfloat16)
        vl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        kc = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DC], kl)
        kr = gl.allocate_shared_memory(gl.bfloat16, [2, 64, DR], rl)
        q_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, DC], kl)
        qr_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, DR], rl)
        p_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_R, 64], pl)
        alpha_s = gl.allocate_shared_memory(gl.float32, [BLOCK_R], vl)
        l_s = gl.allocate_shared_memory(gl.float32, [BLOCK_R], vl)
        kfull = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        kempty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        pready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        pfree = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        lfin = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for s in gl.static_range(2):
            mbarrier.init(kfull.index(s), count=1)
            mbarrier.init(kempty.index(s), count=1 if PIPELINE == 4 else 2)  # build 4: the attender's arrival alone
        mbarrier.init(pready, count=1)
        mbarrier.init(pfree, count=1)
        mbarrier.init(lfin, count=1)

        if INLINE_PROT:  # the last split also attends to the request's protected tokens (no protected-tile kernel)
            seq = gl.load(ids_ptr + b).to(gl.int64)
            seq_ok = (seq >= 0) & (seq < max_seqs)
            seq = gl.where(seq_ok, seq, 0)
            n_prot = gl.where(pid_s == NSPLIT - 1, protected_pages(SINK, LOCAL), 0)
            prot = (sink_ptr, local_ptr, seq, seq_ok, L, SINK, LOCAL, n_prot)
        else:
            prot = (pages_ptr, pages_ptr, 0, False, L, SINK, LOCAL, 0)
        bufs = (kc, kr, q_s, qr_s, p_s, alpha_s, l_s)
        bars = (kfull, kempty, pready, pfree, lfin)
        gl.static_assert(LOADER_WARPS == 4 or LOADER_WARPS == 8, "kernel v4: a loader of 4 or 8 warps")
        if LOADER_REGS == 0 and LOADER_WARPS == 8:
            REGS: gl.constexpr = LOADER8_REGS
        elif LOADER_REGS == 0:
            if QUANT:
                REGS: gl.constexpr = 256 if PIPELINE else 248
            else:
                REGS: gl.constexpr = 232
        else:
            REGS: gl.constexpr = LOADER_REGS
        q_base = q_ptr + b.to(gl.int64) * R * DC
        qr_base = qr_ptr + b.to(gl.int64) * R * DR
        gl.warp_specialize([
            (attender_partition, (q_base, qr_base, table_row, num_pages, o_part_ptr, lse_part_ptr, part, rb, R, H, S_Q,
                                  L, sm_scale_log2, ps, pe, j_lo, n_tiles, bufs, bars, prot, DC, DR, PAGE_BYTES,
                                  BLOCK_R, PIPELINE, INLINE_PROT, CHANNEL_ORDER)),
            (loader_partition, (pages_ptr, table_row, num_pages, o_part_ptr, part, rb, R, ps, pe, j_lo, n_tiles, bufs,
                                bars, prot, QUANT, DC, DR, CBITS, RBITS, P, PAGE_BYTES, C_CODES_OFF, R_CODES_OFF,
                                C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, BLOCK_R, PIPELINE, PROBE,
                                LOADER_WARPS, INLINE_PROT, CHANNEL_ORDER)),
        ], [LOADER_WARPS], [REGS])
