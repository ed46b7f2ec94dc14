"""The ``QUANTMLA_CUPY_*`` tuning variables of the attention kernels, read on every call.

``QUANTMLA_CUPY_V2_RG`` (1 or 2 row groups per CTA; default 2 when the
row-group count is even), ``QUANTMLA_CUPY_V2_STAGES`` (cp.async ring depth 3-5, default 4),
``QUANTMLA_CUPY_V2_MINB`` (minimum blocks per SM given to ``__launch_bounds__``, default 1),
``QUANTMLA_CUPY_V2_LAZY_RESCALE`` (1: skip the output rescale while no row's running maximum
moves; bit-identical, default 0), ``QUANTMLA_CUPY_V2_PROTECTED`` (``separate``, the default:
the split kernel reads packed tokens only and the protected kernel adds the sink and local
tokens; ``inline``: sink/local tokens inside the split kernel, from the bf16 buffers),
``QUANTMLA_CUPY_PROTECTED_STREAM`` (0/1; unset: under CUDA-graph capture, and for v3/v4/v5 from
:data:`~.variants.V3_MIN_TOKENS` tokens), ``QUANTMLA_CUPY_V3_STAGES`` (3 or 4) and
``QUANTMLA_CUPY_V3_MINB`` / ``QUANTMLA_CUPY_V3_LAZY_RESCALE`` (default 1: measured 1-2 % faster,
bit-identical) / ``QUANTMLA_CUPY_V3_WARPS`` (4 or 8) and ``QUANTMLA_CUPY_V4_STAGES`` (2 or 3) /
``QUANTMLA_CUPY_V4_LAZY_RESCALE`` (default 1) / ``QUANTMLA_CUPY_V4_MMA`` (``auto``, ``wgmma``, ``mma``)
and ``QUANTMLA_CUPY_V5_LAZY_RESCALE`` (default 1) / ``QUANTMLA_CUPY_V5_WORKERS`` (auto, 2, 3 or 4) /
``QUANTMLA_CUPY_V5_PROTECTED`` (``inline``, ``separate``) / ``QUANTMLA_CUPY_V5_PROT_LOADS`` (``pairs``, ``vec``) /
``QUANTMLA_CUPY_V5_ROPE_FOLD`` / ``QUANTMLA_CUPY_V5_QUAD_LOADS`` (``auto``, 0/1) / ``QUANTMLA_CUPY_V5_PACKED_GROUPS``
(0/1) / ``QUANTMLA_CUPY_V5_HALVES`` (1/2) and ``QUANTMLA_CUPY_V6_PV_AT`` (1-3) / ``QUANTMLA_CUPY_V6_PAGE_AHEAD``
(0/1) / ``QUANTMLA_CUPY_V6_PROTECTED`` (``inline``, ``separate``) / ``QUANTMLA_CUPY_V6_PAIR`` (``auto``, 0/1) /
``QUANTMLA_CUPY_V6_SLACK`` (0/1) / ``QUANTMLA_CUPY_V6_ROPE_FOLD`` (``auto``, 0/1) and ``QUANTMLA_CUPY_PLAN_PROTECTED`` (0/1: v5 (default 1) and v6
(default 0) count the sink/local tiles they append to one split in the split plan) are
tuning knobs for measurements, also read per call. ``QUANTMLA_CUPY_PDL`` (``auto``, 0/1) says whether the combine
launches with programmatic dependent launch (:func:`combine_pdl`; read when a call is prepared).
"""

from __future__ import annotations

from dataclasses import dataclass

from ...envvars import getenv
from .builds import (
    CODES_IN_PLACE,
    V2_TILE,
    V2_TILES,
    V3_STAGES,
    V3_WARPS,
    V4_STAGES,
    V5_HALVES,
    V5_HALVES_CHOICES,
    V5_PACKED_GROUPS,
    V5_WORKER_CHOICES,
    V6_PAGE_AHEAD,
    V6_PV_AT,
    V6_SLACK,
    v2_default_stages,
)
from .pdl import pdl_unavailable_reason

#: v2 split heuristic: never create splits shorter than this many tiles (256 tokens)
V2_MIN_TILES_PER_SPLIT = 8
#: the values ``QUANTMLA_CUPY_V2_MIN_TILES`` may take
MIN_TILES_CHOICES = (1, 2, 4, 8, 16)

