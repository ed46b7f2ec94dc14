"""Backend declarations and selection (DESIGN.md §5).

Each backend declares, as data, what it serves (:class:`Capabilities`) and can add reasons
of its own. ``backend="auto"`` walks a priority list for the hardware of the inputs and
takes the first backend with no reason against it; when none fits, :class:`NoBackendError`
lists every backend's reasons. Selection has no side effects.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from .envvars import getenv
from .formats import PackFormat

ENV_OVERRIDE = "QUANTMLA_BACKEND"

#: auto priority per device kind (:func:`auto_order` adjusts it per problem). On CUDA the CuPy
#: backend comes first because it measured faster than the Triton backend on packed formats at
#: every shape timed on an H200 (2026-11-30, benchmarks/RESULTS.md: C4R4 H=16 B=32 L=32K 659 vs
#: 1801 us; H=128 B=32 L=32K, stop 17: 1203 vs 2592 us; writers, 128K-token prompt, stop 14: C4R4
#: 88.0 vs 90.5 us, C2R4 91.9 vs 97.5 us); Triton serves what CuPy does not (group size 32, no
#: cupy installed) and is the only GPU kernel path on ROCm.
PRIORITY: dict[str, tuple[str, ...]] = {
    "cuda": ("cupy", "triton", "torch"),
    "rocm": ("triton", "torch"),
    "cpu": ("numba", "torch", "reference"),
    "numpy": ("numba", "reference"),
}

#: query rows (S_q x H) from which BF16-page attention on CUDA tries Triton before CuPy, except where
#: CuPy's kernel v4 serves it (bfloat16 queries on compute capability 9.0, wgmma) and Triton's kernel v4
#: cannot (a triton without Gluon): on the H200 CuPy v4 measured 1.54-1.88x FlashInfer BF16 over bf16
#: pages at H=64/128 (CUDA graphs) against Triton v3's 3.4-3.6x (benchmarks/RESULTS.md stop 18), and on
#: an H100 Triton v4 took 655-680 us against CuPy v4's 923 at H=128 B=32 L=32K (stop 56, one process);
#: elsewhere CuPy runs kernel v1 over bf16 pages, which measured 4.8-7.0x against Triton v3's 3.2-4.4x
#: (stop 17). Packed formats keep CuPy first.
BF16_TRITON_FIRST_ROWS = 64
#: the GPU on which CuPy's kernel v4 serves bf16 pages of the 512-wide latent (227 KB of shared memory, wgmma)
CUPY_V4_CAPABILITY = (9, 0)
#: query rows a request (S_q x H, e.g. H16 S_q 2: multi-token prediction) over which packed-page attention tries
#: Triton before CuPy on a :data:`CUPY_V4_CAPABILITY` GPU with bfloat16 queries, where the call's block tables hold at
#: least :data:`WIDE_TRITON_FIRST_TOKENS` tokens in all (batch x table tokens a request) and Triton's Gluon kernels
#: serve the format: there Triton's kernel v5 takes the 32 rows in one program, CuPy's v5 two 16-row programs that each
#: convert every page. H100, CUDA graphs, H16 S_q 2, Triton against CuPy, C4R4 / C2R4 (benchmarks/RESULTS.md, stops
#: 67 and 68): B128 L32K 1,119.6 / 1,055.7 against 1,202.4 / 1,169.7 us, B32 L32K 289.9-302.9 against 308.9-314.4 (C4R4
#: and C2R4); below 2^20 tokens CuPy was faster: B8 L32K 100.1 / 97.0 against 94.6 / 91.3, B32 L8K 99.9 / 97.1 against
#: 96.4 / 95.7. Up to 16 rows CuPy stays first (H16 S_q 1 B32 L32K: 172.6 / 165.5 us against Triton v6's 218.6 / 208.1)
WIDE_ROWS = (17, 32)
WIDE_TRITON_FIRST_TOKENS = 1 << 20


def auto_order(problem: Problem) -> tuple[str, ...]:
    """The backends ``auto`` tries for ``problem``, in order (:data:`PRIORITY`, with Triton first for
    BF16-page attention on CUDA from :data:`BF16_TRITON_FIRST_ROWS` query rows, unless the queries
    are bfloat16 on a :data:`CUPY_V4_CAPABILITY` GPU and Triton's kernel v4 cannot serve the format
    there, and for large packed-page calls of :data:`WIDE_ROWS` rows a request: :func:`_wide_rows_triton_first`)."""
    order = PRIORITY.get(problem.device.kind, ("torch",))
    cupy_v4 = problem.dtype == "bfloat16" and problem.device.capability == CUPY_V4_CAPABILITY
    cuda_attention = problem.device.kind == "cuda" and problem.op == "attention"
    bf16_rows = (cuda_attention and not problem.format.quantized
                 and problem.num_heads * problem.q_len >= BF16_TRITON_FIRST_ROWS)
    triton_first = bf16_rows and not (cupy_v4 and triton_v4_missing(problem.format))
    if triton_first or (cuda_attention and cupy_v4 and _wide_rows_triton_first(problem)):
        order = ("triton", *(name for name in order if name != "triton"))
    return order


def _wide_rows_triton_first(problem: Problem) -> bool:
    """Whether a packed-page attention call of :data:`WIDE_ROWS` query rows a request whose block tables hold at
    least :data:`WIDE_TRITON_FIRST_TOKENS` tokens in all goes to Triton first (its kernel v5 serves the format)."""
    lo, hi = WIDE_ROWS
    if not (problem.format.quantized and lo <= problem.num_heads * problem.q_len <= hi):
        return False
    return _large_call(problem) and not triton_v4_missing(problem.format)


def _large_call(problem: Problem) -> bool:
    """Whether ``problem``'s block tables hold at least :data:`WIDE_TRITON_FIRST_TOKENS` tokens in all (batch x table
    tokens a request)."""
    return problem.batch * problem.table_tokens >= WIDE_TRITON_FIRST_TOKENS


def triton_v4_missing(fmt: PackFormat) -> str | None:
    """Why the Triton backend's kernel v4 (Gluon) cannot serve ``fmt``'s pages on an sm_90 GPU with bfloat16
    queries (the format, its dims or page size, the installed triton), or None."""
    from .backends.triton.heuristics import v4_format_unsupported

    if why := v4_format_unsupported(fmt):
        return why
    try:
        from .backends.triton.attention_v4_loaders import GLUON_IMPORT_ERROR
    except Exception as exc:  # no triton at all
        return f"{type(exc).__name__}: {exc}"
    return GLUON_IMPORT_ERROR


class NoBackendError(RuntimeError):
    """No backend (or not the requested one) can serve a call; ``reasons`` maps name -> reasons."""

    def __init__(self, message: str, reasons: dict[str, list[str]]):
        lines = [message] + [f"  {name}: {'; '.join(r)}" for name, r in reasons.items()]
        super().__init__("\n".join(lines))
        self.reasons = reasons


@dataclass(frozen=True)
class DeviceInfo:
    """The hardware a call runs on. ``kind`` is "cuda", "rocm", "cpu", "numpy" or another torch
    device type ("mps", "xpu", ...). Tests build fakes directly."""

    kind: str
    name: str = ""
    capability: tuple[int, int] | None = None
    sm_count: int | None = None

    @classmethod
    def of(cls, x: Any) -> "DeviceInfo":
        """DeviceInfo of an array (NumPy -> "numpy") or a torch tensor/device."""
        if isinstance(x, np.ndarray):
            return cls("numpy", "numpy")
        dev = x.device if isinstance(x, torch.Tensor) else torch.device(x)
        if dev.type == "cuda":
            return _cuda_info(dev.index if dev.index is not None else torch.cuda.current_device())
        return cls(dev.type, dev.type)


@lru_cache(maxsize=None)
def _cuda_info(index: int) -> DeviceInfo:
    props = torch.cuda.get_device_properties(index)
    kind = "rocm" if getattr(torch.version, "hip", None) else "cuda"
    return DeviceInfo(kind, props.name, (props.major, props.minor), props.multi_processor_count)


@dataclass(frozen=True)
class Problem:
    """What a call needs: op ("write" or "attention"), format, device and value dtype; for attention the heads, query
    tokens and requests of the call and the tokens its block table holds a request (its width x page size)."""

    op: str
    format: PackFormat
    device: DeviceInfo
    dtype: str = "float32"
    protect_dtype: str = "bfloat16"
    num_heads: int = 1
    q_len: int = 1
    batch: int = 1
    table_tokens: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a backend serves, declared as data."""

    devices: frozenset[str]
    content_bits: frozenset[int] = frozenset({2, 4, 8, 16})
    rope_bits: frozenset[int] = frozenset({2, 4, 8, 16})
    latent_dims: frozenset[int] | None = None  # None: any the format allows
    rope_dims: frozenset[int] | None = None
    page_sizes: frozenset[int] = frozenset({16, 32, 64, 128})
    group_sizes: frozenset[int] = frozenset({32, 64, 128})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16"})
    protect_dtypes: frozenset[str] = frozenset({"float32", "bfloat16"})
    versions: frozenset[int] = frozenset({1})
    max_heads: int = 1 << 30
    max_q_len: int = 1 << 30
    min_capability: tuple[int, int] | None = None
    ops: frozenset[str] = frozenset({"write", "attention"})


