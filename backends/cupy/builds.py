"""How each CuPy attention kernel is built: the constants of its layout (tile, rows, warps, stages), its ``-D``
defines (the ``PackFormat`` turned into the kernel's compile-time constants) and its dynamic shared memory, which
mirrors the ``SMEM_*`` layout of its ``kernels/*.cu`` source. v5 and v6 are sm_90a-only builds."""

from __future__ import annotations

from ...formats import PackFormat
from . import ATTN_TILE, ATTN_WARPS, format_defines

#: v2: default tokens per tile (QMLA_V2_T) and the sizes QUANTMLA_CUPY_V2_TILE may ask for (64 spreads
#: the per-tile work over twice the tokens: offline SASS 177 -> 159 instructions per token, not yet timed)
V2_TILE = 32
V2_TILES = (32, 64)
#: v2: warps per row group (fixed in attention_v2.cu)
V2_WARPS = 4
V2_STAGES = 4  # default of QMLA_V2_STAGES (cp.async ring depth; copies run NSTAGE-1 tiles ahead)

#: v3 (``kernels/attention_v3.cu``): tokens per tile, warps per CTA (4, or 8 with ``QUANTMLA_CUPY_V3_WARPS``),
#: default copy stages
V3_TILE = 64
V3_WARPS = 4
V3_STAGES = 3

#: v4 (``kernels/attention_v4.cu``): tokens per tile, query rows per CTA, warps per CTA, default copy stages
V4_TILE = 64
V4_ROWS = 64
V4_WARPS = 8
V4_STAGES = 2
#: the NVRTC target of v4's wgmma build (``QUANTMLA_CUPY_V4_MMA``): Hopper's architecture-specific features
V4_WGMMA_ARCH = "sm_90a"
#: the oldest NVRTC that builds for sm_90a
V4_WGMMA_NVRTC = (12, 0)

#: v5 (``kernels/attention_v5.cu``, sm_90a only): tokens per tile (wgmma M), query rows per CTA (wgmma N),
#: worker warpgroups per CTA
V5_TILE = 64
V5_ROWS = 16
V5_WORKERS = 2
#: worker counts the kernel builds with (``QUANTMLA_CUPY_V5_WORKERS``): three fit shared memory at
#: 168 registers a thread, with the loads issued after QK and QK chunks of 2 k-steps; four at d_c 256 only (128
#: registers a thread: 16 warps an SM, the occupancy v5's halves seek at d_c 512, without their exchange)
V5_WORKER_CHOICES = (2, 3, 4)
#: batch x block-table tokens from which v5 runs four workers at d_c 256 / d_r 32 by default (H200, stop 44, CUDA
#: graphs, H16: four against two took 4-9 % less time from B128 L32K and B32 L128K (4.2M tokens) up, in both C4R4 and
#: C2R4; -4..+2 % at 1M tokens; 11-18 % more at B8 L32K and B32 L4K)
V5_FOUR_WORKERS_MIN_TOKENS = 1 << 22
#: warpgroups of one v5 worker (``QUANTMLA_CUPY_V5_HALVES``): 1, or 2, each taking half of every tile's channels and
#: adding the pair's scores through shared memory, so four warpgroups share an SM at 128 registers a thread (d_c 512 /
#: d_r 64, two workers; a measurement knob, built in stop 41; timed in stop 44: 15-35 % slower than one)
V5_HALVES = 1
V5_HALVES_CHOICES = (1, 2)
#: the only compute capability v5's sm_90a build runs on
V5_CAPABILITY = (9, 0)
#: threads of a combine block, one row per block (``attention.cu``'s ``QMLA_COMBINE_THREADS``)
COMBINE_THREADS = 128
#: v6 (``kernels/attention_v6.cu``, sm_90a only): tokens per tile, query rows per CTA, threads per CTA
#: (an attending and a dequantizing warpgroup)
V6_TILE = 64
V6_ROWS = 64
V6_THREADS = 256

#: whether ``QUANTMLA_CUPY_V6_PAIR=auto`` pairs v6's CTAs where the row chunks come in pairs (:func:`v6_pairs`)
V6_PAIR_AUTO = False

