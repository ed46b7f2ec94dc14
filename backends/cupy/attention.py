"""CuPy decode-attention launcher: split-KV tensor-core kernels plus a log-sum-exp combine.

Six attention kernels share the partials layout and the combine kernel:

* ``v1`` (``kernels/attention.cu``): dequantizes each tile to bf16 in shared memory, 16 query
  rows per CTA; serves every format and float32/bfloat16 queries.
* ``v2`` (``kernels/attention_v2.cu``): dequantizes straight into ``mma.sync`` fragments (heads
  as the MMA M dimension), one block barrier per tile, up to 2 row groups per CTA sharing one
  staged tile. Serves bfloat16 queries with 2/4-bit content and 4-bit RoPE codes (C4R4, C2R4).
* ``v3`` (``kernels/attention_v3.cu``): tokens as the QK M dimension over all channels, P * s
  through shared memory, zero points by a correction MMA; 64-token tiles. Serves what v2 serves
  with content groups of 64k channels, packed tokens only. On the H200 it takes 0.62-0.86x of
  v2's time from 32K tokens on, but has more fixed cost per call.
* ``v4`` (``kernels/attention_v4.cu``): 64 query rows per CTA share one tile dequantized to bf16
  in shared memory (flash-decoding on it, 8 warps); for requests with many query rows
  (S_q * H >= :data:`~.variants.V4_MIN_ROWS`: H = 128 or 64), where v2/v3 would convert every token once
  per 16 rows. Serves what v3 serves, and bf16 pages (rows copied into the tile). On compute
  capability 9.0 both matmuls are Hopper ``wgmma`` reading that tile (an NVRTC build for sm_90a,
  :func:`~.builds.v4_uses_wgmma`), elsewhere ``mma.sync``. With long splits its own extra CTAs take the sink
  and local-window tiles (bf16 rows copied into the key tile); with short ones ``protected.cu`` does.

* ``v5`` (``kernels/attention_v5.cu``, compute capability 9.0 only: an NVRTC build for sm_90a): the
  few-row counterpart of v4 on Hopper. The 64 tokens of a tile are the M dimension of warpgroup MMAs
  and 16 query rows their N; lanes dequantize straight into QK's A fragments (registers), which also
  go to a bf16 key tile in shared memory for PV. Two worker warpgroups per CTA take alternate tiles.
  Serves what v4 serves over packed pages. On the H200 (CUDA graphs, H16) its stop-20
  build took 0.87-0.98x of v3's time for C4R4 at L 32K (B 8-128) and 0.82-0.94x for C2R4; at L128K, with
  its own split overhead (:data:`~.plans.V5_CTA_OVERHEAD_TILES`), 0.92-0.93x (C4R4) and 0.78-0.82x (C2R4). Stop 21
  took another 8-18 % off (conflict-free stage reads, leaner copies), stop 22 1-5 % (no stage: each lane
  loads the codes it dequantizes straight from the pages a tile ahead; benchmarks/RESULTS.md).

* ``v6`` (``kernels/attention_v6.cu``, compute capability 9.0 only: an NVRTC build for sm_90a): v4's
  64 rows per CTA over packed pages with the work split by kind: one warpgroup dequantizes the next tile
  into the second of two key tiles (codes loaded straight from the pages into registers) while the
  other runs this tile's QK over all channels, the softmax and half of PV (the dequantizer takes the
  other half). On the H200 (CUDA graphs, H128/H64, C4R4/C2R4, stop 23) it took 0.75-0.84x of v4's time.
  Its CTAs take equal splits of a request (planned with :data:`~.plans.V6_CTA_OVERHEAD_TILES` of fixed work each) or,
  in a balanced plan (:func:`~.plans.v6_balanced`), pieces of requests read from a device table, so that every SM
  gets as many tiles. With equal splits its CTAs may write the output themselves (:func:`~.plans.v6_merge_reason`):
  the splits of a row chunk form one thread-block cluster that merges their partials through distributed shared
  memory, so no partial leaves the SMs and no combine runs.

v6 and v5 attend to the sink and local-window tokens themselves: they are the last tiles of one split
per row chunk, their bf16 rows copied into v6's key tile or loaded into v5's QK operands. v3 and v2
(``separate`` mode, the default) leave them to ``kernels/protected.cu``, a bfloat16 flash-decoding
kernel (one 32-token tile per CTA) whose partials the combine merges with the split kernel's; it may
run on a second stream beside the split kernel (:func:`~.knobs.protected_on_side_stream`).

This module is the op: :func:`attention` and :func:`prepare` / :class:`SplitCall` (plan once, run per layer).
Which kernel runs is :mod:`.variants`' choice, how each is built (``-D`` defines, shared memory) is in
:mod:`.builds`, its tuning variables in :mod:`.knobs`, and its launch plan (grid, splits, kernels) in :mod:`.plans`.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from ..buffers import capturing as graph_capturing
from ..buffers import carve, owned_by_call
from ..prepared_calls import call_key, reuse_or_prepare
from ..streams import fork_side_stream as _fork_side_stream
from ..streams import join_side_stream as _join_side_stream
from . import current_stream_handle, external_stream, launch, resident_ctas
from .builds import COMBINE_THREADS
from .knobs import V2Knobs, V3Knobs, V4Knobs, V5Knobs, V6Knobs, combine_pdl, protected_on_side_stream
from .plans import SplitPlan, device_info, v1_plan, v2_plan, v3_plan, v4_plan, v5_plan, v6_plan
from .variants import V3_MIN_TOKENS, select_variant, variant_nvrtc

LOG2E = 1.4426950408889634
_LOCK = threading.Lock()

#: the pointers that open every split kernel's parameter list: q, q_rope, pages, sink, local, block_table, seq_lens,
#: seq_ids, partial outputs, partial row statistics
SPLIT_POINTERS = 10
#: the combine's parameters: partial outputs, partial row statistics, out, lse (pointers), partials per row
COMBINE_TYPES = (np.uint64,) * 4 + (np.int32,)
_WORKSPACE: dict[tuple[int, int], torch.Tensor] = {}


def _workspace(dev: int, numel: int) -> torch.Tensor:
    """float32 scratch of at least ``numel`` elements for the split partials, reused per
    (device, current stream) so steady-state decode allocates nothing but its outputs.
    Calls on one stream are ordered, so the next call's kernels write only after this call's
    combine has read. Not for CUDA-graph capture (see :func:`outputs_and_partials`)."""
    key = (dev, current_stream_handle(dev))
    buf = _WORKSPACE.get(key)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(max(numel, 1 << 16), dtype=torch.float32, device=torch.device("cuda", dev))
        with _LOCK:
            _WORKSPACE[key] = buf
    return buf


def outputs_and_partials(shape: tuple[int, ...], dtype: torch.dtype, partial_floats: int, device: torch.device,
                         dev: int, capturing: bool | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``out`` (``shape`` = [B, S_q, H, d_c], ``dtype``), ``lse`` ([B, S_q, H] float32) and a float32
    scratch of ``partial_floats`` for the split partials.

    Eagerly the scratch is the reused per-stream workspace. While a CUDA graph is being captured (and
    within :func:`~quantmla_core.backends.buffers.call_owned_scratch`) all three are views of ONE new
    allocation: the graph's kernels write the scratch on every replay, so its memory must live as long
    as the outputs the caller keeps (a scratch freed at the end of the call could be handed to a later
    allocation of the same capture)."""
    if capturing is None:
        capturing = graph_capturing()
    lse_shape = shape[:-1]
    if not capturing and not owned_by_call():
        ws = _workspace(dev, partial_floats)
        return torch.empty(shape, dtype=dtype, device=device), torch.empty(lse_shape, dtype=torch.float32, device=device), ws

    out, lse, ws = carve([(shape, dtype), (lse_shape, torch.float32), ((partial_floats,), torch.float32)], device)
    return out, lse, ws


def attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float, want_lse: bool = True):
    """q ``[B, S_q, H, d_c]`` / ``[B, S_q, H, d_r]``, or ``[B, H, d_c]`` / ``[B, H, d_r]`` for S_q = 1
    (float32 or bfloat16, CUDA) -> out shaped like q_latent in its dtype and lse ``[B, S_q, H]``
    (``[B, H]``) float32, or None where not ``want_lse`` (written to scratch instead of a new tensor).

    Runs kernel v1 to v6 (see the module docstring and :func:`~.variants.select_variant`), prepared by
    :func:`prepared` (once per index tensors, geometry and knobs)."""
    shape = q_latent.shape
    b, h = shape[0], shape[-2]
    s_q = shape[1] if len(shape) == 4 else 1
    capturing = graph_capturing()
    call = prepared(cache, block_table, seq_lens, seq_ids, b, s_q, h, q_latent.dtype, softmax_scale, shape,
                    capturing or owned_by_call())
    return call.run(q_latent, q_rope, cache, want_lse=want_lse, capturing=capturing)


#: eager calls prepared by :func:`prepared`: key -> (variables read, their values then, the SplitCall)
_PREPARED: dict[tuple, tuple[tuple[str, ...], tuple, "SplitCall"]] = {}
#: calls kept by :func:`prepared` (the oldest goes first); a decode step with one set of index tensors needs one
PREPARED_KEEP = 64