#: whether v6's split plan counts the sink/local tiles it appends to one split (:class:`V6Knobs` ``plan_protected``):
#: H200, H128/H64 B8-B128 L4K-128K, CUDA graphs (stop 26): within -4 % .. +2 % of not counting them, so off (stop
#: 25's plan); v5, whose protected tiles cost more, counts them (H16 B8 L32K C4R4: 66.4 against 86.2 us)
V6_PLAN_PROTECTED = False

#: v6's default ``QUANTMLA_CUPY_V6_BALANCE`` (:class:`V6Knobs` ``balance``): ``auto`` launches a balanced plan (pieces
#: of requests cut so that every SM gets as many tiles; ``backends/splits.py``'s :func:`plan_pieces`) for the content
#: bits in :data:`~.plans.V6_BALANCE_CONTENT_BITS` where its simulated schedule beats equal splits per request
V6_BALANCE = "auto"
#: v6's default ``QUANTMLA_CUPY_V6_MERGE`` (:class:`V6Knobs` ``merge``): ``0``, partials and the combine. H128, CUDA
#: graphs (stop 62): the first merging build (rows merged in dependent passes) 0.4-1.2 % slower at B32 L32K on an H100;
#: the one-pass build on an H200 within 0.4 % of the combine at B32 L32K (clusters of 2). At B8 the splits (8 a row
#: chunk, 128 CTAs) do not fit one wave as clusters (the GPU holds 15 clusters of 8, 120 CTAs), so ``auto`` keeps
#: the combine there; B128 (one split, no cluster) ran only at the H100's power cap, where its rows said nothing
V6_MERGE = "0"


def _min_tiles() -> int:
    """``QUANTMLA_CUPY_V2_MIN_TILES``: the split floor in tiles that every variant's plan keeps."""
    return _env_int("QUANTMLA_CUPY_V2_MIN_TILES", V2_MIN_TILES_PER_SPLIT, MIN_TILES_CHOICES)


def _env_int(name: str, default: int, allowed: tuple[int, ...]) -> int:
    raw = getenv(name, "").strip()
    if not raw:
        return default
    try:
        v = int(raw)
    except ValueError:
        v = None
    if v not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {raw!r}")
    return v


def _env_choice(name: str, default: str, allowed: tuple[str, ...]) -> str:
    raw = getenv(name, "").strip().lower()
    if not raw:
        return default
    if raw not in allowed:
        raise ValueError(f"{name}: expected one of {allowed}, got {raw!r}")
    return raw


def _env_auto_int(name: str, allowed: tuple[int, ...]) -> int | None:
    """An ``auto``/integer knob: None (unset or ``auto``: the launcher's rule) or one of ``allowed``."""
    raw = getenv(name, "").strip().lower()
    return None if raw in ("", "auto") else _env_int(name, allowed[0], allowed)


def _env_auto_bool(name: str) -> bool | None:
    """An ``auto``/``0``/``1`` knob: None (the launcher's default), False or True."""
    return {"auto": None, "0": False, "1": True}[_env_choice(name, "auto", ("auto", "0", "1"))]