#: v6's defaults of :class:`~.knobs.V6Knobs` ``pv_at`` and ``page_ahead``
V6_PV_AT = 3
V6_PAGE_AHEAD = False
#: log2 units a score may pass its row's reference maximum before v6 moves the reference (``QMLA_V6_MAX_SLACK``, as
#: v5's ``QMLA_V5_MAX_SLACK``) where :class:`~.knobs.V6Knobs` ``slack`` is on, and whether it is on by default (H200, H128,
#: CUDA graphs, stop 31: 0-2.5 % faster at B8-B128, L4K-128K; C4R4 B32 L32K unchanged)
V6_MAX_SLACK = 8
V6_SLACK = True
#: the content bits for which v6 multiplies each score's RoPE part by the token's scale once instead of dequantizing
#: each RoPE value through float32 (``QMLA_V6_ROPE_FOLD``; :class:`~.knobs.V6Knobs` ``rope_fold`` forces it): with the slack,
#: C4R4 1-4 % faster than the slack alone from 32K tokens on the H200, C2R4 0.5-1.5 % slower (stop 31)
V6_ROPE_FOLD_CONTENT_BITS = (4,)
#: whether v5 converts 2-bit codes where they lie in their byte (``common.cuh``'s ``qmla_code2_in_place``;
#: ``QUANTMLA_CUPY_CODES_IN_PLACE``): 38 fewer instructions per warp and tile in its loop (1,521 against 1,559 at
#: d_c 512; 973 against 987 at 256). H200, C2R4 H16, CUDA graphs (stop 28, one call, the old build run before and
#: after): B128 L32K 680.9 against 690.9-695.7 us, B32 L128K 674.3 against 685.7-689.7, B128 L128K 2,610.8 against
#: 2,683.2-2,683.6, but B32 L32K 2.5 % slower (192.2 against 187.9, and the same in two more calls).
#: v6's dequantizer gained 10 or lost 6 instructions with it (d_c 512 / 256), so v6 does not take it.
CODES_IN_PLACE = True

#: content bits for which v5 multiplies each score's RoPE part by the token's float32 RoPE scale once instead of
#: dequantizing every RoPE value through float32 (``QMLA_V5_ROPE_FOLD``; ``QUANTMLA_CUPY_V5_ROPE_FOLD`` forces it on
#: or off): 72 fewer instructions per warp and tile at d_c 512 (1,320 against 1,392 for C4R4, 1,384 against 1,455 for
#: C2R4). H200, H16, CUDA graphs, stop 29 (1 / 0 / 1 in one process): C2R4 B32 L32K 177.7 / 188.4 / 177.9 us, B128 L32K
#: 652.5 / 676.7 / 652.7, B32 L128K 647.0 / 670.0 / 646.8, B128 L128K 2,530.7 / 2,605.1 / 2,529.3; C4R4 B32 L32K
#: 1.5 % slower with it (186.1-187.4 against 183.5-184.6 in two calls), B128 L32K the same (697-699), so 4-bit
#: content takes it only with the quad loads (:func:`v5_rope_fold`).
ROPE_FOLD_CONTENT_BITS = (2,)

#: whether v5 lets the four lanes of a quad load a token's 4-bit d_c 512 content codes together (64 contiguous bytes a
#: load, one 128-byte line a token and load instead of two) where the build can (``QMLA_V5_QUAD_LOADS``:
#: :func:`v5_quad_loads`; ``QUANTMLA_CUPY_V5_QUAD_LOADS`` forces it on or off). H200, H16 C4R4, CUDA graphs, stop 32
#: (0 / 1 / 1 with the RoPE fold, twice in one process): B32 L32K 187.2 / 177.8 / 171.3 us and 186.2 / 178.0 / 171.7,
#: B128 L32K 717.2 / 682.7 / 666.4 and 711.4 / 700.0 / 665.4, B32 L128K 696.2 / 682.0 / 652.6 and 706.0 / 689.5 /
#: 663.2; ncu at B32 L32K: L1/TEX throughput 85.1 -> 77.4 %, issued warps per scheduler 0.52 -> 0.56. With the quad
#: loads C4R4 is no longer held by L1, and the RoPE fold's 72 fewer instructions pay as they do for C2R4.
V5_QUAD_LOADS = True

#: whether v5 loads a token's 2-bit d_c 512 content zero points and scales in one 8- and one 16-byte load and picks
#: the lane's groups once a tile (``QMLA_V5_PACKED_GROUPS``; ``QUANTMLA_CUPY_V5_PACKED_GROUPS`` = 0/1 forces it): 6
#: loads a token fewer; offline SASS of the packed tile loop, C2R4 d_c 512: 1,388 -> 1,310 instructions a warp and
#: tile, 27 -> 15 LDG, 236 -> 228 registers. H200, H16 C2R4, CUDA graphs, stop 32 (0 / 1 twice in one process): B32
#: L32K 178.3 / 169.7 and 177.5 / 169.8 us, B128 L32K 658.9 / 618.3 and 652.5 / 618.9, B32 L128K 648.8 / 612.5 and
#: 646.6 / 612.5, B128 L128K 2,530.0 / 2,392.6 and 2,532.4 / 2,392.0 (5-6 % faster); B32 L4K equal (40.7-41.1)
V5_PACKED_GROUPS = True

