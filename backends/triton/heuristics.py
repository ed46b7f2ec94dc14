"""Launch heuristics for the Triton attention kernels: split count and block sizes.

Every number here is a named rule with its reason; there is no autotuning. The same rules
run in the interpreter (CPU) with ``sm_count`` = :data:`INTERPRETER_SM_COUNT`.

* ``BLOCK_N`` (tokens per tile) = min(page size, :data:`MAX_BLOCK_N`): a tile never spans two
  pages, so one block-table lookup serves a tile (32: see the measurement beside MAX_BLOCK_N).
* ``BLOCK_R`` (query rows per program, rows = S_q x H): at least :data:`MIN_DOT_N` (the
  smallest ``tl.dot`` extent) and at most what keeps the float32 accumulator
  (``BLOCK_R x d_c``) within :data:`ACC_REGS_PER_THREAD` registers per thread.
* ``num_splits``: flash-decoding. Programs without splitting = B x row_blocks; we split each
  request's packed range until the grid has :data:`WAVES` x ``sm_count`` programs, but never
  into shares shorter than :data:`MIN_TILES_PER_SPLIT` tiles (each split costs one partial
  ``BLOCK_R x d_c`` float32 write and read back in the combine kernel) and never more than
  :data:`MAX_SPLITS`. The longest possible request (``max_pages x P`` from the block
  table's width) bounds the tile count, so no device sync is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

#: measured on an H200 (C4R4, H=16, B=32, L=32K): 64-token tiles spill (255 regs, 2.09 ms), 32 do not (1.65 ms)
MAX_BLOCK_N = 32
MIN_DOT_N = 16
ACC_REGS_PER_THREAD = 64
THREADS_PER_WARP = 32
WAVES = 2
MIN_TILES_PER_SPLIT = 4
MIN_TILES_PER_SPLIT_INTERPRETER = 1  # small CI shapes must still exercise several splits
MAX_SPLITS = 64
INTERPRETER_SM_COUNT = 4
#: writer: tokens per program (GPU: enough bytes in flight per CTA; interpreter: fewer, wider numpy ops)
WRITER_BLOCK_T = 4
WRITER_BLOCK_T_INTERPRETER = 32
PROTECT_BLOCK_T = 32
#: float32 queries use IEEE float32 dots (operands twice as wide, no tensor cores); measured on
#: an H200: 32-token tiles with 2 stages asked for 258,048 B of shared memory (limit 232,448),
#: so float32 runs 16-token tiles, one stage, and 16-token protected tiles.
FP32_MAX_BLOCK_N = 16
FP32_NUM_STAGES = 1
FP32_PROTECT_BLOCK_T = 16  # protected tokens per tile in the combine kernel (sink + local <= 132 → ≤ 5 tiles)


@dataclass(frozen=True)
class AttentionPlan:
    block_n: int
    block_r: int
    row_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    combine_block_r: int
    combine_warps: int
    combine_block_t: int = PROTECT_BLOCK_T


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def plan(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
         interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False) -> AttentionPlan:
    """Block sizes and split count for ``batch`` requests of ``rows`` = S_q x H query rows,
    at most ``max_tokens`` tokens each, on a device with ``sm_count`` multiprocessors.
    ``fp32_dot``: float32 queries (IEEE float32 products; smaller tiles, see FP32_MAX_BLOCK_N)."""
    gpu_fp32 = fp32_dot and not interpreter
    block_n = min(page_size, FP32_MAX_BLOCK_N if gpu_fp32 else MAX_BLOCK_N)
    num_warps = 4
    threads = num_warps * THREADS_PER_WARP
    cap = max(MIN_DOT_N, ACC_REGS_PER_THREAD * threads // latent_dim)
    block_r = max(MIN_DOT_N, min(_pow2_at_least(rows), _pow2_at_least(cap) if cap & (cap - 1) == 0 else cap))
    row_blocks = -(-rows // block_r)
    tiles = max(1, -(-max_tokens // block_n))
    if num_splits is None:
        min_tiles = MIN_TILES_PER_SPLIT_INTERPRETER if interpreter else MIN_TILES_PER_SPLIT
        want = -(-WAVES * sm_count // (batch * row_blocks))
        num_splits = max(1, min(want, -(-tiles // min_tiles), MAX_SPLITS))
    combine_block_r = MIN_DOT_N
    return AttentionPlan(block_n, block_r, row_blocks, int(num_splits), num_warps,
                         FP32_NUM_STAGES if gpu_fp32 else 2, combine_block_r, 4,
                         FP32_PROTECT_BLOCK_T if gpu_fp32 else PROTECT_BLOCK_T)