class Backend:
    """Base class: subclasses set ``name``, ``capabilities``, ``requires`` (import names) and
    implement :meth:`write` and :meth:`attention` (arguments already validated by the API;
    queries 4-D ``[B, S_q, H, d]``, or as the caller gave them where ``takes_3d_queries``)."""

    name: str = ""
    capabilities: Capabilities = Capabilities(devices=frozenset())
    requires: tuple[str, ...] = ()
    #: True: :meth:`attention` also takes S_q = 1 queries as ``[B, H, d]`` and then returns ``out``
    #: ``[B, H, d_c]`` and ``lse`` ``[B, H]`` (the API skips making 4-D views and squeezing them back)
    takes_3d_queries: bool = False

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run in this process at all (missing package, ...), or None."""
        return _import_reason(self.requires)

    def extra_reasons(self, problem: Problem) -> list[str]:
        """Backend-specific reasons beyond the declared capabilities."""
        return []

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        why = self.unavailable_reason()
        if why:
            return [why]
        return declared_reasons(self.capabilities, problem) + self.extra_reasons(problem)

    def write(self, cache, latent, k_rope, slot_mapping, seq_ids, positions, seq_lens) -> None:
        raise NotImplementedError

    def attention(self, q_latent, q_rope, cache, block_table, seq_lens, seq_ids, softmax_scale: float, *,
                  want_lse: bool = True):
        """-> (out, lse). ``want_lse`` False: the caller drops ``lse``, so a backend may skip allocating it
        and return None in its place."""
        raise NotImplementedError

    def plan_attention(self, cache, block_table, seq_lens, seq_ids, q_shape: tuple[int, ...], q_dtype: Any,
                       softmax_scale: float):
        """A runner ``(q_latent, q_rope, cache, out, lse, want_lse=True) -> (out, lse)`` for queries of ``q_shape``
        ([B, H, d_c] or [B, S_q, H, d_c]) and ``q_dtype`` over caches of ``cache``'s geometry, the
        other arguments fixed (already validated by :func:`quantmla_core.plan_attention`); ``out`` /
        ``lse`` (or None) receive the results, which come back shaped like the queries. This default
        calls :meth:`attention` per run and copies into ``out``/``lse``; backends override it to
        prepare their launches once and write in place."""
        squeeze = len(q_shape) == 3

        def run(q_latent, q_rope, layer_cache, out=None, lse=None, want_lse=True):
            if squeeze:
                q_latent, q_rope = q_latent[:, None], q_rope[:, None]
            o, l = self.attention(q_latent, q_rope, layer_cache, block_table, seq_lens, seq_ids, softmax_scale)
            if squeeze:
                o, l = o[:, 0], l[:, 0]
            return _copy_into(o, out), _copy_into(l, lse)

        return run


def _copy_into(x: Any, dst: Any) -> Any:
    """``x``, or ``dst`` after copying ``x`` into it."""
    if dst is None:
        return x
    if isinstance(dst, np.ndarray):
        np.copyto(dst, x)
    else:
        dst.copy_(x)
    return dst


@lru_cache(maxsize=None)
def _import_reason(modules: tuple[str, ...]) -> str | None:
    for mod in modules:
        try:
            importlib.import_module(mod)
        except Exception as exc:  # ImportError, or a broken install raising something else
            return f"package {mod!r} not importable ({type(exc).__name__}: {exc})".strip()
    return None


def declared_reasons(cap: Capabilities, p: Problem) -> list[str]:
    """Reasons a backend's declared capabilities exclude a problem (messages built only on failure)."""
    f = p.format
    checks: list[tuple[bool, Any]] = [
        (p.op in cap.ops, lambda: f"does not implement op {p.op!r}"),
        (p.device.kind in cap.devices, lambda: f"device {p.device.kind!r} not in {sorted(cap.devices)}"),
        (f.content_bits in cap.content_bits, lambda: f"content bits {f.content_bits} not in {sorted(cap.content_bits)}"),
        (f.rope_bits in cap.rope_bits, lambda: f"rope bits {f.rope_bits} not in {sorted(cap.rope_bits)}"),
        (cap.latent_dims is None or f.latent_dim in cap.latent_dims,
         lambda: f"latent_dim {f.latent_dim} not in {sorted(cap.latent_dims or ())}"),
        (cap.rope_dims is None or f.rope_dim in cap.rope_dims, lambda: f"rope_dim {f.rope_dim} not in {sorted(cap.rope_dims or ())}"),
        (f.page_size in cap.page_sizes, lambda: f"page_size {f.page_size} not in {sorted(cap.page_sizes)}"),
        (not f.quantized or f.group_size in cap.group_sizes, lambda: f"group_size {f.group_size} not in {sorted(cap.group_sizes)}"),
        (f.version in cap.versions, lambda: f"layout version {f.version} not in {sorted(cap.versions)}"),
        (p.dtype in cap.dtypes, lambda: f"dtype {p.dtype} not in {sorted(cap.dtypes)}"),
        (p.protect_dtype in cap.protect_dtypes, lambda: f"protection dtype {p.protect_dtype} not in {sorted(cap.protect_dtypes)}"),
        (p.num_heads <= cap.max_heads, lambda: f"{p.num_heads} heads > max {cap.max_heads}"),
        (p.q_len <= cap.max_q_len, lambda: f"S_q={p.q_len} > max {cap.max_q_len}"),
    ]
    if cap.min_capability is not None and p.device.capability is not None:
        checks.append(
            (p.device.capability >= cap.min_capability,
             lambda: f"compute capability {p.device.capability} < {cap.min_capability}")
        )
    return [msg() for ok, msg in checks if not ok]