#: whether v5 takes the zero points out of the per-value dequantization where the build can (``QMLA_V5_ZFOLD``,
#: :func:`v5_zfold`; ``QUANTMLA_CUPY_V5_ZFOLD`` = 0/1 forces it): keys enter QK and the key tile as bf16(s code), one
#: fma a pair instead of two, and two more QK k-steps and one more PV block per tile add -sum_g s z Q_g and
#: -sum_t P s z back. Offline SASS of the packed tile loop (nvcc 13), a warp and tile: C4R4 1,307 -> 1,216 instructions
#: (828 -> 787 fixed-wait cycles), C2R4 1,218 -> 1,122 (787 -> 757). Slower all the same (H100, H16, CUDA graphs, stop
#: 69, off / on twice each): B32 L32K C4R4 173.3-173.4 / 174.2 us, C2R4 165.1-165.2 / 174.6-174.7, B128 L32K C4R4
#: 644.0-652.4 / 659.7-661.7, C2R4 599.1-600.3 / 638.1-638.2, B32 L128K C2R4 596.3-596.8 / 633.8-634.3: its 6 more
#: wgmma a tile (QK 36 -> 38, PV 32 -> 36) cost more than the instructions saved, so the loop is not issue-bound.
V5_ZFOLD = False

#: the stages a v5 measurement build may skip (``QMLA_V5_PROBE``, ``QUANTMLA_CUPY_V5_PROBE`` the sum of their bits):
#: PV's wgmma, the key tile's stores, the content dequantization's fma. Results are wrong; timing only.
V5_PROBE_BITS = {"pv": 1, "key_stores": 2, "dequant": 4}


def smem_per_block(capability: tuple[int, int] | None) -> int:
    """Opt-in dynamic shared memory per block (bytes): 227 KB on sm_90, sm_100 and sm_110 (and when the GPU is not
    known yet), 163 KB on sm_80/87, 99 KB on the other sm_8x parts and on sm_120/121 (consumer Blackwell; CUDA
    programming guide, compute capabilities table)."""
    if capability is None or (9, 0) <= tuple(capability) < (12, 0):
        return 227 * 1024
    return 163 * 1024 if tuple(capability) in ((8, 0), (8, 7)) else 99 * 1024


