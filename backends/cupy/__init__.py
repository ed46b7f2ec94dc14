"""CuPy backend: raw CUDA C++ kernels compiled at run time by CuPy (NVRTC).

The kernels (``kernels/*.cu``) take every layout constant as a ``-D`` define computed here
from :class:`~quantmla_core.formats.PackFormat` (:func:`format_defines`), so the page layout
is written down once. Compiled modules are cached per (kernel, defines, device). Torch CUDA
tensors (and CuPy arrays) are passed by device pointer, without copies, and kernels launch on
torch's current stream.

CuPy is imported lazily: importing this module never imports CuPy, and a missing CuPy makes
the backend unavailable with a reason.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

from ...dispatch import Backend, Capabilities, Problem, _import_reason
from ...formats import PackFormat
from .kernel_args import pack_args
from .pdl import launch_with_pdl

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
#: warps per block of the writer (one warp per token)
WRITER_WARPS = 4
#: tokens per attention tile and warps per attention block (fixed in attention.cu)
ATTN_TILE = 32
ATTN_WARPS = 4


def format_defines(fmt: PackFormat) -> dict[str, int]:
    """Layout constants of ``fmt`` as ``-D`` defines (``QMLA_*``) for the CUDA sources."""
    d = {
        "QMLA_DC": fmt.latent_dim,
        "QMLA_DR": fmt.rope_dim,
        "QMLA_CBITS": fmt.content_bits,
        "QMLA_RBITS": fmt.rope_bits,
        "QMLA_P": fmt.page_size,
        "QMLA_PAGE_BYTES": fmt.page_bytes,
        "QMLA_CB": fmt.content_code_bytes,
        "QMLA_RB": fmt.rope_code_bytes,
        "QMLA_OFF_CC": fmt.content_codes_offset,
        "QMLA_OFF_RC": fmt.rope_codes_offset,
        "QMLA_QUANT": int(fmt.quantized),
    }
    if fmt.quantized:
        d.update(
            QMLA_GC=fmt.content_group_size,
            QMLA_GR=fmt.rope_group_size,
            QMLA_OFF_CS=fmt.content_scales_offset,
            QMLA_OFF_CZ=fmt.content_zeros_offset,
            QMLA_OFF_RS=fmt.rope_scales_offset,
            QMLA_OFF_RZ=fmt.rope_zeros_offset,
            QMLA_CSCALE_BF16=int(fmt.content_scale_dtype == "bfloat16"),
            QMLA_RSCALE_BF16=int(fmt.rope_scale_dtype == "bfloat16"),
        )
    else:
        d.update(QMLA_GC=fmt.latent_dim, QMLA_GR=fmt.rope_dim, QMLA_OFF_CS=0, QMLA_OFF_CZ=0, QMLA_OFF_RS=0,
                 QMLA_OFF_RZ=0, QMLA_CSCALE_BF16=1, QMLA_RSCALE_BF16=0)
    return d


def define_options(defines: dict[str, int]) -> tuple[str, ...]:
    """``-D`` options in a stable order (also the compile-cache key)."""
    return tuple(f"-D{k}={int(v)}" for k, v in sorted(defines.items()))


def kernel_source(name: str) -> str:
    """Text of ``kernels/<name>``."""
    return (KERNEL_DIR / name).read_text()


_LOCK = threading.Lock()
_MODULES: dict[tuple, Any] = {}


def get_kernel(source: str, kernel: str, defines: dict[str, int], device_index: int, smem: int = 0,
               arch: str | None = None):
    """Compiled ``cupy.RawKernel`` ``kernel`` of ``kernels/<source>`` with ``defines``, cached.

    ``smem``: dynamic shared memory the launches use (raises the kernel's limit above 48 KB).
    ``arch``: a target CuPy's compiler cannot name, such as ``"sm_90a"`` (wgmma builds): NVRTC
    compiles the cubin directly (:func:`compile_cubin`); None: CuPy's own build for the device.
    """
    import cupy

    key = (source, kernel, define_options(defines), device_index, arch)
    with _LOCK:
        fn = _MODULES.get(key)
        if fn is None:
            with cupy.cuda.Device(device_index):
                options = ("--std=c++17", f"-I{KERNEL_DIR}") + define_options(defines)
                if arch is None:
                    module = cupy.RawModule(code=kernel_source(source), options=options)
                else:
                    module = cupy.RawModule(path=str(compile_cubin(kernel_source(source), options, arch)))
                fn = module.get_function(kernel)
                if smem > 48 * 1024:
                    fn.max_dynamic_shared_size_bytes = smem
            _MODULES[key] = fn
    return fn


_CUBIN_DIR: list[Path] = []


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC CuPy loads (the architecture-specific ``sm_90a`` target needs 12.0+);
    asked once per process: every attention call on an sm_90 GPU consults it."""
    from cupy_backends.cuda.libs import nvrtc

    return tuple(int(v) for v in nvrtc.getVersion())[:2]


def compile_cubin(code: str, options: tuple[str, ...], arch: str) -> Path:
    """NVRTC build of ``code`` for ``arch`` (``-arch=<arch>``, with the options CuPy's own builds
    add: ``-ftz=true`` and device code by default), written to a per-process temporary folder.

    CuPy appends ``-arch=sm_<major><minor>`` from the device to every build it makes, and reads
    the architecture as a number, so it cannot build for the ``a`` targets that Hopper's wgmma
    needs. The folder is removed at exit. Raises ``RuntimeError`` with NVRTC's log when the build
    fails."""
    from cupy_backends.cuda.libs import nvrtc

    opts = tuple(options) + ("-ftz=true", "--device-as-default-execution-space", f"-arch={arch}")
    prog = nvrtc.createProgram(code, "qmla_kernel.cu", (), ())
    try:
        try:
            nvrtc.compileProgram(prog, opts)
        except nvrtc.NVRTCError as e:
            raise RuntimeError(f"NVRTC build for {arch} failed ({e}):\n{nvrtc.getProgramLog(prog)}") from None
        cubin = nvrtc.getCUBIN(prog)
    finally:
        nvrtc.destroyProgram(prog)
    if not _CUBIN_DIR:  # removed when the process exits (the modules are loaded by then)
        _CUBIN_DIR.append(Path(tempfile.mkdtemp(prefix="quantmla_cubin_")))
        atexit.register(shutil.rmtree, _CUBIN_DIR[0], True)
    path = _CUBIN_DIR[0] / f"{hashlib.sha256(repr((code, opts)).encode()).hexdigest()[:32]}.cubin"
    path.write_bytes(cubin)
    return path


def device_pointer(x: Any) -> int:
    """Device address of a torch CUDA tensor or a CuPy array (no copy)."""
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    data = getattr(x, "data", None)
    if data is not None and hasattr(data, "ptr"):
        return int(data.ptr)
    iface = getattr(x, "__cuda_array_interface__", None)
    if iface is not None:
        return int(iface["data"][0])
    raise TypeError(f"expected a torch CUDA tensor or a CuPy array, got {type(x).__name__}")


_RESIDENT: dict[tuple, int] = {}
#: sm_90 limits used when the driver's occupancy query is unavailable
_REGS_PER_SM = 65536
_REG_ALLOC_UNIT = 256  # registers per warp are allocated in units of 256
_SMEM_PER_SM = 228 * 1024
_SMEM_RESERVED_PER_CTA = 1024
_THREADS_PER_SM = 2048


def resident_ctas(fn, threads: int, smem: int, device_index: int, sm_count: int) -> int:
    """CTAs of ``fn`` (``threads`` per CTA, ``smem`` dynamic shared bytes) the whole GPU runs at
    once: the driver's occupancy per SM times ``sm_count``, cached per kernel and launch shape.
    Falls back to the sm_90 register/shared-memory arithmetic when the query is unavailable."""
    key = (id(fn), threads, smem, device_index)
    got = _RESIDENT.get(key)
    if got is None:
        import cupy

        try:
            with cupy.cuda.Device(device_index):
                per_sm = int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function_ptr(fn), threads,
                                                                                           smem))
        except Exception:
            per_sm = occupancy_from_resources(int(fn.num_regs), threads, smem + int(fn.shared_size_bytes))
        got = max(1, per_sm) * sm_count
        with _LOCK:
            _RESIDENT[key] = got
    return got


