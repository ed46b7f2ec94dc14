"""Split-KV decode attention, kernel v6: kernel v5's transposed products (a page's 64 tokens as the ``wgmma`` M, 16
query rows as N) with QK's key operand dequantized straight into registers, no warp specialization, two programs an
SM (CuPy kernel v5's two workers; Gluon, Hopper sm_90a).

A drop-in for ``split_kernel_v5`` (same positional arguments, constexpr names and partial outputs) at 16 query rows a
program, over C4R4 / C2R4 pages with d_c 512, d_r 64; the partial output is in plain channel order (``CHANNEL_ORDER``
False). The protected tokens are left to the protected-tile kernel, or with ``INLINE_PROT`` walked by the last split
after its packed pages: their bfloat16 rows loaded in the channel order below and moved into QK's A operand through
shared memory (``heuristics.V6_INLINE_PROTECT`` says why that is off by default).

Why: kernel v5 moves each key tile through shared memory three times a page (the converter's 72 KB of stores, QK's
72 KB of A reads at N = 16, PV's 64 KB), ~208 KB a page against CuPy v5's 128 KB, and its converter and attender take
turns. Here one warpgroup converts each 64-channel plane of a page in registers, issues that plane's QK ``wgmma``
with A from those registers, and stores the plane into the one key tile for PV; two programs an SM overlap one's
conversion with the other's products.

Per page ``i`` of the split (its bytes loaded at its start, ``AHEAD`` 0, a page earlier, 1, or two 64-byte chunks
ahead of their conversion, rolling across pages, 2), once the output product of page ``i - 1`` is retired (the key
tile is free):

1. content tile ``t`` (plane ``pl`` of 64-byte chunk ``c``: channels ``pl * CB + 64 c ..``, one quantization
   group): the chunk's code words, 16 bytes a row and thread, converted by kernel v4's packed pairs (``lop3``, then
   ``s * (code - z)`` two values an instruction) and relabelled (no data moves) into QK's A-operand layout;
   ``S^T += K_t Q_t^T`` issued, the tile before's product retired, the tile stored into the key tile;
2. the two RoPE planes likewise (32 channels each, not stored: PV reads content alone), folded: they enter as exact
   ``code - z`` into scores of their own, which each token's float32 scale multiplies once (CuPy v5's ROPE_FOLD);
   QK retired;
3. base-2 online softmax down the columns (the four warps' maxima through shared memory with one barrier, the sums
   kept per thread until the end), P^T to shared memory, ``O^T = O^T * alpha + K^T P^T`` issued (retired as page
   ``i + 1`` starts). Three CTA barriers a page in all.

The shared tiles are indexed in the loop by an opaque zero (:func:`_opaque_zero`), so that the ``wgmma`` descriptors
are made per page rather than hoisted out of the loop into ~80 registers (which spilled).

Channel order: the relabelling puts byte ``j(k)`` of a chunk (:func:`a_channel`) at position ``k`` of the A operand,
so each 64-channel group (32 for RoPE planes) of the queries is loaded in that order, the key tile holds it, the output
product's rows come out in it, and the partial output is stored back in place.

Key tile: one shared allocation, or with ``KEY_PLANES`` one a 64-channel plane, each plane's output product its own
``wgmma`` (triton 3.6 takes stores into slices of one allocation for conflicting writes and puts a CTA barrier before
each plane's; ``heuristics.V6_KEY_PLANES``).

Shared memory: key tile 64 KB, queries 18 KB, P 2 KB: ~86 KB, two programs an SM. Registers: the output accumulator
is 64 floats a thread.
"""

from __future__ import annotations

from .attention_v4_loaders import GLUON_IMPORT_ERROR


#: the permutation that relabels a converted ``[64, width]`` chunk, viewed as ``[64, 2, ..., 2]`` (row, byte bits from
#: the top), into QK's A-operand order: position bits 5 .. 0 are byte bits 3, 2, 0, 5, 4, 1 at width 64, bits 4 .. 0
#: byte bits 2, 0, 4, 3, 1 at 32 (``_relabel`` spells them out: Gluon's permute takes no constexpr tuple)
RELABEL_ORDER = {64: (0, 3, 4, 6, 1, 2, 5), 32: (0, 3, 5, 1, 2, 4)}