# ---------------------------------------------------------------------- registry
#: name -> "module:Class"; modules are imported lazily and must not import optional packages at import time
_REGISTRY: dict[str, str] = {
    "triton": "quantmla_core.backends.triton:TritonBackend",
    "cupy": "quantmla_core.backends.cupy:CupyBackend",
    "numba": "quantmla_core.backends.numba:NumbaBackend",
    "torch": "quantmla_core.backends.torch:TorchBackend",
    "reference": "quantmla_core.backends.reference:ReferenceBackend",
}


def registered_backends() -> list[str]:
    return list(_REGISTRY)


class _MissingBackend(Backend):
    def __init__(self, name: str, reason: str):
        self.name, self._reason = name, reason

    def unavailable_reason(self) -> str | None:
        return self._reason


@lru_cache(maxsize=None)
def get_backend(name: str) -> Backend:
    """The backend instance registered as ``name`` (a stand-in with a reason if its module is absent)."""
    if name not in _REGISTRY:
        raise ValueError(f"backend: expected 'auto' or one of {registered_backends()}, got {name!r}")
    module, cls = _REGISTRY[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)()
    except ImportError as exc:
        return _MissingBackend(name, f"backend module not importable ({exc})")


def select_backend(problem: Problem, backend: str = "auto", env: dict[str, str] | None = None) -> Backend:
    """Choose a backend for ``problem``; ``QUANTMLA_BACKEND`` (in ``env``, default os.environ)
    replaces "auto". Raises :class:`NoBackendError` with every candidate's reasons.

    Decisions are memoised per (problem, request): a decode loop asks the same question for
    every layer and step, and answering it costs more than a small kernel launch."""
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected a str, got {type(backend).__name__}")
    if backend == "auto":
        override = getenv(ENV_OVERRIDE) if env is None else env.get(ENV_OVERRIDE)
        if override:
            backend = override
    key = _memo_key(problem, backend)
    chosen = _DECISIONS.get(key)
    if chosen is None:
        if len(_DECISIONS) >= _DECISIONS_MAX:
            _DECISIONS.clear()
        chosen = _DECISIONS[key] = _select(problem, backend)
    return chosen


