"""Launch heuristics for the Triton attention kernels: split count and block sizes.

Every number here is a named rule with its reason; there is no autotuning. The same rules
run in the interpreter (CPU) with ``sm_count`` = :data:`INTERPRETER_SM_COUNT`.

* ``BLOCK_N`` (tokens per tile) = min(page size, :data:`MAX_BLOCK_N`): a tile never spans two
  pages, so one block-table lookup serves a tile (32: see the measurement beside MAX_BLOCK_N).
* ``BLOCK_R`` (query rows per program, rows = S_q x H): at least :data:`MIN_DOT_N` (the
  smallest ``tl.dot`` extent) and at most what keeps the float32 accumulator
  (``BLOCK_R x d_c``) within :data:`ACC_REGS_PER_THREAD` registers per thread.
* ``num_splits``: flash-decoding. Programs without splitting = B x row_blocks; the split count
  is the cheapest under the wave model of ``backends/splits.py`` (whole rounds of the
  :data:`CTAS_PER_SM` x ``sm_count`` programs the GPU holds at once), but never into shares
  shorter than :data:`MIN_TILES_PER_SPLIT` tiles (each split costs one partial
  ``BLOCK_R x d_c`` float32 write and read back in the merge kernel) and never more than
  :data:`MAX_SPLITS`. The longest possible request (``max_pages x P`` from the block
  table's width) bounds the tile count, so no device sync is needed.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from ..splits import plan_kv_splits

#: measured on an H200 (C4R4, H=16, B=32, L=32K): 64-token tiles spill (255 regs, 2.09 ms), 32 do not (1.65 ms)
MAX_BLOCK_N = 32
MIN_DOT_N = 16
ACC_REGS_PER_THREAD = 64
THREADS_PER_WARP = 32
#: programs resident per SM: both split kernels compile to 240-255 registers at 4 warps on sm_90
#: (H200, n_regs printed by benchmarks/triton_probe.py), so 65,536 / (255 x 128) -> 2
CTAS_PER_SM = 2
MIN_TILES_PER_SPLIT = 4
MIN_TILES_PER_SPLIT_INTERPRETER = 1  # small CI shapes must still exercise several splits
MAX_SPLITS = 64
INTERPRETER_SM_COUNT = 4
#: writer: one token per one-warp program on a GPU (H200, 128K-token bf16 prompt,
#: benchmarks/writer_probe.py: C4R4 134 us vs 159 us at 4 tokens x 4 warps, C2R4 139 vs 270 us;
#: more tokens per warp only added instructions, more warps per token added cross-warp reductions);
#: the interpreter takes more tokens per program (fewer, wider numpy ops)
WRITER_BLOCK_T = 1
WRITER_NUM_WARPS = 1
WRITER_BLOCK_T_INTERPRETER = 32
#: the protected-tile kernel (one tile of sink/local tokens a program): 16 tokens over 8 warps. Offline (triton 3.7.1,
#: sm_90, C4R4 H16, bfloat16 queries; registers / spilled bytes / SASS): 32 tokens over 4 warps 255 / 520 / 4,320,
#: over 8 warps 255 / 176 / 3,264; 16 over 4 warps 255 / 168 / 3,456, over 8 warps 255 / 24 / 2,576. Sink 4 + local
#: 128 make 9 tiles, split into parts by ``protect_parts``
PROTECT_BLOCK_T = 16
PROTECT_WARPS = 8
#: one stage: the protected-tile kernel's loop (a run of tiles a program) is short, and Triton's software pipelining of
#: its loads would take the shared memory the combine kernel needed before stop 45 (166,912 B at 32 tokens)
PROTECT_STAGES = 1
#: query rows a protected-tile program may take (``QUANTMLA_TRITON_PROTECT_ROWS``; the plans take 16, kernel v3's
#: :func:`v3_protect_rows`). Offline
#: (triton 3.7.1, sm_90, C4R4 H128, 16 tokens, 8 warps; registers / spilled bytes / shared memory): 16 rows 255 / 0 /
#: 51,200 B (mma.sync); 32 rows 255 / 224 / 69,632 B; 64 rows 255 / 372 / 131,072 B (wgmma). At H128 16 rows read
#: every protected tile 8 times a request, 64 rows twice: 64 paid where the SMs are full (stop 49, v3_protect_rows)
PROTECT_ROWS_CHOICES = (16, 32, 64)
#: programs of the protected-tile kernel an SM holds at once (8 warps x 255 registers fill the register file)
PROTECT_CTAS_PER_SM = 1
#: float32 queries use IEEE float32 dots (operands twice as wide, no tensor cores); measured on
#: an H200: 32-token tiles with 2 stages asked for 258,048 B of shared memory (limit 232,448),
#: so float32 runs 16-token tiles, one stage, and 16-token protected tiles.
FP32_MAX_BLOCK_N = 16
FP32_NUM_STAGES = 1
#: the merge kernel (``attention_kernel.merge_kernel``): a program merges MERGE_BLOCK_R query rows x MERGE_BLOCK_C
#: channels of one request in one pass (a running maximum), reading up to MERGE_SPLITS_A_LOAD partials with one load
#: ([16, 16, 32] float32: 64 registers a thread over 4 warps) and their log-sum-exps beside it (:func:`merge_load_width`).
#: H16 B8 L4K's 32 splits and 9 protected parts are then three round trips to memory. Its first form (stop 45) found
#: the maximum first and loaded each output after its weight: nine round trips there, six at H128 B8 L4K (8 splits,
#: 2 parts), where it took 36 us of a 229 us call and this one takes 11 (H100, stop 48: the call 203 us). At H16 B8 L4K
#: both take ~10 us: 128 programs (one a SM) of three round trips each are bound by latency, not instructions
MERGE_BLOCK_R = 16
MERGE_BLOCK_C = 32
MERGE_SPLITS_A_LOAD = 16
MERGE_WARPS = 4
#: which launches use programmatic dependent launch where the GPU has it (attention.PDL_ENV: 0 none, 1 the merge, 2
#: the merge and the protected tiles after the split kernel): a kernel's programs are placed and wait on the GPU while
#: the one before it finishes, instead of starting after it ends. See :func:`pdl_default`
PDL_MODES = (0, 1, 2)


def pdl_default(variant: str) -> int:
    """The PDL mode a call of split kernel ``variant`` takes unless ``QUANTMLA_TRITON_PDL`` says otherwise: 2 for v3,
    1 for v1 and v2. H100, CUDA graphs, C4R4, twice each (stop 49; modes 0 / 1 / 2, 16 protected rows): H16 B8 L4K
    48.5-48.9 / 47.9 / 50.1-50.2 us (C2R4 46.3-46.7 / 45.4-45.5 / 47.8), H16 B32 L4K 116.8 / 116.3 / 114.3-114.5,
    H16 B128 L4K - / 359.9-360.5 / 359.2-365.0, H16 B32 L32K 647 / 646 / 645; kernel v3: H128 B8 L4K 200.4-201.4 /
    200.4-200.7 / 193.5-193.8, B32 L4K - / 470.2-473.3 / 460.9-461.5, B128 L4K - / 1,681-1,682 / 1,660-1,661, B32
    L32K - / 2,546 / 2,530-2,532. Mode 1 never lost (I had predicted 3-5 us at H16 B8 L4K; it took 0.6-1.0); mode 2
    gained at every v3 shape and lost 1.5 us at H16 B8 L4K, the shape nearest its 1.5x target."""
    return 2 if variant == "v3" else 1  # v4 signals no dependents early: mode 2 would only serialise its protect


def merge_load_width(partials: int) -> int:
    """Partials the merge loads at a time from a source of ``partials`` (splits or protected parts): the power of two
    that covers them, 2 to :data:`MERGE_SPLITS_A_LOAD` (fewer masked lanes where a source is short)."""
    width = 2
    while width < min(partials, MERGE_SPLITS_A_LOAD):
        width *= 2
    return width


#: a bound on the shared memory a block any planned launch needs at d_c <= 512 and d_r <= 64: the combine kernel's
#: 166,912 B on NVIDIA at 512 / 64 until stop 45 (offline builds, triton 3.7.1); its successors need less (the
#: protected-tile kernel 32,768 B at 16 tokens, the merge 1,024 B, stop 45), and the bound stays. Devices that give a
#: block at least this much (A100: exactly this, H100/H200: 232,448 B) run those plans without the warm-up builds that
#: check them. Wider vectors need more (sm_90, triton 3.7.1, stop 42: v1 177-193 KB and v3 185-197 KB at d_c 1024), so
#: there every GPU checks.
PLANNED_SHARED_MAX = 166912
PLANNED_DIMS_MAX = (512, 64)
#: Blackwell's tensor memory (sm_100 and later): 512 32-bit columns an SM. Triton 3.7.1 builds a kernel whose
#: accumulators need more as a kernel that traps at once (kernel v3 at d_c 512 needs 832-1,152, stop 42), so the
#: launcher checks every build on such GPUs.
TMEM_COLUMNS = 512


def planned_shared_max(latent_dim: int, rope_dim: int) -> int | None:
    """The most shared memory a block the plans need at these dims where it is known (:data:`PLANNED_SHARED_MAX`),
    None where not (check every build)."""
    if latent_dim <= PLANNED_DIMS_MAX[0] and rope_dim <= PLANNED_DIMS_MAX[1]:
        return PLANNED_SHARED_MAX
    return None


@dataclass(frozen=True)
class DeviceLimits:
    """What a GPU gives one block that a planned launch may exceed: ``shared`` bytes of shared memory and ``tmem``
    columns of tensor memory; None where no plan can exceed it (nothing to check)."""

    shared: int | None = None
    tmem: int | None = None

    @property
    def checked(self) -> bool:
        return self.shared is not None or self.tmem is not None

    def excess(self, need: tuple[int, int]) -> str | None:
        """Why a build that needs ``need`` = (shared bytes, tensor-memory columns) does not fit, or None."""
        shared, tmem = need
        why = []
        if self.shared is not None and shared > self.shared:
            why.append(f"{shared} B of shared memory a block, this GPU gives {self.shared} B")
        if self.tmem is not None and tmem > self.tmem:
            why.append(f"{tmem} columns of tensor memory, an SM has {self.tmem}")
        return "needs " + " and ".join(why) if why else None


@dataclass(frozen=True)
class AttentionPlan:
    block_n: int
    block_r: int
    row_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    protect_block_r: int
    protect_warps: int
    protect_block_t: int = PROTECT_BLOCK_T


def _pow2_at_least(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@functools.lru_cache(maxsize=4096)
def protect_parts(tiles: int, programs: int, sm_count: int) -> tuple[int, int]:
    """(parts, tiles a part) of ``tiles`` protected tiles for ``programs`` = B x row blocks.

    Where the programs leave some of the :data:`PROTECT_CTAS_PER_SM` x ``sm_count`` slots empty, the parts that take
    the fewest tile-times: waves of ``programs x parts`` programs times tiles a part (fewer parts on a tie: each part
    is one more partial for the merge). H128 B8 (64 programs, 9 tiles, 132 SMs): 2 parts, one wave of 5 tiles, not 3
    parts in two waves of 3. Where B x row blocks fill the slots alone, one part: a partial a request and row block
    (B 1024 x 8 row blocks x 9 tiles would be 2.4 GB of float32 partials at d_c 512 with one tile a part)."""
    if tiles <= 0:
        return 0, 0
    slots, programs = PROTECT_CTAS_PER_SM * sm_count, max(1, programs)
    if programs >= slots:
        return 1, tiles
    best = (tiles, 1, tiles)  # (tile-times, parts, tiles a part) of one part
    for per in range(tiles - 1, 0, -1):
        parts = -(-tiles // per)
        best = min(best, (-(-programs * parts // slots) * per, parts, per))
    return best[1], best[2]


@functools.lru_cache(maxsize=4096)  # pure; a decode step asks for the same plan on every layer
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
        num_splits = plan_kv_splits(batch * row_blocks, tiles, CTAS_PER_SM * sm_count, min_tiles, MAX_SPLITS)[0]
    protect_block_r = MIN_DOT_N
    return AttentionPlan(block_n, block_r, row_blocks, int(num_splits), num_warps,
                         FP32_NUM_STAGES if gpu_fp32 else 2, protect_block_r, PROTECT_WARPS)


# ------------------------------------------------------------------ attention kernel v2
# (attention_v2_kernel.py; the default for packed formats with bfloat16 queries, see attention.auto_variant). The register numbers
# below come from compiling the kernel offline for sm_90a (triton 3.7.1's own ptxas, 16-byte
# aligned pointers as the runtime specialises them), C4R4, d_c = 512, bf16 queries:
#   64-token tile, 16 rows, 4 warps, 1 stage, bytes re-loaded for PV: 255 regs, 76 B spilled
#     (2 stages: 844 B; bytes held in registers for PV: 736 B; PV as P^T @ codes: 1,048 B)
#   32 rows, 4 warps: 1,812 B; 32 rows, 8 warps: 804 B; 64 rows, 8 warps: 3,560 B
#   d_c = 256: 16 rows 207 regs, no spill; 32 rows, 4 warps: 255 regs, 68 B
#   float32 queries (IEEE float32 dots, no tensor cores): 37,926 B spilled
#: tokens per tile = the M dimension of every v2 product: 64 is the row count of one Hopper
#: wgmma of a 4-warp warpgroup (the compiled kernel issues wgmma m64n16k16 for QK and PV).
#: Pages of 16/32 tokens make a tile span pages (one table lookup per token, not per tile).
V2_BLOCK_N = 64
#: float32 output state (DC x BLOCK_R over the program's threads). 64 registers per thread is
#: what the measured no-/low-spill kernels hold (d_c = 512 at 16 rows, d_c = 256 at 32 rows,
#: 4 warps); more rows per program spill (table above), so H = 128 still runs 8 row blocks
#: at d_c = 512 until an H200 run shows wider blocks pay (probe knobs block_r 32/64, 8 warps).
V2_ACC_REGS_PER_THREAD = 64
V2_NUM_WARPS = 4
#: a split costs one BLOCK_R x DC float32 partial written and read back: keep >= 128 tokens
#: (2 tiles) per split, as v1 (4 tiles of 32)
V2_MIN_TILES_PER_SPLIT = 2
#: one stage: a second one (software-pipelined loads) raised spills from 76 B to 844 B
V2_NUM_STAGES = 1
#: PV re-loads the tile's bytes (L1/L2 hits) instead of keeping them in registers (spills above)
V2_HOLD_RAW = False
#: zero points applied on the operand (``code - zero`` by one ``sub.bf16x2`` per element pair)
#: instead of the correction terms (query sums in QK, a cross-warp token reduction per slice in
#: PV). Offline: C4R4 spills 4 B instead of 76, C2R4 148 B instead of 264. Off until the H200
#: times both (probe column ``v2z``).
V2_ZSUB = False
#: kernel v2 takes 2- and 4-bit codes from 32-bit words in the quad order of its ``wgmma`` register operand
#: (``attention_v2_kernel._word_plane``; the ``word_codes`` override). Off: stop 50 timed words in v2 slower on an
#: H100 (11-22 %), in the order that staged the operand through shared memory; stop 51 built the quad order, which
#: made kernel v3's 2-bit content 13 % faster, and left v2's untimed (no device time was left). Offline sm_90a tile
#: loop, instructions a thread: C4R4 3,484 -> 2,461, C2R4 3,286 -> 2,474 (attention_v2_kernel's docstring); with
#: V2_ZSUB as well 1,910 and 1,899, nothing spilled
V2_CODE_WORDS = False
#: float32 queries on a GPU run v1: v2's IEEE float32 dots spill ~37 KB (table above). The
#: interpreter runs v2 in float32 (that is how its math is checked without a GPU).
V2_FLOAT32_ON_GPU = False


@functools.lru_cache(maxsize=4096)
def plan_v2(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
            interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False) -> AttentionPlan:
    """Launch plan of attention kernel v2 (same fields and split rule as :func:`plan`)."""
    block_n = V2_BLOCK_N
    num_warps = V2_NUM_WARPS
    threads = num_warps * THREADS_PER_WARP
    cap = max(MIN_DOT_N, V2_ACC_REGS_PER_THREAD * threads // latent_dim)
    cap = 1 << (cap.bit_length() - 1)  # a power of two (tl.arange extent)
    block_r = max(MIN_DOT_N, min(_pow2_at_least(rows), cap))
    row_blocks = -(-rows // block_r)
    tiles = max(1, -(-max_tokens // block_n))
    if num_splits is None:
        min_tiles = MIN_TILES_PER_SPLIT_INTERPRETER if interpreter else V2_MIN_TILES_PER_SPLIT
        num_splits = plan_kv_splits(batch * row_blocks, tiles, CTAS_PER_SM * sm_count, min_tiles, MAX_SPLITS)[0]
    return AttentionPlan(block_n, block_r, row_blocks, int(num_splits), num_warps, V2_NUM_STAGES, MIN_DOT_N,
                         PROTECT_WARPS)


# ------------------------------------------------------------------ attention kernel v3
# (attention_v3_kernel.py: 64 query rows per program, for requests with many query rows)
#: query rows per program: one Hopper wgmma row block (64 rows per 4-warp warpgroup)
V3_BLOCK_R = 64
#: kernel v3 runs (``attention.auto_variant``) from this many query rows (S_q x H) per request:
#: below one full row block the 16-row kernel v2 wastes less of every product
V3_MIN_ROWS = 64
#: tokens per tile = the M dimension of QK: Triton puts all 8 warps of a dot that feeds another
#: dot along M, so 128 tokens give each warpgroup its own 64 (64 would compute QK twice). H200,
#: C4R4 H=128 B=32 L=32K: 128 tokens 2,593 us, 64 tokens 3,882 us (stop 17)
V3_BLOCK_N = 128
#: the float32 output state is BLOCK_R x DC = 128 KB at d_c 512: 128 registers per thread
#: over 8 warps (4 warps would need 256)
V3_NUM_WARPS = 8
#: H200, C4R4 H=128 B=32 L=32K: 2 stages 2,903 us (190 spilled registers) against 2,593 with 1
V3_NUM_STAGES = 1
#: load every run of code bytes of a tile before its first product, so their latencies overlap
#: (one program per SM leaves nothing else to hide them); H200: 2,593 us against 2,626 without
V3_PREFETCH = True
#: one program per SM (8 warps x ~255 registers fill the register file)
V3_CTAS_PER_SM = 1
#: a split writes a BLOCK_R x DC float32 partial (128 KB) that the merge reads back
V3_MIN_TILES_PER_SPLIT = 4
#: content code widths (bits) whose codes kernel v3 takes from 32-bit words (``code_words``; the RoPE codes follow the
#: content's choice). H200, CUDA graphs, stop 50, H128 B32 L32K: C4R4 2,590-2,604 us with bytes before the change,
#: 2,339 with bytes and packed bfloat16 scaling, 1,767 with portable words, 1,658-1,673 with words split in PTX; C2R4
#: 2,574 / 1,959 / 2,222 / 2,082 (more spilled registers with words: 860 bytes against 664). 2-bit content joined in
#: stop 51 with the quad order of V3_WORD_LANES. Kernel v2 (H = 16) took words too and ran 11-22 % slower with them on
#: an H100 (stop 50); stop 51 rebuilt them in the quad order, off until timed (V2_CODE_WORDS)
V3_CODE_WORDS_BITS = (2, 4)
#: threads of a quad that split a chunk's code words in kernel v3 (``attention_v3_kernel._word_operand``), by content
#: bits. 1 puts a row's words in consecutive columns: QK's operand is built in the words' layout and changes layout
#: through shared memory as bfloat16. 4 orders the columns so that each thread of a quad dequantizes its own words
#: straight into QK's register operand: the raw words and one row of the tile's scales and zeros change layout instead.
#: H100, CUDA graphs, stop 51, 4 against 1 (2-bit: against bytes): C2R4 H128 B32 L32K 1,924-1,933 -> 1,671-1,672 us,
#: H16 B32 L32K S_q 4 1,035-1,040 -> 917-919, H128 B8 L4K 178-182 -> 177-178; C4R4 slower with 4 (1,640-1,646 ->
#: 1,826-1,828 us at H128 B32 L32K; offline it spilled 712 bytes against 588, 648 against 540 with triton 3.6.0)
V3_WORD_LANES = {2: 4, 4: 1}


#: content bits whose code words in quad order (V3_WORD_LANES 4) take the tile's scales and zeros in one load of each
#: token's row per path (``attention_v3_kernel._tile_groups``) rather than each chunk its own groups. Stop 51 timed
#: C2R4 with the tile's (1,671-1,672 us at H128 B32 L32K, H100). Offline sm_90a, instructions / spilled bytes: C2R4
#: 2,842 / 596 with the tile's, 2,896 / 764 per chunk; C4R4 (quad order) 2,922 / 712 and 2,879 / 528, untimed
V3_TILE_GROUPS_BITS = (2,)


def v3_tile_groups(content_bits: int) -> bool:
    """Kernel v3's ``TILE_GROUPS`` for content of ``content_bits`` (V3_TILE_GROUPS_BITS)."""
    return content_bits in V3_TILE_GROUPS_BITS