def a_channel(k: int, width: int) -> int:
    """The byte of a ``width``-byte chunk row (64: content, 32: a RoPE plane) whose codes land at position ``k`` of
    QK's A operand once converted and relabelled (:func:`_relabel`): ``k``'s bit 3 is byte bit 0, bit 0 byte bit 1,
    bits 4.. the word bits a thread holds, bits 1-2 the two lane bits (the top ones)."""
    return ((k >> 3) & 1) | ((k & 1) << 1) | ((k >> 4) << 2) | (((k >> 1) & 3) * (width // 4))


#: the kernel (a Gluon function), None where ``GLUON_IMPORT_ERROR`` says why this triton cannot build it
split_kernel_v6 = None

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

    from .attention_v4_kernel import _split_range
    from .attention_v4_loaders import (_acc_layout, _biased_zero, _partition_barrier, _plane, page_of,
                                       protected_pages, protected_rows, protected_span, tokens_ok)
    from .attention_v4_kernel import _add
    from .attention_v4_loaders import visible_span

    @gluon.constexpr_function
    def _words_layout(WORDS):
        """``[64, WORDS]`` int32 code words (``WORDS`` 16 or 8: a 64- or 32-byte chunk of each token's row): a thread
        holds ``WORDS / 4`` consecutive words (one 16- or 8-byte load) of rows ``r`` and ``r + 8``, the two lane bits
        over the words above them; converted and relabelled, QK's A operand register for register."""
        per = int(WORDS) // 4
        regs = [[0, 1 << b] for b in range(per.bit_length() - 1)] + [[8, 0]]
        lanes = [[0, per], [0, 2 * per], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]],
                                          block_bases=[], shape=[64, int(WORDS)])

    @gluon.constexpr_function
    def _group_layout(GROUPS):
        """``[64, GROUPS]`` per-group values of a page (``GROUPS`` 8: scales or zero points): a thread holds all of
        rows ``r`` and ``r + 8`` (one load each), the rows as :func:`_words_layout`'s."""
        regs = [[0, 1 << b] for b in range(int(GROUPS).bit_length() - 1)] + [[8, 0]]
        lanes = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]],
                                          block_bases=[], shape=[64, int(GROUPS)])

    @gluon.jit
    def _columns(x, words_layout: gl.constexpr):
        """The 8 columns of ``x`` ``[64, 8]`` (:func:`_group_layout`) as a tuple of ``[64]`` tensors in the rows'
        layout of ``words_layout`` (splits: no data moves)."""
        even, odd = gl.split(gl.reshape(x, [64, 2, 2, 2]))  # [row, column bit 2, bit 1, bit 0]: bit 0
        e0, e1 = gl.split(even)  # bit 1
        o0, o1 = gl.split(odd)
        pairs = (gl.split(e0), gl.split(o0), gl.split(e1), gl.split(o1))  # columns (r, r + 4), r = 0 .. 3
        row_l: gl.constexpr = gl.SliceLayout(1, words_layout)
        cols = ()
        for q in gl.static_range(2):
            for r in gl.static_range(4):
                cols = cols + (gl.convert_layout(pairs[r][q], row_l),)
        return cols

    @gluon.constexpr_function
    def _a_layout(N):
        """QK's A operand (registers) for the ``[64, N]`` accumulator."""
        return gl.DotOperandLayout(operand_index=0, parent=_acc_layout(N), k_width=2)

    @gluon.jit
    def _relabel(k, WIDTH: gl.constexpr):
        """``[64, WIDTH]`` converted codes (column ``j`` = byte ``j`` of the chunk; the layout :func:`_plane` leaves on
        :func:`_words_layout`'s words) relabelled so that column ``k`` holds byte :func:`a_channel` ``(k)``: a reshape
        and a permute (no data moves), after which the layout is QK's A operand's up to the order of registers."""
        if WIDTH == 64:
            k = gl.permute(gl.reshape(k, [64, 2, 2, 2, 2, 2, 2]), (0, 3, 4, 6, 1, 2, 5))  # RELABEL_ORDER[64]
        else:
            k = gl.permute(gl.reshape(k, [64, 2, 2, 2, 2, 2]), (0, 3, 5, 1, 2, 4))  # RELABEL_ORDER[32]
        return gl.reshape(k, [64, WIDTH])

    @gluon.jit
    def _a_channel(k, WIDTH: gl.constexpr):
        """:func:`a_channel` in the kernel."""
        return ((k >> 3) & 1) | ((k & 1) << 1) | ((k >> 4) << 2) | (((k >> 1) & 3) * (WIDTH // 4))

    @gluon.jit
    def _a_tile(w, pl: gl.constexpr, BITS: gl.constexpr, zb, s, BLOCK_R: gl.constexpr):
        """Plane ``pl`` of the words ``w`` (``[64, W]``, :func:`_words_layout`) as bfloat16 ``s * (code - z)`` (``s``
        bfloat16) in QK's A-operand layout, ``[64, 4 W]`` in :func:`a_channel` order."""
        W: gl.constexpr = w.shape[1]
        k = _plane(w, pl, BITS, zb, s, 64, W, False)
        return gl.convert_layout(_relabel(k, 4 * W), _a_layout(BLOCK_R))

    @gluon.jit
    def _opaque_zero(i):
        """0, through a one-instruction inline ``mov`` of ``i * 0`` each page: shared-memory tiles indexed by it have
        their ``wgmma`` descriptors made in the loop. Indexed by a constant, LLVM hoists the descriptors of the 68
        ``wgmma`` out of the page loop, where they hold ~80 registers for the whole walk (kernel v5's slot had the
        same fix)."""
        return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [i * 0], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _load_q_relabelled(q_base, rows, row_ok, q_s, D: gl.constexpr, WIDTH: gl.constexpr):
        """Query rows ``[len(rows), D]`` (0 past R) into ``q_s``, each ``WIDTH``-channel block in :func:`a_channel`
        order."""
        ql: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        pos = gl.arange(0, 64, gl.SliceLayout(0, ql))
        chan = (pos // WIDTH) * WIDTH + _a_channel(pos % WIDTH, WIDTH)
        for c in gl.static_range(D // 64):
            x = gl.load(q_base + rows[:, None] * D + (c * 64 + chan)[None, :], mask=row_ok[:, None], other=0.0)
            q_s.slice(c * 64, 64, dim=1).store(x.to(gl.bfloat16))

    @gluon.jit
    def _page_at(pages_ptr, table_row, num_pages, j, live, ps, pe, PAGE_BYTES: gl.constexpr):
        """Page ``j`` of the request: (its first byte, which of its tokens are in ``[ps, pe)`` on a valid page (the
        code words' rows), whether its table entry is valid); ``live`` False: no table read, every token out."""
        page_off, page_ok = page_of(table_row, j, num_pages, PAGE_BYTES, live)
        tok = gl.arange(0, 64, gl.SliceLayout(1, _words_layout(16)))
        return pages_ptr + page_off, tokens_ok(tok, j, ps, pe, page_ok), page_ok

    @gluon.jit
    def _chunk_words(at, c: gl.constexpr, CB: gl.constexpr, C_CODES_OFF: gl.constexpr):
        """Content chunk ``c`` (bytes ``64 c ..`` of each token's code row) of the page ``at`` (:func:`_page_at`) as
        ``[64, 16]`` words, 0 for tokens out."""
        base, ok, _ = at
        cl: gl.constexpr = _words_layout(16)
        tok = gl.arange(0, 64, gl.SliceLayout(1, cl))
        wcol = gl.arange(0, 16, gl.SliceLayout(0, cl))
        words = (base + C_CODES_OFF).to(gl.pointer_type(gl.int32)) + (tok * (CB // 4))[:, None]
        return gl.load(words + (c * 16 + wcol)[None, :], mask=ok[:, None], other=0)

    @gluon.jit
    def _page_params(at, DC: gl.constexpr, DR: gl.constexpr, RBITS: gl.constexpr, R_CODES_OFF: gl.constexpr,
                     C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr, R_SCALES_OFF: gl.constexpr,
                     R_ZEROS_OFF: gl.constexpr):
        """The rest of page ``at``'s bytes: each group's scale (bfloat16) and zero point (uint8) a row, the RoPE words
        ``[64, DR * RBITS / 32]``, scale (float32) and zero point; 0 for tokens out."""
        base, ok, _ = at
        RB: gl.constexpr = DR * RBITS // 8
        cl: gl.constexpr = _words_layout(16)
        rl: gl.constexpr = _words_layout(RB // 4)
        gll: gl.constexpr = _group_layout(DC // 64)
        gtok = gl.arange(0, 64, gl.SliceLayout(1, gll))
        gok = gl.convert_layout(ok, gl.SliceLayout(1, gll))[:, None]
        gcol = gl.arange(0, DC // 64, gl.SliceLayout(0, gll))
        at = (gtok * (DC // 64))[:, None] + gcol[None, :]
        scales = _columns(gl.load((base + C_SCALES_OFF).to(gl.pointer_type(gl.bfloat16)) + at, mask=gok, other=0.0),
                          cl)
        zeros = _columns(gl.load(base + C_ZEROS_OFF + at, mask=gok, other=0), cl)
        rtok = gl.arange(0, 64, gl.SliceLayout(1, rl))
        rok = gl.convert_layout(ok, gl.SliceLayout(1, rl))
        rcol = gl.arange(0, RB // 4, gl.SliceLayout(0, rl))
        rwords = gl.load((base + R_CODES_OFF).to(gl.pointer_type(gl.int32)) + (rtok * (RB // 4))[:, None]
                         + rcol[None, :], mask=rok[:, None], other=0)
        rs = gl.load((base + R_SCALES_OFF).to(gl.pointer_type(gl.float32)) + rtok, mask=rok, other=0.0)
        rz = gl.load(base + R_ZEROS_OFF + rtok, mask=rok, other=0)
        return scales, zeros, rwords, rs, rz

    @gluon.jit
    def _page_chunks(at, FIRST: gl.constexpr, COUNT: gl.constexpr, CB: gl.constexpr, C_CODES_OFF: gl.constexpr):
        """Chunks ``FIRST .. FIRST + COUNT - 1`` of page ``at`` (a tuple of :func:`_chunk_words`)."""
        chunks = ()
        for c in gl.static_range(FIRST, FIRST + COUNT):
            chunks = chunks + (_chunk_words(at, c, CB, C_CODES_OFF),)
        return chunks

    @gluon.jit
    def _qk_plane(k, q_s, kc, s, g: gl.constexpr):
        """Content group ``g``'s keys ``k`` (``[64, 64]`` in QK's A-operand layout): ``S^T += K_g Q_g^T`` issued, the
        group before's product retired (so ``k``'s registers may be reused after), ``k`` stored into the key tile."""
        s = warpgroup_mma(k, q_s.slice(64 * g, 64, dim=1).permute((1, 0)), s, is_async=True)
        s, k = warpgroup_mma_wait(1, deps=[s, k])
        _key_plane(kc, g).store(k)
        return s

    @gluon.jit
    def _retire(acc):
        """The output products ``acc`` (a tuple, :func:`_pv_issue`) waited for: a tuple of their values."""
        o = warpgroup_mma_wait(0, deps=acc)
        if len(acc) == 1:
            o = (o,)
        return o

    @gluon.jit
    def _key_tile_at(kt1, z):
        """The key tile (a tuple of bfloat16 shared tiles: ``[64, DC]``, or with ``KEY_PLANES`` one ``[64, 64]``
        allocation a plane) indexed by the opaque zero ``z``."""
        parts = ()
        for i in gl.static_range(len(kt1)):
            parts = parts + (kt1[i].index(z),)
        return parts

    @gluon.jit
    def _key_plane(kc, g: gl.constexpr):
        """Plane ``g`` (channels ``64 g ..``, ``[64, 64]``) of the key tile ``kc`` (:func:`_key_tile_at`)."""
        if len(kc) == 1:
            return kc[0].slice(64 * g, 64, dim=1)
        else:
            return kc[g]

    @gluon.jit
    def _pv_issue(p, alpha, o, kc, p_s):
        """P^T into ``p_s`` (bfloat16 ``[R, 64]``, K-major), then ``O^T * alpha + K^T P^T`` issued (not waited for),
        a product for each part of the key tile ``kc`` (:func:`_key_tile_at`) into its part of the output ``o`` (a
        tuple as ``kc``). Returns the tuple of output products."""
        p_s.store(gl.permute(p.to(gl.bfloat16), (1, 0)))
        fence_async_shared()
        _partition_barrier()
        acc = ()
        for i in gl.static_range(len(kc)):
            acc = acc + (warpgroup_mma(kc[i].permute((1, 0)), p_s.permute((1, 0)), o[i] * alpha[None, :],
                                       is_async=True),)
        return acc

    @gluon.jit
    def _qk_and_key_tile(chunks, params, at, at_next, q_s, qr_s, kc, s0, acc, DC: gl.constexpr, DR: gl.constexpr,
                         CBITS: gl.constexpr, RBITS: gl.constexpr, BLOCK_R: gl.constexpr, C_CODES_OFF: gl.constexpr,
                         R_CODES_OFF: gl.constexpr, C_SCALES_OFF: gl.constexpr, C_ZEROS_OFF: gl.constexpr,
                         R_SCALES_OFF: gl.constexpr, R_ZEROS_OFF: gl.constexpr, ROLL: gl.constexpr):
        """``S^T = K Q^T`` over a page's converted planes (A from registers), each content plane also stored into
        the key tile ``kc`` (the output product ``acc`` of the page before retired first). ``chunks``: the page's
        content chunks, or with ``ROLL`` its first two, each later one loaded (from ``at``, then the next page's
        first two and its ``params`` from ``at_next``) as the chunk two before it is converted. Returns (S^T
        ``[64, BLOCK_R]`` float32, that output product's value, the next page's first two chunks and params with
        ``ROLL``, else ``chunks`` and ``params``)."""
        scales, zeros, rwords, rs, rz = params
        CB: gl.constexpr = DC * CBITS // 8
        NCH: gl.constexpr = CB // 64
        PLANES: gl.constexpr = 8 // CBITS
        s = s0
        o = _retire(acc)  # the page before's output product: the key tile is free
        window = chunks
        later = params
        for c in gl.static_range(NCH):
            if ROLL:
                if c + 2 < NCH:
                    new = _chunk_words(at, c + 2, CB, C_CODES_OFF)
                else:
                    new = _chunk_words(at_next, c + 2 - NCH, CB, C_CODES_OFF)
                if c == NCH - 2:
                    later = _page_params(at_next, DC, DR, RBITS, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                         R_SCALES_OFF, R_ZEROS_OFF)
                chunk = window[0]
                window = (window[1], new)
            else:
                chunk = chunks[c]
            for pl in gl.static_range(PLANES):
                # the plane's group: channels 64 g .. 64 g + 63, g = pl * NCH + c
                k = _a_tile(chunk, pl, CBITS, _biased_zero(zeros[pl * NCH + c]), scales[pl * NCH + c], BLOCK_R)
                s = _qk_plane(k, q_s, kc, s, pl * NCH + c)
        # RoPE folded: its planes enter as exact (code - z) (a scale of 1) into their own scores, whose float32 scale
        # multiplies each token's row once (8 FFMA a thread, not 32 values scaled and rounded a page)
        RW: gl.constexpr = DR * RBITS // 32
        one = gl.full(rs.shape, 1.0, gl.bfloat16, rs.type.layout)
        sr = s0
        for pl in gl.static_range(8 // RBITS):
            k = _a_tile(rwords, pl, RBITS, _biased_zero(rz), one, BLOCK_R)
            sr = warpgroup_mma(k, qr_s.slice(pl * 4 * RW, 4 * RW, dim=1).permute((1, 0)), sr, is_async=True)
        s, sr = warpgroup_mma_wait(0, deps=[s, sr])
        rs_tok = gl.convert_layout(rs, gl.SliceLayout(1, _acc_layout(BLOCK_R)))
        return s + sr * rs_tok[:, None], o, window, later

    @gluon.constexpr_function
    def _protected_layout():
        """A protected page's bfloat16 rows ``[64, 64 or 32]`` as loaded, before they move into QK's A operand."""
        return gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])

    @gluon.jit
    def _protected_a_tile(rowp, ok, FIRST: gl.constexpr, WIDTH: gl.constexpr, BLOCK_R: gl.constexpr):
        """Channels ``FIRST .. FIRST + WIDTH - 1`` of a protected page's bfloat16 rows (``rowp`` ``[64]``, 0 where
        ``ok`` is False) in QK's A-operand layout, position ``k`` holding channel ``FIRST +`` :func:`a_channel`
        ``(k, WIDTH)`` as a converted plane does (loaded, then moved through shared memory: a few pages a request)."""
        pos = gl.arange(0, WIDTH, gl.SliceLayout(0, _protected_layout()))
        x = gl.load(rowp[:, None] + (FIRST + _a_channel(pos, WIDTH))[None, :], mask=ok[:, None], other=0.0)
        return gl.convert_layout(x, _a_layout(BLOCK_R))

    @gluon.jit
    def _protected_qk_and_key_tile(rowp, ok, q_s, qr_s, kc, s0, acc, DC: gl.constexpr, DR: gl.constexpr,
                                   BLOCK_R: gl.constexpr):
        """:func:`_qk_and_key_tile` over a protected page's bfloat16 rows (:func:`_protected_a_tile`): ``S^T = K Q^T``
        with A from registers, each content plane stored into the key tile ``kc`` once the output product ``acc``
        is retired. Returns (S^T ``[64, BLOCK_R]`` float32, that output product's value)."""
        o = _retire(acc)
        s = s0
        for g in gl.static_range(DC // 64):
            s = _qk_plane(_protected_a_tile(rowp, ok, 64 * g, 64, BLOCK_R), q_s, kc, s, g)
        for pl in gl.static_range(DR // 32):  # the RoPE values as they are (scale 1), into the same scores
            k = _protected_a_tile(rowp, ok, DC + 32 * pl, 32, BLOCK_R)
            s = warpgroup_mma(k, qr_s.slice(32 * pl, 32, dim=1).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=[s])
        return s, o

    @gluon.constexpr_function
    def _warp_maxima_layout(N):
        """``[4, N]`` (a warp's maxima a row, ``N`` 16 query rows as columns): every thread holds the four warps' values
        of the columns it holds in the ``[64, N]`` accumulator, so that their maximum is in its column layout."""
        assert int(N) == 16
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 8], [1, 0], [2, 0]],
                                          lane_bases=[[0, 2], [0, 4], [0, 0], [0, 0], [0, 0]],
                                          warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[4, int(N)])

    @gluon.jit
    def _column_max(sc, m_scr):
        """The maximum down each column of ``sc`` ``[64, N]`` (the accumulator layout; warp ``w`` holds rows
        ``16 w ..``): each warp's by shuffles, the four warps' through ``m_scr`` (float32 ``[4, N]``) and one CTA
        barrier (a reduction across warps takes two)."""
        N: gl.constexpr = sc.shape[1]
        m_scr.store(gl.max(gl.reshape(sc, [4, 16, N]), axis=1))
        _partition_barrier()
        part = m_scr.load(_warp_maxima_layout(N))
        return gl.convert_layout(gl.max(part, axis=0), gl.SliceLayout(0, _acc_layout(N)))

    @gluon.jit
    def _softmax_deferred(s, span, toks, limit, m_i, l_acc, sm_scale_log2, m_scr):
        """A step of the base-2 online softmax down the columns of the scores ``s`` ``[64, R]`` of a page whose slot
        ``t`` holds position ``base + t``, visible where ``lo <= base + t < hi`` (``span``) and before the causal
        ``limit``, its sums deferred: ``l_acc`` ``[64, R]`` keeps each thread's share (``l_acc * alpha + P``, one
        FFMA a value), so a page reduces across warps only for its maxima (kernel v5's step also reduces the sums:
        three more CTA barriers a page). Returns (P, alpha, the new maxima, the partial sums)."""
        base, lo, hi = span
        n = base + toks
        vis = ((n >= lo) & (n < hi))[:, None] & (n[:, None] < limit[None, :])
        sc = gl.where(vis, s, float("-inf"))
        m_new = gl.maximum(m_i, _column_max(sc, m_scr) * sm_scale_log2)
        m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_safe)
        p = gl.exp2(sc * sm_scale_log2 - m_safe[None, :])
        return p, alpha, m_new, l_acc * alpha[None, :] + p

    @gluon.jit
    def split_kernel_v6(
        q_ptr,  # [B, R, DC] bfloat16, contiguous
        qr_ptr,  # [B, R, DR]
        pages_ptr,  # uint8 [num_pages, PAGE_BYTES]
        table_ptr,  # int32 [B, max_pages]
        lens_ptr,  # [B] int
        o_part_ptr,  # float32 [B, NSPLIT, R, DC]
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
        AHEAD: gl.constexpr = 1,
        INLINE_PROT: gl.constexpr = False,
        CHANNEL_ORDER: gl.constexpr = False,
        KEY_PLANES: gl.constexpr = False,
        sink_ptr=None,  # [max_seqs, SINK, DC + DR] bfloat16 (INLINE_PROT)
        local_ptr=None,  # [max_seqs, LOCAL, DC + DR] bfloat16, a ring by position
        ids_ptr=None,  # [B] int: each request's slot in them
        max_seqs=1,
    ):
        """One (split, request, block of 16 query rows): the partial normalised output ``o_part[b, split, rows]``
        (float32 ``[16, DC]``, plain channel order) and log2-sum-exp ``lse_part[b, split, rows]`` over the split's
        packed tokens (``INLINE_PROT``: the last split also over the request's protected tokens, read from the
        bfloat16 sink and window buffers), as ``split_kernel_v5``. v3's code-path switches are accepted and ignored.
        ``AHEAD``: when a page's bytes are loaded (0: at its start; 1: a page ahead; 2: two chunks ahead, rolling)."""
        gl.static_assert(BLOCK_R == 16, "kernel v6: 16 query rows a program")
        gl.static_assert(QUANT and (CBITS == 4 or CBITS == 2), "kernel v6: C4R4, C2R4")
        gl.static_assert(RBITS == 4, "kernel v6: C4R4, C2R4")
        gl.static_assert(DC == 512 and DR == 64, "kernel v6: d_c 512, d_r 64")
        gl.static_assert(P == 64 and BLOCK_N % 64 == 0, "kernel v6: 64-token pages")
        gl.static_assert(CG == 64 and RG == DR, "kernel v6: groups of 64 channels, one RoPE group")
        gl.static_assert(C_SCALE_BF16 and not R_SCALE_BF16, "kernel v6: bfloat16 content and float32 RoPE scales")
        gl.static_assert(not CHANNEL_ORDER, "kernel v6: plain channel order")
        gl.static_assert(AHEAD >= 0 and AHEAD <= 2, "kernel v6: loads at the page's start, a page or two chunks ahead")
        CB: gl.constexpr = DC * CBITS // 8
        pid_s = gl.program_id(0)
        b = gl.program_id(1)
        rb = gl.program_id(2)
        L = gl.load(lens_ptr + b).to(gl.int32)
        ps, pe, j_lo, n_tiles = _split_range(L, SINK, LOCAL, NSPLIT, pid_s, BLOCK_N)
        table_row = table_ptr + b.to(gl.int64) * stride_table
        part = (b.to(gl.int64) * NSPLIT + pid_s) * R

        KPARTS: gl.constexpr = DC // 64 if KEY_PLANES else 1  # the key tile's allocations
        kl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, DC // KPARTS], gl.bfloat16)
        ql: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, DC], gl.bfloat16)
        qrl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, DR], gl.bfloat16)
        pl_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, 64], gl.bfloat16)
        # one-slot arrays, indexed in the loop by an opaque zero (:func:`_opaque_zero`)
        kt1 = ()
        for i in gl.static_range(KPARTS):
            kt1 = kt1 + (gl.allocate_shared_memory(gl.bfloat16, [1, 64, DC // KPARTS], kl),)
        q_s1 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_R, DC], ql)
        qr_s1 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_R, DR], qrl)
        p_s1 = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_R, 64], pl_l)
        m_scr = gl.allocate_shared_memory(gl.float32, [4, BLOCK_R], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        q_s = q_s1.index(0)
        qr_s = qr_s1.index(0)

        qlay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        qrows = rb * BLOCK_R + gl.arange(0, BLOCK_R, gl.SliceLayout(1, qlay))
        _load_q_relabelled(q_ptr + b.to(gl.int64) * R * DC, qrows, qrows < R, q_s, DC, 64)
        _load_q_relabelled(qr_ptr + b.to(gl.int64) * R * DR, qrows, qrows < R, qr_s, DR, DR * RBITS // 32 * 4)
        fence_async_shared()  # every thread's stores, then the barrier, before the first wgmma reads them
        _partition_barrier()

        lay: gl.constexpr = _acc_layout(BLOCK_R)
        col_l: gl.constexpr = gl.SliceLayout(0, lay)
        tok_l: gl.constexpr = gl.SliceLayout(1, lay)
        rows = rb * BLOCK_R + gl.arange(0, BLOCK_R, col_l)
        limit = L - S_Q + rows // H + 1  # row r (query r // H) sees tokens n < limit
        toks = gl.arange(0, 64, tok_l)
        m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, col_l)
        l_acc = gl.zeros([64, BLOCK_R], gl.float32, lay)  # each thread's share of the sums (_softmax_deferred)
        acc = ()  # the output, a part for each of the key tile's
        for i in gl.static_range(KPARTS):
            acc = acc + (warpgroup_mma_init(gl.zeros([DC // KPARTS, BLOCK_R], gl.float32, lay)),)
        s0 = gl.zeros([64, BLOCK_R], gl.float32, lay)
        if INLINE_PROT:  # the last split also attends to the request's protected tokens (no protected-tile kernel)
            seq = gl.load(ids_ptr + b).to(gl.int64)
            seq_ok = (seq >= 0) & (seq < max_seqs)
            seq = gl.where(seq_ok, seq, 0)
            prot = (sink_ptr, local_ptr, seq, seq_ok, L, SINK, LOCAL,
                    gl.where(pid_s == NSPLIT - 1, protected_pages(SINK, LOCAL), 0))
        else:
            prot = (pages_ptr, pages_ptr, 0, False, L, SINK, LOCAL, 0)
        # page j_lo's place (each page's is found once, as the page after its predecessor) and, ahead, its bytes (with
        # AHEAD 2 its first two chunks)
        at = _page_at(pages_ptr, table_row, num_pages, j_lo, n_tiles > 0, ps, pe, PAGE_BYTES)
        if AHEAD > 0:
            chunks = _page_chunks(at, 0, CB // 64 if AHEAD == 1 else 2, CB, C_CODES_OFF)
            params = _page_params(at, DC, DR, RBITS, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF,
                                  R_ZEROS_OFF)
        for i in range(gl.maximum(n_tiles, 1)):  # an empty split attends to one dead page (see kernel v4)
            j = j_lo + i
            page_ok = at[2]
            at_next = _page_at(pages_ptr, table_row, num_pages, j + 1, i + 1 < n_tiles, ps, pe, PAGE_BYTES)
            if AHEAD == 0:
                chunks = _page_chunks(at, 0, CB // 64, CB, C_CODES_OFF)
                params = _page_params(at, DC, DR, RBITS, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF,
                                      R_ZEROS_OFF)
            elif AHEAD == 1:
                nchunks = _page_chunks(at_next, 0, CB // 64, CB, C_CODES_OFF)
                nparams = _page_params(at_next, DC, DR, RBITS, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF,
                                       R_SCALES_OFF, R_ZEROS_OFF)
            z = _opaque_zero(i)
            kc = _key_tile_at(kt1, z)
            s, o, rolled, rolled_params = _qk_and_key_tile(
                chunks, params, at, at_next, q_s1.index(z), qr_s1.index(z), kc, s0, acc, DC, DR, CBITS, RBITS, BLOCK_R,
                C_CODES_OFF, R_CODES_OFF, C_SCALES_OFF, C_ZEROS_OFF, R_SCALES_OFF, R_ZEROS_OFF, AHEAD == 2)
            if AHEAD == 1:
                chunks = nchunks
                params = nparams
            elif AHEAD == 2:
                chunks = rolled
                params = rolled_params
            span = visible_span(i, j, page_ok, ps, pe, n_tiles, L, prot, False)
            p, alpha, m_i, l_acc = _softmax_deferred(s, span, toks, limit, m_i, l_acc, sm_scale_log2, m_scr)
            acc = _pv_issue(p, alpha, o, kc, p_s1.index(z))  # the key tile's and P's stores fenced first
            at = at_next
        if INLINE_PROT:  # the last split's protected pages, after its packed ones (prot[7]: 0 on the others)
            ptok = gl.arange(0, 64, gl.SliceLayout(1, _protected_layout()))
            for e in range(prot[7]):
                z = _opaque_zero(e)
                kc = _key_tile_at(kt1, z)
                span = protected_span(e, L, SINK, LOCAL, seq_ok)
                rowp, ok = protected_rows(sink_ptr, local_ptr, seq, span, ptok, SINK, LOCAL, DC + DR)
                s, o = _protected_qk_and_key_tile(rowp, ok, q_s1.index(z), qr_s1.index(z), kc, s0, acc, DC, DR,
                                                  BLOCK_R)
                base, lo, hi, _ = span
                p, alpha, m_i, l_acc = _softmax_deferred(s, (base, lo, hi), toks, limit, m_i, l_acc, sm_scale_log2,
                                                         m_scr)
                acc = _pv_issue(p, alpha, o, kc, p_s1.index(z))
        o = _retire(acc)
        l_i = gl.reduce(l_acc, 0, _add)
        l_safe = gl.where(l_i > 0.0, l_i, 1.0)
        pos = gl.arange(0, DC // KPARTS, tok_l)
        chans = (pos // 64) * 64 + _a_channel(pos % 64, 64)  # the key tile's columns, put back in place
        for i in gl.static_range(KPARTS):
            gl.store(o_part_ptr + (part + rows[None, :]) * DC + (i * (DC // KPARTS) + chans)[:, None],
                     o[i] / l_safe[None, :], mask=(rows < R)[None, :])
        lse2 = gl.where(l_i > 0.0, m_i + gl.log2(l_safe), float("-inf"))
        gl.store(lse_part_ptr + part + rows, lse2, mask=rows < R)