def occupancy_from_resources(regs_per_thread: int, threads: int, smem_bytes: int) -> int:
    """CTAs per SM allowed by registers, shared memory and threads (sm_90 limits), at least 1."""
    warps = -(-threads // 32)
    regs_per_warp = -(-regs_per_thread * 32 // _REG_ALLOC_UNIT) * _REG_ALLOC_UNIT
    by_regs = (_REGS_PER_SM // max(1, regs_per_warp)) // warps
    by_smem = _SMEM_PER_SM // (smem_bytes + _SMEM_RESERVED_PER_CTA)
    by_threads = _THREADS_PER_SM // threads
    return max(1, min(by_regs, by_smem, by_threads))


_STREAMS: dict[tuple[int, int], Any] = {}


def external_stream(device_index: int, torch_stream=None):
    """``cupy.cuda.ExternalStream`` wrapping ``torch_stream`` (default: torch's current stream
    of ``device_index``).

    Cached per (device, stream handle): the wrapper owns nothing, so reusing it for a handle
    is safe, and it saves building one per launch (host overhead of small decode calls)."""
    import cupy

    ptr = torch_stream.cuda_stream if torch_stream is not None else current_stream_handle(device_index)
    key = (device_index, ptr)
    s = _STREAMS.get(key)
    if s is None:
        s = cupy.cuda.ExternalStream(ptr, device_index)
        with _LOCK:
            _STREAMS[key] = s
    return s


_RAW_STREAM: list = []


def current_stream_handle(device_index: int) -> int:
    """The ``cudaStream_t`` (an int) of torch's current stream on ``device_index``.

    Through ``torch._C._cuda_getCurrentRawStream`` where the build has it (what Triton's and
    inductor's launchers call): ``torch.cuda.current_stream`` builds a ``Stream`` object on every
    call, host time of every launch of a small decode call."""
    if not _RAW_STREAM:
        import torch

        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _RAW_STREAM.append(raw if raw is not None else (lambda dev: torch.cuda.current_stream(dev).cuda_stream))
    return _RAW_STREAM[0](device_index)


def launch(fn, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, device_index: int, smem: int = 0,
           stream=None, types: tuple[type, ...] | None = None, pdl: bool = False) -> None:
    """Launch ``fn`` (see :func:`function_ptr`) on torch's current stream of ``device_index`` (or on
    ``stream``, a CuPy stream object from :func:`external_stream`). ``args``: numpy scalars, device
    pointers as ``uint64``, or with ``types`` (each parameter's numpy scalar type) Python numbers too
    (:func:`~.kernel_args.pack_args`); ``grid`` / ``block``: 1 to 3 sizes.

    Calls the driver's ``cuLaunchKernel`` with the packed arguments rather than ``fn(grid, block,
    args)``, which converts every argument on every call; with ``pdl``, ``cuLaunchKernelEx`` with
    programmatic dependent launch (:mod:`.pdl`: ``fn`` must wait for the kernel before it)."""
    import cupy

    if stream is None:
        stream = external_stream(device_index)
    params = pack_args(args, types)
    gx, gy, gz = (*grid, 1, 1)[:3]
    bx, by, bz = (*block, 1, 1)[:3]
    on_device = cupy.cuda.runtime.getDevice() == device_index
    with contextlib.nullcontext() if on_device else cupy.cuda.Device(device_index):
        if pdl:
            launch_with_pdl(function_ptr(fn), (gx, gy, gz), (bx, by, bz), smem, stream.ptr, params.address)
        else:
            cupy.cuda.driver.launchKernel(function_ptr(fn), gx, gy, gz, bx, by, bz, smem, stream.ptr, params.address, 0)


def function_ptr(fn) -> int:
    """The driver's ``CUfunction`` handle of ``fn``: a ``cupy.RawKernel`` (what ``RawModule.get_function``
    returns; its ``kernel`` is the function loaded on the current device) or a ``cupy.cuda.Function``."""
    return (fn.kernel if hasattr(fn, "kernel") else fn).ptr


class CupyBackend(Backend):
    """Raw CUDA C++ writer and split-KV decode attention (tensor-core MMA, sm_80+).

    Serves d_c in {256, 512}, d_r in {32, 64}, group sizes 64 and 128 (a group never splits a
    16-wide MMA k-step of a warp's channel slice), every page size, bits 2/4/8 and BF16,
    float32/bfloat16 values and bfloat16 protection buffers.
    """

    name = "cupy"
    requires = ("cupy",)
    capabilities = Capabilities(
        devices=frozenset({"cuda"}),
        content_bits=frozenset({2, 4, 8, 16}),
        rope_bits=frozenset({2, 4, 8, 16}),
        latent_dims=frozenset({256, 512}),
        rope_dims=frozenset({32, 64}),
        group_sizes=frozenset({64, 128}),
        protect_dtypes=frozenset({"bfloat16"}),
        min_capability=(8, 0),
    )
    #: ``attention`` takes [B, H, d] queries as they are (the layout of [B, 1, H, d]) and returns [B, H, d_c]
    takes_3d_queries = True

    def unavailable_reason(self) -> str | None:
        why = _import_reason(self.requires)
        if why:
            return why
        return _cuda_reason()

    def extra_reasons(self, problem: Problem) -> list[str]:
        f = problem.format
        reasons = []
        if f.content_scale_dtype not in ("bfloat16", "float32") or f.rope_scale_dtype not in ("bfloat16", "float32"):
            reasons.append("scale dtypes must be bfloat16 or float32")
        return reasons

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        from .writer import write

        write(cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens)

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale, *,
                  want_lse: bool = True):
        from .attention import attention

        return attention(q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale, want_lse)

    def plan_attention(self, cache, block_table, seq_lens, seq_ids, q_shape, q_dtype, softmax_scale):
        """Variant, launch plan, index inputs and scalar arguments prepared once (``SplitCall``);
        3-D queries go to the kernels as they are (the layout of [B, 1, H, d])."""
        from .attention import prepare

        b, h = q_shape[0], q_shape[-2]
        s_q = 1 if len(q_shape) == 3 else q_shape[1]
        return prepare(cache, block_table, seq_lens, seq_ids, b, s_q, h, q_dtype, softmax_scale, out_shape=q_shape).run


_CUDA_REASON: list = []


def _cuda_reason() -> str | None:
    """Why CuPy cannot run kernels here (no driver/GPU), or None; checked once."""
    if not _CUDA_REASON:
        reason = None
        if os.environ.get("QUANTMLA_CUPY_SKIP_DEVICE_CHECK") != "1":
            try:
                import cupy

                if cupy.cuda.runtime.getDeviceCount() < 1:
                    reason = "cupy sees no CUDA device"
            except Exception as exc:  # no driver, broken install
                reason = f"cupy cannot reach a CUDA device ({type(exc).__name__}: {exc})"
        _CUDA_REASON.append(reason)
    return _CUDA_REASON[0]