@dataclass(frozen=True)
class V2Knobs:
    """The ``QUANTMLA_CUPY_V2_*`` tuning variables of one call (``rg`` None: the default rule)."""

    rg: int | None
    minb: int
    stages: int
    lazy: bool
    separate: bool
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    tile: int = V2_TILE

    @staticmethod
    def from_env() -> "V2Knobs":
        rg = _env_int("QUANTMLA_CUPY_V2_RG", 0, (1, 2)) or None
        tile = _env_int("QUANTMLA_CUPY_V2_TILE", V2_TILE, V2_TILES)
        return V2Knobs(rg, _env_int("QUANTMLA_CUPY_V2_MINB", 1, (1, 2, 3, 4)),
                       _env_int("QUANTMLA_CUPY_V2_STAGES", v2_default_stages(tile), (3, 4, 5)),
                       bool(_env_int("QUANTMLA_CUPY_V2_LAZY_RESCALE", 0, (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V2_PROTECTED", "separate", ("inline", "separate")) == "separate",
                       _min_tiles(), tile)


@dataclass(frozen=True)
class V3Knobs:
    """The ``QUANTMLA_CUPY_V3_*`` tuning variables of one call (stages: copy ring depth; minb:
    ``__launch_bounds__`` minimum blocks per SM, None: the build's default; lazy: skip the output
    rescale while no row's maximum moves; warps: 4 or 8 per CTA) and v2's split floor."""

    stages: int
    minb: int | None
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    lazy: bool = True
    warps: int = V3_WARPS

    @staticmethod
    def from_env() -> "V3Knobs":
        return V3Knobs(_env_int("QUANTMLA_CUPY_V3_STAGES", V3_STAGES, (3, 4)),
                       _env_int("QUANTMLA_CUPY_V3_MINB", 0, (1, 2, 3)) or None,
                       _min_tiles(),
                       bool(_env_int("QUANTMLA_CUPY_V3_LAZY_RESCALE", 1, (0, 1))),
                       _env_int("QUANTMLA_CUPY_V3_WARPS", V3_WARPS, (4, 8)))


@dataclass(frozen=True)
class V4Knobs:
    """The ``QUANTMLA_CUPY_V4_*`` tuning variables of one call (stages: copy ring depth; lazy: skip
    the output rescale while no row's maximum moves; mma: ``auto``, ``wgmma`` or ``mma``, see
    :func:`~.builds.v4_uses_wgmma`) and v2's split floor."""

    stages: int = V4_STAGES
    lazy: bool = True
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    mma: str = "auto"

    @staticmethod
    def from_env() -> "V4Knobs":
        return V4Knobs(_env_int("QUANTMLA_CUPY_V4_STAGES", V4_STAGES, (2, 3)),
                       bool(_env_int("QUANTMLA_CUPY_V4_LAZY_RESCALE", 1, (0, 1))),
                       _min_tiles(),
                       _env_choice("QUANTMLA_CUPY_V4_MMA", "auto", ("auto", "wgmma", "mma")))


@dataclass(frozen=True)
class V5Knobs:
    """The ``QUANTMLA_CUPY_V5_*`` tuning variables of one call (lazy: skip the output rescale while
    no row's maximum moves; workers: worker warpgroups per CTA (``QUANTMLA_CUPY_V5_WORKERS``, ``auto`` (default: None,
    :func:`~.builds.v5_workers`), 2, 3 or 4); separate (``QUANTMLA_CUPY_V5_PROTECTED``,
    ``inline`` (default) or ``separate``): leave the sink/local tokens to the protected-only launch instead
    of attending to them as the kernel's own tiles; plan_protected (``QUANTMLA_CUPY_PLAN_PROTECTED``, 0/1,
    default 1): count those tiles in the split plan; prot_vec (``QUANTMLA_CUPY_V5_PROT_LOADS``, ``vec``
    (default) or ``pairs``): load a protected tile's bf16 pairs in loads of up to 16 bytes, not one by one;
    codes_in_place (``QUANTMLA_CUPY_CODES_IN_PLACE``, 0/1, default :data:`~.builds.CODES_IN_PLACE`): convert 2-bit codes where
    they lie in their byte; rope_fold (``QUANTMLA_CUPY_V5_ROPE_FOLD``, ``auto`` (default: None, :func:`~.builds.v5_rope_fold`),
    ``0`` or ``1``): scale each score's RoPE part once instead of dequantizing each RoPE value; quad_loads
    (``QUANTMLA_CUPY_V5_QUAD_LOADS``, ``auto`` (default: None, :func:`~.builds.v5_quad_loads`), ``0`` or ``1``): a quad of
    lanes loads a token's content codes together; packed_groups (``QUANTMLA_CUPY_V5_PACKED_GROUPS``, 0/1,
    default :data:`~.builds.V5_PACKED_GROUPS`): a token's 2-bit content zero points and scales in one load each; halves
    (``QUANTMLA_CUPY_V5_HALVES``, 1/2, default :data:`~.builds.V5_HALVES`): warpgroups of a worker, each over half of every
    tile's channels; zfold (``QUANTMLA_CUPY_V5_ZFOLD``, ``auto`` (default: None, :func:`~.builds.v5_zfold`), ``0`` or
    ``1``): the content zero points through the matmuls instead of each value's dequantization; probe
    (``QUANTMLA_CUPY_V5_PROBE``, 0-7, default 0): a measurement build that skips the stages whose bits it sums,
    :data:`~.builds.V5_PROBE_BITS`, with wrong results) and v2's split floor."""

    lazy: bool = True
    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    workers: int | None = None
    separate: bool = False
    plan_protected: bool = True
    prot_vec: bool = True
    codes_in_place: bool = CODES_IN_PLACE
    rope_fold: bool | None = None
    quad_loads: bool | None = None
    packed_groups: bool = V5_PACKED_GROUPS
    halves: int = V5_HALVES
    zfold: bool | None = None
    probe: int = 0

    @staticmethod
    def from_env() -> "V5Knobs":
        return V5Knobs(bool(_env_int("QUANTMLA_CUPY_V5_LAZY_RESCALE", 1, (0, 1))),
                       _min_tiles(),
                       _env_auto_int("QUANTMLA_CUPY_V5_WORKERS", V5_WORKER_CHOICES),
                       _env_choice("QUANTMLA_CUPY_V5_PROTECTED", "inline", ("inline", "separate")) == "separate",
                       bool(_env_int("QUANTMLA_CUPY_PLAN_PROTECTED", 1, (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V5_PROT_LOADS", "vec", ("vec", "pairs")) == "vec",
                       bool(_env_int("QUANTMLA_CUPY_CODES_IN_PLACE", int(CODES_IN_PLACE), (0, 1))),
                       _env_auto_bool("QUANTMLA_CUPY_V5_ROPE_FOLD"),
                       _env_auto_bool("QUANTMLA_CUPY_V5_QUAD_LOADS"),
                       bool(_env_int("QUANTMLA_CUPY_V5_PACKED_GROUPS", int(V5_PACKED_GROUPS), (0, 1))),
                       _env_int("QUANTMLA_CUPY_V5_HALVES", V5_HALVES, V5_HALVES_CHOICES),
                       _env_auto_bool("QUANTMLA_CUPY_V5_ZFOLD"),
                       _env_int("QUANTMLA_CUPY_V5_PROBE", 0, tuple(range(8))))


@dataclass(frozen=True)
class V6Knobs:
    """The tuning variables of one v6 call: v2's split floor (``QUANTMLA_CUPY_V2_MIN_TILES``); ``pv_at``
    (``QUANTMLA_CUPY_V6_PV_AT``, 1-3): how many of the next tile's three parts (two tokens' content, RoPE) a
    dequantizing thread converts before it issues its PV, the rest running beside that PV; ``page_ahead``
    (``QUANTMLA_CUPY_V6_PAGE_AHEAD``, 0/1): read a tile's page ids one tile before its codes; ``separate``
    (``QUANTMLA_CUPY_V6_PROTECTED``, ``inline`` (default) or ``separate``): leave the sink/local tokens to the
    protected-only launch instead of attending to them as the kernel's own tiles; ``plan_protected``
    (``QUANTMLA_CUPY_PLAN_PROTECTED``, 0/1, default :data:`V6_PLAN_PROTECTED`): count those tiles in the split plan;
    ``pair`` (``QUANTMLA_CUPY_V6_PAIR``, ``auto`` (default), ``0`` or ``1``): run two-CTA clusters that share each
    dequantized key tile (:func:`~.builds.v6_pairs`); ``slack`` (``QUANTMLA_CUPY_V6_SLACK``, 0/1, default :data:`~.builds.V6_SLACK`):
    move a row's reference maximum only when a score passes it by :data:`~.builds.V6_MAX_SLACK`; ``rope_fold``
    (``QUANTMLA_CUPY_V6_ROPE_FOLD``, ``auto`` (default: None, :data:`~.builds.V6_ROPE_FOLD_CONTENT_BITS`), ``0`` or ``1``):
    multiply each score's RoPE part by the token's scale instead of dequantizing each RoPE value (pair builds never
    fold); ``balance`` (``QUANTMLA_CUPY_V6_BALANCE``, ``auto`` (default, :data:`V6_BALANCE`), ``0`` or ``1``): cut the
    requests into pieces so that every SM gets as many tiles, instead of equal splits per request
    (:func:`~.plans.v6_balanced`); ``merge`` (``QUANTMLA_CUPY_V6_MERGE``, ``auto``, ``0`` (default, :data:`V6_MERGE`)
    or ``1``): the splits of a row chunk run as one cluster that merges their partials and writes the output itself,
    with no combine kernel (:func:`~.plans.v6_merge_reason`; ``1`` refuses, with the reason, a call that cannot;
    ``auto`` takes it where it can, on equal splits)."""

    min_tiles: int = V2_MIN_TILES_PER_SPLIT
    pv_at: int = V6_PV_AT
    page_ahead: bool = V6_PAGE_AHEAD
    separate: bool = False
    plan_protected: bool = V6_PLAN_PROTECTED
    pair: str = "auto"
    slack: bool = V6_SLACK
    rope_fold: bool | None = None
    balance: str = V6_BALANCE
    merge: str = V6_MERGE

    @staticmethod
    def from_env() -> "V6Knobs":
        return V6Knobs(_min_tiles(),
                       _env_int("QUANTMLA_CUPY_V6_PV_AT", V6_PV_AT, (1, 2, 3)),
                       bool(_env_int("QUANTMLA_CUPY_V6_PAGE_AHEAD", int(V6_PAGE_AHEAD), (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V6_PROTECTED", "inline", ("inline", "separate")) == "separate",
                       bool(_env_int("QUANTMLA_CUPY_PLAN_PROTECTED", int(V6_PLAN_PROTECTED), (0, 1))),
                       _env_choice("QUANTMLA_CUPY_V6_PAIR", "auto", ("auto", "0", "1")),
                       bool(_env_int("QUANTMLA_CUPY_V6_SLACK", int(V6_SLACK), (0, 1))),
                       _env_auto_bool("QUANTMLA_CUPY_V6_ROPE_FOLD"),
                       _env_choice("QUANTMLA_CUPY_V6_BALANCE", V6_BALANCE, ("auto", "0", "1")),
                       _env_choice("QUANTMLA_CUPY_V6_MERGE", V6_MERGE, ("auto", "0", "1")))


PROTECTED_STREAM_ENV = "QUANTMLA_CUPY_PROTECTED_STREAM"


def protected_on_side_stream(default: bool) -> bool:
    """Whether the protected-only launch runs on a second stream, concurrently with the split
    kernel (the result is bit-identical either way). ``QUANTMLA_CUPY_PROTECTED_STREAM`` (read per
    call) 1 or 0 decides; unset, ``default``: the launchers' rule is every variant under CUDA-graph
    capture, and v3/v4/v5 eager calls from :data:`~.variants.V3_MIN_TOKENS` tokens of block-table capacity
    (measured, H200: up to 14 % less GPU time per call at short contexts, none at B=128 or H=128,
    but ~10-20 µs more host time per eager call, which short eager calls, host-bound, would pay)."""
    raw = _env_int(PROTECTED_STREAM_ENV, -1, (-1, 0, 1))
    return default if raw < 0 else bool(raw)


PDL_ENV = "QUANTMLA_CUPY_PDL"


def combine_pdl(capability: tuple[int, int] | None, one_wave: bool) -> bool:
    """Whether the combine launches with programmatic dependent launch (:mod:`.pdl`) on a GPU of ``capability``
    after a split kernel whose CTAs all run at once (``one_wave``) or not. ``QUANTMLA_CUPY_PDL`` (read when a call
    is prepared) ``0`` or ``1`` decides; unset or ``auto``: on where the GPU (compute capability 9.0+) and the
    driver (``cuLaunchKernelEx``, CUDA 12.3+) allow it and the split kernel is ``one_wave``. H100, CUDA graphs
    (stop 61): one wave, H128 B8 L4K 40.8-41.3 -> 40.5-40.6 us and eager calls 1-1.7 us shorter; two waves (H128
    B128 L32K) 2-9 % slower, not traced. ``1`` where the GPU or driver cannot is refused with the reason."""
    want = _env_auto_bool(PDL_ENV)
    if want is False:
        return False
    why = pdl_unavailable_reason(capability)
    if want and why:
        raise ValueError(f"{PDL_ENV}=1: {why}")
    return why is None and (want or one_wave)