def attention_defines(fmt: PackFormat, dtype: str, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention.cu`` for ``fmt`` and query dtype.

    float32 queries use a split (hi + lo) bf16 A operand for float32-level accuracy. ``index64``:
    seq_lens / seq_ids are int64 (else int32).
    """
    d = format_defines(fmt)
    bf16 = dtype == "bfloat16"
    d.update(QMLA_IN_BF16=int(bf16), QMLA_SPLIT=1 if bf16 else 2, QMLA_INDEX64=int(index64))
    return d


def attention_smem_bytes(fmt: PackFormat) -> int:
    """Dynamic shared memory of one attention block (mirrors the SMEM_* sizes in attention.cu)."""
    ncol = fmt.latent_dim // ATTN_WARPS
    ld = ncol + 24
    ng = fmt.content_groups + 1 if fmt.quantized else 1
    kv = ATTN_WARPS * ATTN_TILE * ld * 2
    scl = 2 * ATTN_TILE * ng * 4
    xchg = ATTN_WARPS * (ATTN_TILE // 8) * 32 * 16
    staging = ATTN_WARPS * ATTN_TILE * (fmt.content_code_bytes // ATTN_WARPS + 32 + 8)
    return kv + scl + xchg + staging


def stage_bytes(fmt: PackFormat, tile: int, flags: bool) -> int:
    """Bytes of one staged tile (the SO_* layout of kernels v2/v3, 16-byte rounded): content codes,
    RoPE codes, content scales, content zeros, RoPE scale, RoPE zero, and v2's token flag."""
    csz = 2 if fmt.content_scale_dtype == "bfloat16" else 4
    rsz = 2 if fmt.rope_scale_dtype == "bfloat16" else 4
    per_token = fmt.content_code_bytes + fmt.rope_code_bytes + fmt.content_groups * (csz + 1) + rsz + 1 + int(flags)
    return (tile * per_token + 15) // 16 * 16


def v2_defines(fmt: PackFormat, row_groups: int = 1, min_blocks: int = 1, stages: int = V2_STAGES,
               lazy_rescale: bool = False, no_protection: bool = False, prot_mode: int = 0,
               tile: int = V2_TILE, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v2.cu`` (bfloat16 queries). ``no_protection``: the
    cache keeps no sink/local tokens, so only the pure-tile path is compiled (fewer registers,
    half the loop code). ``prot_mode``: 0 protected tokens inline; 1 packed tokens only, with
    ``kernels/protected.cu`` adding the protected ones (``QUANTMLA_CUPY_V2_PROTECTED``). ``tile``:
    tokens per tile, 32 or 64 (``QUANTMLA_CUPY_V2_TILE``). ``index64``: int64 seq_lens / seq_ids
    (else int32)."""
    if prot_mode not in (0, 1):
        raise ValueError(f"prot_mode: expected 0 (inline) or 1 (packed only), got {prot_mode!r}")
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V2_RG=int(row_groups), QMLA_V2_MINB=int(min_blocks), QMLA_V2_STAGES=int(stages),
             QMLA_V2_SMEM=v2_smem_bytes(fmt, row_groups, stages, tile),
             QMLA_V2_LAZY_RESCALE=int(lazy_rescale),
             QMLA_V2_NO_PROTECTION=int(no_protection), QMLA_V2_PROT_MODE=int(prot_mode), QMLA_V2_T=int(tile))
    return d


def v2_default_stages(tile: int) -> int:
    """Copy stages for ``tile``-token tiles: 4 x 32 tokens, or 3 x 64 (4 x 64 = 81 KB of stages
    plus the score exchange would leave room for one CTA per SM instead of two)."""
    return V2_STAGES if tile == V2_TILE else 3


def v2_smem_bytes(fmt: PackFormat, row_groups: int = 1, stages: int = 4, tile: int = V2_TILE) -> int:
    """Dynamic shared memory of one v2 block (mirrors SMEM_TOTAL in attention_v2.cu)."""
    stage = stage_bytes(fmt, tile, flags=True)
    xchg = 2 * row_groups * V2_WARPS * (tile // 8) * 32 * 16
    return stages * stage + xchg


def v3_defines(fmt: PackFormat, stages: int = V3_STAGES, min_blocks: int | None = None, lazy_rescale: bool = True,
               warps: int = V3_WARPS, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v3.cu`` (bfloat16 queries). ``min_blocks`` None: 2 at
    8 warps (at most 128 registers, so two 8-warp CTAs fit an SM), else 1. ``index64``: int64
    seq_lens / seq_ids (else int32)."""
    minb = (2 if warps == 8 else 1) if min_blocks is None else min_blocks
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V3_STAGES=int(stages), QMLA_V3_MINB=int(minb), QMLA_V3_SMEM=v3_smem_bytes(fmt, stages, warps),
             QMLA_V3_LAZY_RESCALE=int(lazy_rescale), QMLA_V3_NW=int(warps))
    return d


def v3_smem_bytes(fmt: PackFormat, stages: int = V3_STAGES, warps: int = V3_WARPS) -> int:
    """Dynamic shared memory of one v3 block (mirrors SMEM_TOTAL in attention_v3.cu): the staged
    tiles, the permuted query, its sub-group sums, P * s per content group, the row maxima and,
    with 8 warps, the exchange of partial scores."""
    t, ngc = V3_TILE, fmt.content_groups
    stage = stage_bytes(fmt, t, flags=False)
    ksteps = (fmt.latent_dim + fmt.rope_dim) // 16
    sub_groups = fmt.latent_dim // 64 + 2
    xchg = 4 * 2 * 32 * 32 if warps == 8 else 0  # [token group][pair half][lane][8 floats]
    return stages * stage + ksteps * 512 + sub_groups * 64 + ngc * (t // 8) * 256 + 4 * 64 + xchg


def v4_defines(fmt: PackFormat, stages: int = V4_STAGES, lazy_rescale: bool = True, index64: bool = True,
               protected: bool = False, wgmma: bool = False) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v4.cu`` (bfloat16 queries). ``index64``: int64
    seq_lens / seq_ids (else int32); ``protected``: the build whose last CTAs attend to the
    protected tiles (else packed tokens only); ``wgmma``: both matmuls by Hopper's wgmma (a build
    for sm_90a, :data:`V4_WGMMA_ARCH`)."""
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V4_STAGES=int(stages), QMLA_V4_SMEM=v4_smem_bytes(fmt, stages, wgmma),
             QMLA_V4_LAZY_RESCALE=int(lazy_rescale), QMLA_V4_PROTECTED=int(protected), QMLA_V4_WGMMA=int(wgmma))
    return d


def v4_smem_bytes(fmt: PackFormat, stages: int = V4_STAGES, wgmma: bool = False) -> int:
    """Dynamic shared memory of one v4 block (mirrors SMEM_TOTAL in attention_v4.cu): the staged
    tiles, the dequantized tile and the queries (bf16 rows padded by 16 bytes), P (bf16 [64][64 + 8]),
    the QK score exchange (float4 [8 warps][4 n-tiles][32 lanes]) and four float rows of row statistics.
    ``wgmma``: the build whose K, query and P tiles are 128-byte swizzled (64-channel column blocks of
    128-byte rows, 1024-byte aligned, plus 1 KB to align the base)."""
    staged = stages * stage_bytes(fmt, V4_TILE, flags=False) if fmt.quantized else 0  # bf16 pages: no stages
    stats = V4_WARPS * 4 * 32 * 16 + 4 * V4_ROWS * 4
    if wgmma:
        blocks = -(-(fmt.latent_dim + fmt.rope_dim) // 64)
        return -(-staged // 1024) * 1024 + (V4_TILE + V4_ROWS) * blocks * 128 + V4_ROWS * 128 + stats + 1024
    row = 2 * (fmt.latent_dim + fmt.rope_dim) + 16
    return staged + V4_TILE * row + V4_ROWS * row + V4_ROWS * (2 * V4_TILE + 16) + stats


def v4_uses_wgmma(mma: str, capability: tuple[int, int] | None, nvrtc: tuple[int, int] = V4_WGMMA_NVRTC) -> bool:
    """Whether a v4 launch runs its wgmma build: ``mma`` is ``QUANTMLA_CUPY_V4_MMA`` (``auto``: on
    compute capability 9.0 exactly, wgmma being an sm_90a instruction that later GPUs do not run,
    with an NVRTC of at least :data:`V4_WGMMA_NVRTC`, ``nvrtc``). Raises ``ValueError`` naming the
    variable when ``wgmma`` is forced where it cannot run."""
    hopper = capability is not None and tuple(capability) == (9, 0)
    new_nvrtc = tuple(nvrtc) >= V4_WGMMA_NVRTC
    if mma == "wgmma" and not (hopper and new_nvrtc):
        got = "an unknown GPU" if capability is None else f"{capability[0]}.{capability[1]}"
        raise ValueError(f"QUANTMLA_CUPY_V4_MMA: wgmma needs compute capability 9.0 (sm_90a) and NVRTC "
                         f"{V4_WGMMA_NVRTC[0]}.{V4_WGMMA_NVRTC[1]}+, got {got} and NVRTC {nvrtc[0]}.{nvrtc[1]}; use mma")
    return mma == "wgmma" or (mma == "auto" and hopper and new_nvrtc)


def v5_defines(fmt: PackFormat, lazy_rescale: bool = True, index64: bool = True,
               workers: int = V5_WORKERS, protected: bool = True, prot_vec: bool = True,
               codes_in_place: bool = CODES_IN_PLACE, rope_fold: bool | None = None,
               quad_loads: bool | None = None, packed_groups: bool = V5_PACKED_GROUPS,
               halves: int = V5_HALVES, zfold: bool | None = None, probe: int = 0) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v5.cu`` (bfloat16 queries; an sm_90a build,
    :data:`V4_WGMMA_ARCH`). ``index64``: int64 seq_lens / seq_ids (else int32); ``workers``: worker
    warpgroups per CTA; ``protected``: the sink/local tokens as the kernel's own tiles (else packed
    tokens only, for the protected-only launch); ``prot_vec``: a protected tile's bf16 pairs in loads of up to
    16 bytes (``QMLA_V5_PROT_VEC``; else one 4-byte load per fragment register); ``codes_in_place``: 2-bit codes
    converted where they lie (``QMLA_CODES_IN_PLACE``, :data:`CODES_IN_PLACE`; 4-bit content ignores it);
    ``rope_fold``: the RoPE scale multiplies each score once instead of each RoPE value (``QMLA_V5_ROPE_FOLD``;
    None: :func:`v5_rope_fold`'s default; two workers only: three have no registers for the second accumulator);
    ``quad_loads``: a quad's lanes load a token's content codes together (``QMLA_V5_QUAD_LOADS``,
    :func:`v5_quad_loads`); ``packed_groups``: a 2-bit d_c 512 build with 64-channel groups loads a token's zero points
    and scales at once (``QMLA_V5_PACKED_GROUPS``, :data:`V5_PACKED_GROUPS`; other formats and three workers, which
    spilled 8 bytes with it, ignore it); ``halves``: warpgroups of a worker (``QMLA_V5_HALVES``, :data:`V5_HALVES`;
    2 builds neither the fold, quad loads nor packed groups, which need registers four warpgroups do not have);
    ``zfold``: the zero points through the matmuls (``QMLA_V5_ZFOLD``, :func:`v5_zfold`; None: its default);
    ``probe``: the stages a measurement build skips (``QMLA_V5_PROBE``, :data:`V5_PROBE_BITS`; 0: none)."""
    reasons = v5_build_reasons(fmt, workers, halves)
    if reasons:
        raise ValueError(f"v5 cannot build {fmt} with {workers} workers of {halves} warpgroups: {'; '.join(reasons)}")
    if halves > 1:
        rope_fold, quad_loads, packed_groups = False, False, False
    d = attention_defines(fmt, "bfloat16", index64)
    zf = v5_zfold(fmt, workers, halves, zfold, quad_loads, packed_groups)
    if probe not in range(8):
        raise ValueError(f"probe: expected a sum of {V5_PROBE_BITS}, got {probe!r}")
    d.update(QMLA_V5_PROBE=probe, QMLA_V5_SMEM=v5_smem_bytes(fmt, workers, halves, zf), QMLA_V5_HALVES=halves,
             QMLA_V5_ZFOLD=int(zf),
             QMLA_V5_LAZY_RESCALE=int(lazy_rescale),
             QMLA_V5_WORKERS=workers, QMLA_V5_PROTECTED=int(protected), QMLA_V5_PROT_VEC=int(prot_vec),
             QMLA_CODES_IN_PLACE=int(codes_in_place and fmt.content_bits == 2),
             QMLA_V5_ROPE_FOLD=int(v5_rope_fold(fmt, workers, rope_fold, quad_loads)),
             QMLA_V5_QUAD_LOADS=int(v5_quad_loads(fmt, workers, quad_loads)),
             QMLA_V5_PACKED_GROUPS=int(_v5_packed_groups(fmt, workers, packed_groups)))
    return d


def v5_workers(fmt: PackFormat, batch: int, max_tokens: int, workers: int | None = None) -> int:
    """Worker warpgroups of a v5 CTA: ``workers`` where set (``QUANTMLA_CUPY_V5_WORKERS``), else four where they build
    (d_c 256) and the call covers :data:`V5_FOUR_WORKERS_MIN_TOKENS` (``batch`` x ``max_tokens``, the block table's
    capacity), else :data:`V5_WORKERS`."""
    if workers is not None:
        return workers
    if batch * max_tokens >= V5_FOUR_WORKERS_MIN_TOKENS and not v5_build_reasons(fmt, 4):
        return 4
    return V5_WORKERS


def v5_smem_bytes(fmt: PackFormat, workers: int = V5_WORKERS, halves: int = V5_HALVES, zfold: bool = False) -> int:
    """Dynamic shared memory of one v5 block (mirrors SMEM_TOTAL in attention_v5.cu): per worker
    (1024-byte aligned) the 128-byte-swizzled key tile of the content channels (64-channel column blocks
    of 64 rows), P^T (bf16 [16][64]), column statistics (float [4][16]) and 16 bytes of the warps'
    new-maximum flags; then the queries (16 rows of d_c + d_r channels in column blocks), plus 1 KB to
    align the base. No stage: the lanes load their codes from the pages into registers. ``workers``:
    workers per CTA (2 or 3); ``halves``: warpgroups of a worker, each with an area of its own over its share of the
    channels (with 2: and 8 float scores per thread to hand over) and a query tile of its own. ``zfold``
    (``QMLA_V5_ZFOLD``): one more key-tile block, 8 groups' float sums per column, one more query block."""
    blocks = -(-(fmt.latent_dim + fmt.rope_dim) // halves // 64) + int(zfold)
    exchange = 2 * 128 * 16 if halves > 1 else 0
    corr = 8 * V5_ROWS * 4 if zfold else 0
    area = (V5_TILE * (fmt.latent_dim // halves // 64 + int(zfold)) * 128 + V5_ROWS * V5_TILE * 2 + 4 * V5_ROWS * 4 + 16
            + corr + exchange)
    return workers * halves * (-(-area // 1024) * 1024) + halves * blocks * V5_ROWS * 128 + 1024


def v5_build_reasons(fmt: PackFormat, workers: int, halves: int = V5_HALVES) -> list[str]:
    """Why v5 cannot build ``fmt`` with ``workers`` workers of ``halves`` warpgroups (empty: it can). Four workers
    take d_c 256 (512 threads at 128 registers each hold a quarter of d_c 512's accumulators); two halves take d_c
    512 / d_r 64 (a half's 128 or 64 content code bytes a token, 16 RoPE bytes) and two workers (also 512 threads)."""
    reasons = []
    if workers not in V5_WORKER_CHOICES:
        reasons.append(f"workers: expected one of {V5_WORKER_CHOICES}, got {workers!r}")
    if halves not in V5_HALVES_CHOICES:
        reasons.append(f"halves: expected one of {V5_HALVES_CHOICES}, got {halves!r}")
    if reasons:
        return reasons
    if workers == 4 and fmt.latent_dim != 256:
        reasons.append(f"four workers need d_c 256, got {fmt.latent_dim}")
    if halves == 2 and (fmt.latent_dim, fmt.rope_dim) != (512, 64):
        reasons.append(f"two halves need d_c 512 / d_r 64, got {fmt.latent_dim} / {fmt.rope_dim}")
    if halves == 2 and workers != 2:
        reasons.append(f"two halves need two workers, got {workers}")
    return reasons


def _v5_loads_token_groups(fmt: PackFormat, workers: int, content_bits: int) -> bool:
    """Whether a v5 build with ``workers`` worker warpgroups can load all of a token's content zero points and scales
    at once (``attention_v5.cu``'s PACKED: eight 64-channel groups of d_c 512, bf16 scales) for ``fmt`` with
    ``content_bits``: two workers only (three, at 168 registers a thread, spilled 108 bytes with quad loads and 8 with
    packed groups)."""
    return (workers == 2 and fmt.content_bits == content_bits and fmt.latent_dim == 512 and fmt.group_size == 64
            and fmt.content_scale_dtype == "bfloat16")


def _v5_packed_groups(fmt: PackFormat, workers: int, packed_groups: bool) -> bool:
    """Whether a v5 build with ``workers`` workers loads ``fmt``'s 2-bit content zero points and scales a token at once
    (``QMLA_V5_PACKED_GROUPS``) where ``packed_groups`` asks for it."""
    return packed_groups and _v5_loads_token_groups(fmt, workers, 2)


def v5_zfold(fmt: PackFormat, workers: int = V5_WORKERS, halves: int = V5_HALVES, zfold: bool | None = None,
             quad_loads: bool | None = None, packed_groups: bool = V5_PACKED_GROUPS) -> bool:
    """Whether v5 folds ``fmt``'s content zero points into its matmuls (``QMLA_V5_ZFOLD``): only where the build loads
    a token's eight groups at once (quad loads or packed groups, :func:`_v5_loads_token_groups`) with one warpgroup a
    worker; there ``zfold``, or by default :data:`V5_ZFOLD`."""
    loads_groups = v5_quad_loads(fmt, workers, quad_loads) or _v5_packed_groups(fmt, workers, packed_groups)
    if halves != 1 or not loads_groups:
        return False
    return V5_ZFOLD if zfold is None else bool(zfold)


def v5_quad_loads(fmt: PackFormat, workers: int = 2, quad_loads: bool | None = None) -> bool:
    """Whether v5 with ``workers`` worker warpgroups loads ``fmt``'s content codes a quad of lanes at a time: where a
    lane's share is 64 bytes a token (4-bit codes) and the build can load a token's groups at once
    (:func:`_v5_loads_token_groups`); there ``quad_loads``, or by default :data:`V5_QUAD_LOADS`."""
    if not _v5_loads_token_groups(fmt, workers, 4):
        return False
    return V5_QUAD_LOADS if quad_loads is None else bool(quad_loads)


def v5_rope_fold(fmt: PackFormat, workers: int, rope_fold: bool | None = None, quad_loads: bool | None = None) -> bool:
    """Whether v5 with ``workers`` worker warpgroups folds the RoPE scale into the scores for ``fmt``: never with
    three (no registers for the second accumulator); else ``rope_fold``, or by default for the content bits in
    :data:`ROPE_FOLD_CONTENT_BITS` and where the build loads its codes a quad at a time (``quad_loads``, as
    :func:`v5_quad_loads` takes it)."""
    if workers != 2:
        return False
    if rope_fold is not None:
        return bool(rope_fold)
    return fmt.content_bits in ROPE_FOLD_CONTENT_BITS or v5_quad_loads(fmt, workers, quad_loads)


#: the most splits of a row chunk v6 merges in one cluster (:func:`v6_defines`' ``merge``): the portable cluster size
V6_MERGE_MAX_SPLITS = 8


def v6_defines(fmt: PackFormat, index64: bool = True, pv_at: int = V6_PV_AT, page_ahead: bool = V6_PAGE_AHEAD,
               protected: bool = True, pair: bool = False, slack: bool = V6_SLACK,
               rope_fold: bool | None = None, pieces: bool = False, merge: int = 0) -> dict[str, int]:
    """``-D`` defines of ``kernels/attention_v6.cu`` (bfloat16 queries; an sm_90a build,
    :data:`V4_WGMMA_ARCH`). ``index64``: int64 seq_lens / seq_ids (else int32); ``pv_at``, ``page_ahead``,
    ``protected`` (the sink/local tokens as the kernel's own tiles), ``pair`` (two-CTA clusters sharing
    each key tile), ``slack`` (a reference maximum per row that moves by more than :data:`V6_MAX_SLACK` only) and
    ``rope_fold`` (the RoPE scale applied to each score once; None: :func:`v6_rope_fold`'s default; True is refused
    with ``pair``): :class:`~.knobs.V6Knobs`; ``pieces``: each CTA's work from a balanced plan's piece table (:func:`~.plans.v6_balanced`;
    refused with ``pair``); ``merge``: 0, or the splits (1 to :data:`V6_MERGE_MAX_SPLITS`) whose CTAs form a cluster
    that merges their partials and writes the output and lse itself, with no combine (:func:`~.plans.v6_merge_reason`;
    refused with ``pair``, ``pieces`` or without ``protected``)."""
    if pair and rope_fold:
        raise ValueError("v6 pair builds do not fold the RoPE scale: rope_fold=True needs pair=False")
    if pair and pieces:
        raise ValueError("v6 pair builds take equal splits: pieces=True needs pair=False")
    if not 0 <= merge <= V6_MERGE_MAX_SPLITS:
        raise ValueError(f"v6 merge: 0 or 1 to {V6_MERGE_MAX_SPLITS} splits a cluster, got {merge}")
    if merge and (pair or pieces or not protected):
        raise ValueError(f"v6 merge={merge} needs equal splits without pairs (pair=False, pieces=False) and the sink "
                         f"and local tokens as the kernel's own tiles (protected=True), got pair={pair}, "
                         f"pieces={pieces}, protected={protected}")
    fold = v6_rope_fold(fmt, pair, rope_fold)
    d = attention_defines(fmt, "bfloat16", index64)
    d.update(QMLA_V6_SMEM=v6_smem_bytes(fmt, pair, fold), QMLA_V6_PV_AT=pv_at, QMLA_V6_PAGE_AHEAD=int(page_ahead),
             QMLA_V6_PROTECTED=int(protected), QMLA_V6_PAIR=int(pair), QMLA_V6_MAX_SLACK=V6_MAX_SLACK if slack else 0,
             QMLA_V6_ROPE_FOLD=int(fold), QMLA_V6_PIECES=int(pieces), QMLA_V6_MERGE=merge)
    return d


def v6_smem_bytes(fmt: PackFormat, pair: bool = False, rope_fold: bool = False) -> int:
    """Dynamic shared memory of one v6 block (mirrors SMEM_TOTAL in attention_v6.cu): two key tiles and
    the queries (64 rows of d_c + d_r channels each, 128-byte-swizzled column blocks), P (bf16 [64][64]),
    the rows' rescale factors and, for the partials, maxima and sums (float [3][64]), with ``rope_fold`` the
    two key tiles' RoPE scales (float [2][64]), with ``pair`` four 8-byte mbarriers, plus 1 KB to align the
    base. No stage: the dequantizing warpgroup loads its codes from the pages into registers."""
    blocks = -(-(fmt.latent_dim + fmt.rope_dim) // 64)
    tile = V6_TILE * blocks * 128
    return (2 * tile + V6_ROWS * blocks * 128 + V6_ROWS * V6_TILE * 2 + 3 * V6_ROWS * 4 + 2 * V6_TILE * 4 * rope_fold
            + 32 * pair + 1024)


def v6_rope_fold(fmt: PackFormat, pair: bool = False, rope_fold: bool | None = None) -> bool:
    """Whether v6 folds the RoPE scale into the scores for ``fmt``: ``rope_fold``, or by default for the content bits
    in :data:`V6_ROPE_FOLD_CONTENT_BITS`; never in a ``pair`` build (its kernel has no fold)."""
    if pair:
        return False
    return fmt.content_bits in V6_ROPE_FOLD_CONTENT_BITS if rope_fold is None else bool(rope_fold)


def v6_pairs(mode: str, rows: int) -> bool:
    """Whether v6 runs as two-CTA clusters (``QUANTMLA_CUPY_V6_PAIR``): ``1`` always (an odd number of
    64-row chunks gets one more, past the rows), ``0`` never, ``auto`` (default) where the request's
    ``rows`` fill an even number of chunks, so no CTA is added (:data:`V6_PAIR_AUTO`)."""
    if mode == "1":
        return True
    chunks = -(-rows // V6_ROWS)
    return mode == "auto" and V6_PAIR_AUTO and chunks % 2 == 0


#: kernels/protected.cu: tokens per CTA (one tile) and warps per CTA (each scores 8 of the tokens)
PROTECTED_TILE = 32
PROTECTED_WARPS = 4


def protected_ctas(sink: int, local: int, tile: int = PROTECTED_TILE) -> int:
    """CTAs per row chunk that attend to protected tokens, one ``tile``-token tile each: the tiles
    of the ``sink`` first tokens and every tile the local window of ``local`` tokens can touch (it
    need not start on a tile boundary). Each writes one partial, the last ones of a row's slots.
    The protected-only launch (``kernels/protected.cu``, 16-row chunks) uses 32-token tiles;
    kernel v4's own protected CTAs use its 64."""
    return -(-sink // tile) + (-(-local // tile) + 1 if local > 0 else 0)


def protected_smem_bytes(fmt: PackFormat) -> int:
    """Dynamic shared memory of ``kernels/protected.cu``: 16 query rows and 32 key rows of
    d_c + d_r bfloat16 values padded by 8, P as bfloat16 [16][40], row maxima and sums [2][4][16]."""
    row = fmt.latent_dim + fmt.rope_dim + 8
    return (16 + PROTECTED_TILE) * row * 2 + 16 * (PROTECTED_TILE + 8) * 2 + 2 * PROTECTED_WARPS * 16 * 4


def protected_defines(fmt: PackFormat, index64: bool = True) -> dict[str, int]:
    """``-D`` defines of ``kernels/protected.cu``: the row widths, tile and warps, the shared
    memory size the launch gives it (the kernel checks it against its own layout) and the width
    of seq_lens / seq_ids."""
    return {"QMLA_DC": fmt.latent_dim, "QMLA_DR": fmt.rope_dim, "QMLA_PROT_T": PROTECTED_TILE,
            "QMLA_PROT_NW": PROTECTED_WARPS, "QMLA_PROT_SMEM_EXPECTED": protected_smem_bytes(fmt),
            "QMLA_INDEX64": int(index64)}