def prepared(cache, block_table, seq_lens, seq_ids, batch: int, s_q: int, heads: int, q_dtype: torch.dtype,
             softmax_scale: float, out_shape: tuple[int, ...], fresh: bool) -> "SplitCall":
    """:func:`prepare`'s call for these arguments, reused while nothing it depends on changed.

    A kept call is reused for the same ``block_table``, ``seq_lens`` and ``seq_ids`` objects (it
    holds them, so their ids stay theirs) with the same shapes and strides, a cache of the same
    geometry, the same query shape, dtype and scale, and the same values of every ``QUANTMLA_*``
    variable ``prepare`` read (:func:`~quantmla_core.envvars.recording`). Only calls that use the
    index tensors as they are get kept: the kernels read their values at launch, so values changed
    in place between calls are seen. A call that converts one (a copy of this call's values) and
    any call that may keep nothing (``fresh``: under CUDA-graph capture, see
    :func:`~quantmla_core.backends.buffers.call_owned_scratch`) is prepared afresh."""
    def make() -> SplitCall:
        return prepare(cache, block_table, seq_lens, seq_ids, batch, s_q, heads, q_dtype, softmax_scale, out_shape)

    if fresh:
        return make()
    key = (*call_key(cache, block_table, seq_lens, seq_ids), batch, s_q, heads, q_dtype, softmax_scale, out_shape)
    return reuse_or_prepare(_PREPARED, key, PREPARED_KEEP, make,
                            lambda call: all(a is b for a, b in zip(call.index, (block_table, seq_lens, seq_ids))))


def prepare(cache, block_table, seq_lens, seq_ids, batch: int, s_q: int, heads: int, q_dtype: torch.dtype,
            softmax_scale: float, out_shape: tuple[int, ...] | None = None) -> "SplitCall":
    """Everything of an attention call that does not depend on the queries or on which layer's
    cache of this geometry it reads: the kernel variant and its launch plan, block_table /
    seq_lens / seq_ids in the kernels' dtypes, the scalar arguments. ``run`` launches.
    ``out_shape``: the shape of the queries and outputs, [B, S_q, H, d_c] (default) or, where
    S_q = 1, [B, H, d_c]."""
    fmt = cache.format
    dtype = "bfloat16" if q_dtype == torch.bfloat16 else "float32"
    device = cache.pages.device
    dev = device.index if device.index is not None else torch.cuda.current_device()
    sm_count, capability = device_info(dev)
    max_pages = int(block_table.shape[1])
    nvrtc = variant_nvrtc(capability)
    max_tokens = max_pages * fmt.page_size
    variant, _ = select_variant(fmt, dtype, capability, max_tokens, s_q * heads, nvrtc, batch)
    index64 = True
    side_default = False
    if variant in ("v2", "v3", "v4", "v5", "v6"):
        # only this variant's QUANTMLA_CUPY_* knobs are read (each read is host time of every call)
        make_plan, knob_type = {"v2": (v2_plan, V2Knobs), "v3": (v3_plan, V3Knobs), "v4": (v4_plan, V4Knobs),
                                "v5": (v5_plan, V5Knobs), "v6": (v6_plan, V6Knobs)}[variant]
        knobs = knob_type.from_env()
        no_prot = cache.sink == 0 and cache.local == 0
        # int32 seq_lens and seq_ids get an int32 build rather than a conversion on every call
        index64 = not (seq_lens.dtype == torch.int32 and seq_ids.dtype == torch.int32)
        plan = make_plan(fmt, dev, sm_count, batch, s_q * heads, max_pages, no_prot, knobs, cache.sink, cache.local,
                         index64)
        side_default = make_plan is not v2_plan and max_tokens >= V3_MIN_TOKENS
    else:
        plan = v1_plan(fmt, dtype, dev, sm_count, batch, s_q * heads, max_pages)
    shape = (batch, s_q, heads, fmt.latent_dim)
    return SplitCall.make(plan, cache, block_table, seq_lens, seq_ids, shape, tuple(out_shape or shape),
                          softmax_scale, dev, side_default, index64,
                          combine_pdl(capability, _one_wave(plan.launches[0], dev, sm_count)))