def v3_word_lanes(content_bits: int) -> int:
    """Kernel v3's ``WORD_LANES`` for content of ``content_bits`` (V3_WORD_LANES; 1 where no words are taken)."""
    return V3_WORD_LANES.get(content_bits, 1)


def v3_code_words(content_bits: int) -> bool:
    """Whether kernel v3 takes codes of ``content_bits`` from 32-bit words by default (V3_CODE_WORDS_BITS)."""
    return content_bits in V3_CODE_WORDS_BITS


def v3_protect_rows(batch: int, rows: int, sm_count: int) -> int:
    """Query rows a protected-tile program takes beside kernel v3: 64 where blocks of 16 rows alone (``batch`` x
    ``rows`` / 16 programs) would fill the SMs, so that each program reads a request's sink and ring for 64 rows, not
    16; else 16, leaving the spare SMs to :func:`protect_parts`. H100, C4R4, CUDA graphs, twice each (stop 49; 16 / 64
    rows with PDL mode 2): H128 B8 L4K 193.6-193.8 / 198.4-198.8 us (64 programs of 16 rows), B32 L4K 460.9-461.5 /
    434.9-436.0, B128 L4K 1,660-1,661 / 1,506-1,507, B32 L32K 2,530-2,532 / 2,506-2,507."""
    fills = batch * -(-rows // MIN_DOT_N) >= PROTECT_CTAS_PER_SM * sm_count
    return V3_BLOCK_R if rows >= V3_BLOCK_R and fills else MIN_DOT_N


@functools.lru_cache(maxsize=4096)
def plan_v3(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
            interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False,
            block_r: int = V3_BLOCK_R, ctas_per_sm: int = V3_CTAS_PER_SM) -> AttentionPlan:
    """Launch plan of attention kernel v3 (same fields and split rule as :func:`plan`) over row blocks of ``block_r``
    query rows, splits for ``ctas_per_sm`` programs an SM (kernels v5 and v6 plan their 16-row blocks so)."""
    row_blocks = -(-rows // block_r)
    tiles = max(1, -(-max_tokens // V3_BLOCK_N))
    if num_splits is None:
        min_tiles = MIN_TILES_PER_SPLIT_INTERPRETER if interpreter else V3_MIN_TILES_PER_SPLIT
        num_splits = plan_kv_splits(batch * row_blocks, tiles, ctas_per_sm * sm_count, min_tiles, MAX_SPLITS)[0]
    return AttentionPlan(V3_BLOCK_N, block_r, row_blocks, int(num_splits), V3_NUM_WARPS, V3_NUM_STAGES,
                         v3_protect_rows(batch, rows, sm_count), PROTECT_WARPS)


# ------------------------------------------------------------------ attention kernel v4
# (attention_v4_kernel.py: kernel v3's grid and partials in Gluon, a dequantizing and an attending warpgroup)
#: warps of the attending (default) partition; the loader partition adds its own 4 or 8 (:data:`V4_LOADER_WARPS`)
V4_NUM_WARPS = 4
#: what kernel v4 is built for: pages of these formats at these (d_c, d_r) with 64-token pages, on sm_90
V4_FORMATS = ("BF16", "C4R4", "C2R4")
V4_DIMS = (512, 64)
V4_PAGE_SIZE = 64
#: compute capability (major) of the Hopper warpgroup MMAs and register reallocation it is written for
V4_CAPABILITY_MAJOR = 9


def v4_format_unsupported(fmt, kernel: str = "kernel v4") -> str | None:
    """Why ``kernel`` (v4, or v5, which reads what v4 reads) cannot read pages of ``fmt`` (a ``PackFormat``: its name,
    dims and page size), or None."""
    if fmt.name not in V4_FORMATS:
        return f"{kernel} reads pages of {'/'.join(V4_FORMATS)}, got {fmt.name}"
    if (fmt.latent_dim, fmt.rope_dim) != V4_DIMS:
        return f"{kernel} is built for (d_c, d_r) = {V4_DIMS}, got ({fmt.latent_dim}, {fmt.rope_dim})"
    if fmt.page_size != V4_PAGE_SIZE:
        return f"{kernel} reads {V4_PAGE_SIZE}-token pages, got page_size={fmt.page_size}"
    return None

#: whether ``auto`` runs kernel v4 where it would run v3 and v4 serves the call (:func:`attention.v4_unsupported`). On:
#: on an H100 (stop 55, CUDA graphs, H128, FlashInfer BF16 in the process) v4's default builds (:data:`V4_PIPELINE`)
#: took 0.44-0.52x of v3's time at B32 and B128 L32K (C4R4 819 against 1,621 us, C2R4 717 against 1,646) and
#: 0.40-0.46x at B8 L4K, and passed its GPU tests and memcheck
V4_AUTO = True
#: query rows (S_q x H) from which ``auto`` runs kernel v4 over packed pages where it would run kernel v2 (below
#: :data:`V3_MIN_ROWS`) and v4 serves the call; v4 masks the rows of its 64-row block past them, so a block of 16 rows
#: costs it what one of 64 does. Kernel v5 goes first up to :data:`V5_MAX_ROWS`. H100, CUDA graphs, FlashInfer BF16
#: in the process (stop 64, ``run_h200_kernels.sh stop64a``; v4 matched the reference and v5 on the few-row GPU cases
#: of ``tests/test_triton_v5.py``), v2 / v4 / v5, us: H16 S_q 2 B32 L32K (32 rows) C4R4 1,180 / 328 / 533, C2R4
#: 1,071 / 315 / 514; H16 S_q 1 B32 L32K C4R4 646 / 321 / 287, C2R4 592 / 310 / 274
V4_MIN_ROWS = 1
#: kernel v4's build per page format (``QUANTMLA_TRITON_V4_PIPELINE`` overrides it): 0, pages in turn (the loader loads
#: a page's bytes once its key slot is free; the attender's output product runs beside its next QK); 1, pipelined (the
#: packed loader loads page i + 1's bytes during page i's output product, the attender hands a key slot back before
#: its next QK, the row blocks of a request launch side by side); 2, as 1 with only the content words loaded a page
#: ahead (the scales, zeros and RoPE bytes once the key slot is free: C4R4's loader no longer spills); over BF16 pages
#: it copies page i while it runs the output product of page i - 1; 3, as 1 with the attender's product of page i - 1
#: retired beside QK(i), as in 0 (build 1's three changes apart: stop 56, C4R4 879 against 891 us, C2R4 782 against
#: 717, BF16 pages 785 against 680, H128 B32 L32K, 4 loader warps). H100, stop 55,
#: CUDA graphs, builds 0 / 1 / 2, us: H128 B32 L32K C4R4 915 / 885-886 / 819, C2R4 889 / 717-718 / 793; B128 L32K
#: C4R4 3,653 / 3,446-3,448 / 3,244, C2R4 3,512 / 2,824-2,825 / 3,005; H64 B32 L32K C4R4 483 / 443 (1 / 2), C2R4
#: 400 / 427; BF16 pages B32 L32K 793 / 682 (0 / 1). Stop 56 (H100, H128 B32 L32K, :data:`V4_LOADER_WARPS`): builds
#: 1 / 2 with 4 loader warps C4R4 882 / 819, C2R4 722 / 798, BF16 684 / 671; with 8, 697 / 759, 674 / 722, 728 / 655.
#: 4 (packed pages only): as 1, but the loader's output product of page i - 1 is left in flight while it converts page
#: i + 1's low channels and RoPE keys, and retired before it overwrites the high ones (its share of ``kempty`` goes).
#: Stop 59 (H100, 8 loader warps, protected tokens inline, CUDA graphs, twice each), builds 1 / 4, us: C2R4 H128 B32
#: L32K 618.1, 618.2 / 595.1, 596.2; B128 L32K 2,377.5, 2,372.1 / 2,338.3, 2,375.7; B8 L4K 47.5, 47.0 / 46.7, 46.4; H64
#: B32 L32K 328.6, 327.6 / 319.8, 320.2; C4R4 H128 B32 L32K 640.4, 643.0 / 645.2, 655.6, B8 L4K 48.4, 49.1 / 48.1, 48.1
V4_PIPELINE = {"BF16": 2, "C4R4": 1, "C2R4": 4}
#: kernel v4's loader warps per page format (``QUANTMLA_TRITON_V4_LOADER_WARPS`` overrides it): 4, one warpgroup
#: dequantizes (or copies) each page and runs the output product over the high half of the channels; 8, two do, each
#: taking half of the page's tokens and half of those channels (the attender then keeps 232 registers, the loader
#: 136). Stop 56's probes (H100, H128 B32 L32K, CUDA graphs) put the time in the 4-warp loader's dequantization:
#: without it C4R4 took 552 against 816 us, C2R4 555 against 717; without its output product, no less. With 8 (stop
#: 56, same shape, FlashInfer BF16 564.6 us in the process) the best builds took C4R4 697 us (4 warps: 819), C2R4 674
#: (722), BF16 pages 655 (671)
V4_LOADER_WARPS = {"BF16": 8, "C4R4": 8, "C2R4": 8}
#: whether kernel v4's last split attends to the protected tokens (bfloat16 protection) instead of the protected-tile
#: kernel (``QUANTMLA_TRITON_V4_INLINE_PROTECT`` overrides it). Stop 57 (H100, 8 loader warps, CUDA graphs, FlashInfer
#: BF16 in the process), inline against not, C4R4 / C2R4 / BF16 pages: H128 B8 L4K 49.0 / 48.1 / 51.3 us against
#: 69.3 / 67.5 / 69.5, B32 L32K 715 / 660 / 620 against 693 / 662 / 651, B128 L32K 2,632 / 2,468 / 2,498 against
#: 2,675 / 2,528 / 2,585
V4_INLINE_PROTECT = True
#: kernel v4 over packed pages keeps its key tiles in ``channel_of`` order where a split reads at least this many table
#: pages (:func:`v4_channel_order`; ``QUANTMLA_TRITON_V4_CHANNEL_ORDER`` overrides it). The order spares the loader's
#: byte permutes on every page but costs a few us a call: the queries and the protected rows rearranged in registers,
#: and the merge kernel's sums put back in plain order (in registers since stop 59: at H128 B8 L4K, order forced on,
#: the merge kernel took 10.3 us against 12.8 with stores through ``channel_of``). H100, 8 loader warps, protected
#: tokens inline, CUDA graphs, H128 B32, C4R4 / C2R4, the order against the plain one in the same tree: stop 59, L8K (64
#: pages a split) 182.5 / 179.6 us against 186.5 / 183.0, L16K (128) 334.9 / 325.2 against 346.2 / 334.5 (stop 58,
#: merge storing through the map: L8K 195.5 / 191.6 against 185.6 / 183.1, L16K 344.6 / 339.5 against 345.5 / 336.3);
#: stop 58, L32K (256) 650.0 / 629.7 against main's plain 698.3 / 666.4. Below 64 pages the order loses (stop 59, plain
#: against the order): B8 L4K (8 pages) 48.0 / 47.6 against 56.6 / 55.2, B8 L8K (16) 69.0 / 67.1 against 75.4 / 73.6,
#: B32 L4K (32) 106.8 / 106.4 against 108.8 / 108.2; at 64, B128 L4K 378.8 / 369.5 against 374.7 / 369.8
V4_CHANNEL_ORDER_MIN_PAGES = 64


def v4_channel_order(table_pages: int, num_splits: int) -> bool:
    """Whether kernel v4 runs over packed pages in ``channel_of`` order: a split reads at least
    :data:`V4_CHANNEL_ORDER_MIN_PAGES` of the ``table_pages`` pages a request's block table holds."""
    return -(-table_pages // max(num_splits, 1)) >= V4_CHANNEL_ORDER_MIN_PAGES


def plan_v4(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
            interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False) -> AttentionPlan:
    """Launch plan of attention kernel v4: kernel v3's tiles, row blocks and splits (the same grid and partials),
    with :data:`V4_NUM_WARPS` warps in the launch's default partition."""
    return replace(plan_v3(batch, rows, latent_dim, page_size, max_tokens, sm_count, interpreter, num_splits, fp32_dot),
                   num_warps=V4_NUM_WARPS)


# ------------------------------------------------------------------ attention kernel v5
# (attention_v5_kernel.py: few query rows a program, the 64 tokens of a page as the wgmma M dimension; v4's formats,
# dims, page size and device)
#: warps of the attending (default) partition; the converter partition adds :data:`V5_LOADER_WARPS`
V5_NUM_WARPS = 4
#: the converter's warps (the kernel's ``LOADER_WARPS``): 8, as kernel v4's loader since stop 56
V5_LOADER_WARPS = 8
#: query rows a program up to 16 rows a request (``QUANTMLA_TRITON_V5_BLOCK_R`` overrides it): 16, one request at H16
#: S_q 1 (the wgmma N); above 16 rows :data:`V5_BLOCK_R_WIDE`. H100, CUDA graphs (stop 65), H16 B32 L32K: 16 rows a
#: program 288.0 us (C4R4) / 277.0 (C2R4), 32 rows 295.9 / 287.8 (the output's 128 floats a thread)
V5_BLOCK_R = 16
#: query rows a program from 17 rows a request: 32 (H16 S_q 2 in one program, each page converted once). H100, CUDA
#: graphs (stop 65), H16 S_q 2 B32 L32K: 298.0 us (C4R4) / 296.7 (C2R4), against 537.0 / 517.6 with two programs of
#: 16 rows and kernel v4's 327.7 / 314.3
V5_BLOCK_R_WIDE = 32
V5_BLOCK_R_CHOICES = (16, 32)
#: pages between a packed page's loads and its conversion (``QUANTMLA_TRITON_V5_AHEAD`` overrides it): 1 or 2
#: (offline sm_90a at 16 rows: no spills with either; at 32 rows 2 spilled 20 bytes). H100, CUDA graphs, 1 / 2, us
#: (stop 65, one process): H16 B32 L32K C4R4 288.0 / 281.7, C2R4 277.0 / 271.1; B128 L32K 1,070.7 / 1,044.8, 1,020.8 /
#: 981.3; B8 L4K 34.1 / 34.8, 33.8 / 34.1. 2 passed its GPU tests (stop 65: builds a2pc and a2r32), so it is the
#: default: 2-4 % faster from 32K tokens, 1-2 % slower at B8 L4K (still 1.05x FlashInfer BF16, target 1.5x)
V5_AHEAD = 2
#: ... beside two attenders: 1 (their 4 converter warps holding two pages spill 214 bytes, offline sm_90a C4R4)
V5_AHEAD_2A = 1
V5_AHEAD_CHOICES = (1, 2)
#: attending warpgroups a program (``QUANTMLA_TRITON_V5_ATTENDERS`` overrides it; 2 at 16 rows a program only): with
#: one, a page's QK, softmax and output product run back to back and the converter fills the other key slot; with
#: two, each takes every other page on its own slot, so that one's softmax runs beside the other's products and the
#: converter fills a slot while the other attender works (attender 1's sums merged into attender 0's at the end).
#: Offline sm_90a (C4R4 / C2R4 / BF16, 16 rows, 4 converter warps): 203 KB of shared memory, 56-108 bytes spilled
#: (loop-invariant scalars reloaded, ~13-26 loads a page). H100, CUDA graphs (stop 66, timed only, its GPU tests not
#: run), two against one: H16 B32 L32K C4R4 295.8 / 280.4 us, C2R4 281.8 / 267.0; B128 L32K 1,069.1 / 1,033.5,
#: 1,040.5 / 974.6; B8 L4K 37.5 / 34.7, 36.4 / 33.7: 1 stays
V5_ATTENDERS = 1
V5_ATTENDERS_CHOICES = (1, 2)
#: the converter's warps beside two attenders (``QUANTMLA_TRITON_V5_LOADER_WARPS`` overrides it, 4 or 8): 4, since
#: with 8 the 16 warps leave 128 registers a thread and the build spills 124-132 bytes (offline sm_90a)
V5_LOADER_WARPS_2A = 4
#: whether ``auto`` runs kernel v5 over packed pages for at most :data:`V5_MAX_ROWS` query rows (in kernel v2's place)
#: where v5 serves the call. On: on an H100 (stop 64, ``run_h200_kernels.sh stop64a``) v5 passed its GPU tests
#: (``tests/test_triton_v5.py``, 74 cases, against the reference and kernel v4) and memcheck, and took 0.43-0.46x of
#: v2's time and 0.87-0.89x of v4's at H16 from 32K tokens (CUDA graphs, :data:`V5_AHEAD` 1: B32 L32K C4R4 287 us, v4
#: 321, v2 646, FlashInfer BF16 420), B8 L4K 34.1 (v4 38.5, v2 48.4, FlashInfer 32.7)
V5_AUTO = True
#: query rows up to which ``auto`` takes kernel v5: 32 (H16 S_q 2 as one program of :data:`V5_BLOCK_R_WIDE` rows a
#: request: 298.0 / 296.7 us at B32 L32K C4R4 / C2R4 against kernel v4's 327.7 / 314.3, H100, stop 65); v4 above
V5_MAX_ROWS = 32


def v5_block_r(rows: int) -> int:
    """Kernel v5's query rows a program for ``rows`` rows a request: :data:`V5_BLOCK_R` up to 16, else
    :data:`V5_BLOCK_R_WIDE`."""
    return V5_BLOCK_R if rows <= V5_BLOCK_R else V5_BLOCK_R_WIDE


# ------------------------------------------------------------------ attention kernel v6
# (attention_v6_kernel.py: kernel v5's transposed products with QK's keys dequantized straight into registers, one
# warpgroup a program and two programs an SM; C4R4 / C2R4 pages at v4's dims and page size, on sm_90; the protected
# tokens by the protected-tile kernel, or in its last split: V6_INLINE_PROTECT)
#: warps of a program (one warpgroup, no warp specialization)
V6_NUM_WARPS = 4
#: programs an SM (86 KB of shared memory each): the split rule fills the GPU with this many
V6_CTAS_PER_SM = 2
#: the page formats kernel v6 reads
V6_FORMATS = ("C4R4", "C2R4")
#: query rows a program: 16, the ``wgmma`` N (an H16 S_q 1 request)
V6_BLOCK_R = 16
#: when a page's bytes are loaded (``QUANTMLA_TRITON_V6_AHEAD`` overrides it): 0, at the page's start; 1, a page
#: ahead (page i + 1's bytes in registers while page i is converted); 2, two 64-byte chunks ahead, rolling across
#: pages (chunk c + 2 loaded as chunk c is converted, the next page's scales with its first chunk). Offline sm_90a
#: (triton 3.7.1, stop 66, no spills, 3 CTA barriers a page; 10 with triton 3.6), C4R4 / C2R4 instructions a warp in
#: the page loop: 0: 1,152 / 1,157 (221 / 206 registers), 1: 1,234 / 1,243 (249 / 246), 2: 1,193 / 1,231 (224 / 245).
#: H100, CUDA graphs
#: (stop 66, an earlier build: 40-228 bytes spilled, 7 barriers a page), H16 B32 L32K: 0 took C4R4 298.3 / C2R4 252.1
#: us, 1 289.5 / 278.3 (v5 280.4 / 267.0). The spill-free build (stop 67, H100, CUDA graphs, protected tokens by the
#: protected-tile kernel), C4R4 / C2R4: 1 took 224.4 / 213.2 us at H16 B32 L32K, 788.5 / 752.4 at B128 L32K, 39.6 /
#: 38.4 at B8 L4K; 2 took 238.9 / 214.3, 838.0 / 749.5, 43.8 / 39.8 (v5 278.3 / 269.1, 1,030.3 / 981.4, 34.5 / 34.2)
V6_AHEAD = 1
V6_AHEAD_CHOICES = (0, 1, 2)
#: whether ``auto`` runs kernel v6 over the packed pages it reads for at most :data:`V6_BLOCK_R` query rows a request
#: (in kernel v5's place) where v6 serves the call. On since stop 67 (H100, CUDA graphs, the timings at
#: :data:`V6_AHEAD`): v6 took 19-24 % less time than v5 from 32K tokens at H16 S_q 1. Not above 16 rows: at H16 S_q 2
#: each page is converted once a 16-row program, and v6 took 383-406 us against v5's 292-302 (B32 L32K)
V6_AUTO = True
#: ``auto`` runs kernel v6 only where the block table holds at least this many tokens a request (its capacity, known
#: when a call is prepared; below it v5). H100, CUDA graphs (stop 67), H16 S_q 1, v6 against v5, C4R4 / C2R4: B8 L4K
#: 39.3 / 38.5 against 34.4 / 33.8 us; B8 L32K 82.8 / 76.2 against 90.0 / 86.8. Between 4K and 32K not measured: the
#: rule sits where CuPy's (``backends/cupy/variants.py``) does
V6_MIN_TABLE_TOKENS = 16384
#: whether kernel v6's last split attends to the protected tokens itself (``QUANTMLA_TRITON_V4_INLINE_PROTECT``
#: overrides it, as for v4 and v5). Off: v6 walks the bfloat16 rows through the same per-page loop as codes, each
#: 64-channel plane moved into QK's A operand through shared memory (the loop: 1,554 instructions a warp and 37
#: barriers a page, offline sm_90a with triton 3.7.1, against a packed page's 1,233 and 3), and the last split's
#: extra pages set the call's length. H100, CUDA graphs (stop 67), H16 S_q 1, inline against the protected-tile
#: kernel, C4R4 / C2R4: B8 L4K 55.3 / 54.3 against 39.3 / 38.5 us, B8 L32K 98.9 / 91.1 against 82.8 / 76.2, B32 L32K
#: 240.7 / 222.4 against 223.4 / 212.2, B128 L32K 796.5 / 735.5 against 794.7 / 752.0
V6_INLINE_PROTECT = False
#: whether kernel v6 keeps its key tile as one shared allocation a 64-channel plane and issues its output product a
#: plane at a time (``QUANTMLA_TRITON_V6_KEY_PLANES`` overrides it); None: where the running Triton is older than
#: :data:`V6_KEY_PLANES_BEFORE`. Triton 3.6's shared-memory barrier analysis takes the 8 planes' stores into slices of
#: one allocation for conflicting writes and puts a CTA barrier before each: 10 a page, 3 with one allocation a plane.
#: Triton 3.7.1 tells the slices apart (3 either way), and there the 8 output products cost 28 instructions a warp and
#: page (C4R4 1,233 -> 1,261, offline sm_90a; with 3.6.0 1,235 -> 1,256)
V6_KEY_PLANES = None
V6_KEY_PLANES_BEFORE = (3, 7)


def v6_key_planes(triton_version: str) -> bool:
    """:data:`V6_KEY_PLANES`, resolved for a Triton of ``triton_version`` (``"3.6.0"``, ``"3.7.1+git..."``)."""
    if V6_KEY_PLANES is not None:
        return bool(V6_KEY_PLANES)
    major, minor = (int(re.match(r"\d+", part).group()) for part in triton_version.split(".")[:2])
    return (major, minor) < V6_KEY_PLANES_BEFORE


def v6_format_unsupported(fmt, kernel: str = "kernel v6") -> str | None:
    """Why kernel v6 cannot read pages of ``fmt`` (a ``PackFormat``), or None."""
    if fmt.name not in V6_FORMATS:
        return f"{kernel} reads pages of {'/'.join(V6_FORMATS)}, got {fmt.name}"
    return v4_format_unsupported(fmt, kernel)


def plan_v6(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
            interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False) -> AttentionPlan:
    """Launch plan of attention kernel v6: kernel v3's tiles over row blocks of :data:`V6_BLOCK_R` rows, split for
    :data:`V6_CTAS_PER_SM` programs an SM, :data:`V6_NUM_WARPS` warps."""
    return replace(plan_v3(batch, rows, latent_dim, page_size, max_tokens, sm_count, interpreter, num_splits, fp32_dot,
                           V6_BLOCK_R, V6_CTAS_PER_SM), num_warps=V6_NUM_WARPS)


def plan_v5(batch: int, rows: int, latent_dim: int, page_size: int, max_tokens: int, sm_count: int,
            interpreter: bool = False, num_splits: int | None = None, fp32_dot: bool = False,
            block_r: int | None = None) -> AttentionPlan:
    """Launch plan of attention kernel v5: kernel v3's tiles and split rule (one program an SM) over row blocks of
    ``block_r`` query rows (None: :func:`v5_block_r` of the ``rows`` a request), :data:`V5_NUM_WARPS` warps in the
    launch's default partition."""
    block_r = v5_block_r(rows) if block_r is None else block_r
    return replace(plan_v3(batch, rows, latent_dim, page_size, max_tokens, sm_count, interpreter, num_splits, fp32_dot,
                           block_r), num_warps=V5_NUM_WARPS)