#: memoised decisions (:func:`select_backend`), at most :data:`_DECISIONS_MAX` of them
_DECISIONS: dict[tuple, Backend] = {}
_DECISIONS_MAX = 4096


def _memo_key(problem: Problem, backend: str) -> tuple:
    """What a decision for ``problem`` depends on: its fields, but of its batch and block-table tokens only
    :func:`_large_call` (what :func:`auto_order` reads of them), so that a decode loop's
    changing batch and table widths share one memoised decision."""
    return (problem.op, problem.format, problem.device, problem.dtype, problem.protect_dtype, problem.num_heads,
            problem.q_len, _large_call(problem), backend)


def _select(problem: Problem, backend: str) -> Backend:
    if backend != "auto":
        chosen = get_backend(backend)
        reasons = chosen.not_supported_reasons(problem)
        if reasons:
            raise NoBackendError(f"backend {backend!r} cannot serve {problem.op} ({problem.format}):", {backend: reasons})
        return chosen
    order = auto_order(problem)
    collected: dict[str, list[str]] = {}
    for name in order:
        candidate = get_backend(name)
        reasons = candidate.not_supported_reasons(problem)
        if not reasons:
            return candidate
        collected[name] = reasons
    raise NoBackendError(
        f"no backend can serve {problem.op} ({problem.format}) on device {problem.device.kind!r}:", collected
    )


def available_backends(device: DeviceInfo | None = None) -> dict[str, str | None]:
    """``{name: None if usable else reason}`` for every registered backend (optionally for a device)."""
    out: dict[str, str | None] = {}
    for name in registered_backends():
        b = get_backend(name)
        reason = b.unavailable_reason()
        if reason is None and device is not None and device.kind not in b.capabilities.devices:
            reason = f"does not serve device {device.kind!r}"
        out[name] = reason
    return out