def _one_wave(launch: tuple, dev: int, sm_count: int) -> bool:
    """Whether every CTA of ``launch`` (kernel, grid, block, shared bytes) runs at once on the GPU."""
    fn, grid, block, smem = launch
    return math.prod(grid) <= resident_ctas(fn, block[0], smem, dev, sm_count)


def _kernel_input(name: str, x: torch.Tensor, dtype: torch.dtype, capturing: bool) -> torch.Tensor:
    """``x`` as a contiguous, 16-byte aligned ``dtype`` tensor (the kernels read rows with 16-byte
    loads), without a copy when it already is one. Under CUDA-graph capture a copy would be freed
    when the call returns while the graph keeps reading it, so there the caller must pass the
    right dtype and layout."""
    aligned = x.data_ptr() % 16 == 0
    if x.dtype == dtype and x.is_contiguous() and aligned:
        return x
    if capturing:
        raise ValueError(f"{name}: under CUDA-graph capture the CuPy backend needs a contiguous, 16-byte aligned "
                         f"{dtype} tensor (a converted copy would not outlive the capture), got {x.dtype}"
                         f"{'' if x.is_contiguous() else ', non-contiguous'}{'' if aligned else ', misaligned'}")
    return x.to(dtype).contiguous() if x.dtype != dtype or not x.is_contiguous() else x.clone()


@dataclass(frozen=True)
class SplitCall:
    """A prepared call: the split kernels (``plan.launches``: (kernel, grid, block, shared bytes);
    v1, v2 and v3 share the argument list) and the LSE combine over ``plan.slots`` partials per
    row, with the index inputs converted once (``index``: block_table, seq_lens, seq_ids, kept
    alive here) and the scalar arguments packed. A protected-only launch (the second of
    ``plan.launches``) may fork onto a second stream (:func:`~.knobs.protected_on_side_stream`, with
    ``side_default`` the launcher's rule outside graph capture). With ``pdl`` the combine launches with
    programmatic dependent launch (:func:`~.knobs.combine_pdl`) where it follows the kernel before it on
    one stream."""

    plan: SplitPlan
    index: tuple
    shape: tuple  # (B, S_q, H, d_c)
    out_shape: tuple  # shape of the queries and outputs: ``shape`` or, with S_q = 1, (B, H, d_c)
    scalars: tuple
    dev: int
    side_default: bool
    #: scratch of runs captured into CUDA graphs with caller-given outputs: the graphs write it on
    #: every replay, so it lives as long as this call
    graph_scratch: list = field(default_factory=list)
    #: numpy scalar types of the split kernel's parameters and of the shared list (protected-only launch)
    arg_types: tuple = ((), ())
    pdl: bool = False

    @staticmethod
    def make(plan: SplitPlan, cache, block_table, seq_lens, seq_ids, shape: tuple, out_shape: tuple,
             softmax_scale: float, dev: int, side_default: bool, index64: bool, pdl: bool = False) -> "SplitCall":
        """seq_lens / seq_ids go in as int64, or int32 where the kernels were built with ``index64`` False."""
        capturing = graph_capturing()
        index = torch.int64 if index64 else torch.int32
        table = _kernel_input("block_table", block_table, torch.int32, capturing)
        lens = _kernel_input("seq_lens", seq_lens, index, capturing)
        ids = _kernel_input("seq_ids", seq_ids, index, capturing)
        i32 = np.int32
        scalars = (i32(shape[1]), i32(shape[2]), i32(table.shape[1]), i32(table.stride(0)), i32(cache.num_pages),
                   i32(cache.max_seqs), i32(cache.sink), i32(cache.local), i32(plan.per), i32(plan.slots),
                   np.float32(softmax_scale * LOG2E))
        types = (np.uint64,) * SPLIT_POINTERS + tuple(map(type, scalars))
        split_types = types + tuple(map(type, plan.extra_args)) + (np.uint64,) * (2 * plan.out_args)
        return SplitCall(plan, (table, lens, ids), shape, out_shape, scalars, dev, side_default,
                         arg_types=(split_types, types), pdl=pdl)

    def run(self, q_latent, q_rope, cache, out=None, lse=None, want_lse: bool = True, capturing: bool | None = None
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q ``out_shape`` (the planned dtype) over ``cache`` (the planned geometry) -> out, lse,
        written into ``out`` / ``lse`` where given (contiguous, 16-byte aligned; checked by the
        caller for shape, dtype and device); on torch's current stream. With ``want_lse`` False and no
        ``lse`` given, the combine writes lse to the scratch and None comes back in its place.
        ``capturing``: whether a CUDA graph is being captured, where the caller has asked already."""
        if capturing is None:
            capturing = graph_capturing()
        dev, plan = self.dev, self.plan
        q = _kernel_input("q_latent", q_latent, q_latent.dtype, capturing)
        r = _kernel_input("q_rope", q_rope, q_rope.dtype, capturing)
        b, s_q, h, dc = self.shape
        rows, slots = s_q * h, plan.slots
        # a plan without a combine writes no partials (v6's merging clusters)
        partials = b * rows * slots if plan.combine is not None else 0
        n_o = partials * dc
        n_ws = n_o + partials * 2
        if out is None and lse is None and want_lse:
            out, lse, ws = outputs_and_partials(self.out_shape, q_latent.dtype, n_ws, q_latent.device, dev, capturing)
        else:
            _check_output("out", out)
            _check_output("lse", lse)
            # an lse nobody reads goes to the scratch after the partials, 16-byte aligned as the outputs are
            n_scratch = _lse_offset(n_ws) + (b * rows if lse is None and not want_lse else 0)
            if capturing:
                ws = torch.empty(n_scratch, dtype=torch.float32, device=q_latent.device)
                self.graph_scratch.append(ws)
            elif owned_by_call():
                ws = torch.empty(n_scratch, dtype=torch.float32, device=q_latent.device)
            else:
                ws = _workspace(dev, n_scratch)
            if out is None:
                out = torch.empty(self.out_shape, dtype=q_latent.dtype, device=q_latent.device)
            if lse is None and want_lse:
                lse = torch.empty(self.out_shape[:-1], dtype=torch.float32, device=q_latent.device)
        # pointers as Python ints: the launches pack them by the parameter types made once in ``make``
        o_ptr = ws.data_ptr()
        ml_ptr = o_ptr + 4 * n_o
        lse_ptr = lse.data_ptr() if lse is not None else o_ptr + 4 * _lse_offset(n_ws)
        table, lens, ids = self.index
        args = (q.data_ptr(), r.data_ptr(), cache.pages.data_ptr(), cache.sink_buf.data_ptr(),
                cache.local_buf.data_ptr(), table.data_ptr(), lens.data_ptr(), ids.data_ptr(),
                o_ptr, ml_ptr) + self.scalars
        split_types, types = self.arg_types
        stream = external_stream(dev)
        launches = plan.launches
        split_args = args + plan.extra_args + ((out.data_ptr(), lse_ptr) if plan.out_args else ())
        side = None
        if len(launches) > 1 and protected_on_side_stream(self.side_default or capturing):
            # fork: the protected-only launch runs beside the split kernel (captured as a parallel
            # branch under CUDA graphs); the combine waits for both
            side = _fork_side_stream(dev)
            for fn, grid, block, smem in launches[1:]:
                launch(fn, grid, block, args, dev, smem, stream=external_stream(dev, side), types=types)
            launches = launches[:1]
        fn, grid, block, smem = launches[0]
        launch(fn, grid, block, split_args, dev, smem, stream=stream, types=split_types)
        for fn, grid, block, smem in launches[1:]:
            launch(fn, grid, block, args, dev, smem, stream=stream, types=types)
        if side is not None:
            _join_side_stream(dev, side)
        if plan.combine is not None:
            # PDL only after a kernel on this stream: after the side stream's join the combine waits for an event
            launch(plan.combine, (b * rows,), (COMBINE_THREADS,), (o_ptr, ml_ptr, out.data_ptr(), lse_ptr, slots),
                   dev, stream=stream, types=COMBINE_TYPES, pdl=self.pdl and side is None)
        return out, lse


def _lse_offset(partial_floats: int) -> int:
    """Where in the scratch (float32 elements) an unwanted lse goes: after ``partial_floats``, 16-byte aligned."""
    return -(-partial_floats // 4) * 4


def _check_output(name: str, x) -> None:
    """A caller-given output the combine can write: contiguous and 16-byte aligned (or None)."""
    if x is not None and not (x.is_contiguous() and x.data_ptr() % 16 == 0):
        raise ValueError(f"{name}: the CuPy backend writes contiguous, 16-byte aligned outputs, got "
                         f"{'a non-contiguous' if not x.is_contiguous() else 'a misaligned'} tensor")
