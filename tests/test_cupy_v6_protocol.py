"""The handoff protocol of CuPy kernel v6 (``kernels/attention_v6.cu``), checked on the CPU.

The attending and the dequantizing warpgroup meet at six named barriers, one side ``bar.arrive``, the
other ``bar.sync`` (compute-sanitizer's racecheck does not model that ordering, RESULTS.md stop 23). A
Python model of both roles, pinned to the kernel by the order of its synchronizing statements, runs
under many random interleavings and asserts: no deadlock; no barrier gets a second arrival before its
waiting side has synced (256 threads of one side would complete it alone); every barrier ends balanced;
a key tile is rewritten only once QK and both PVs of the tile it held have retired; P and the rescale
factors are rewritten only once the previous tile's readers are done; each read sees its own tile.
Negative controls drop one wait and expect the checker to object."""

from __future__ import annotations

import random
import re

import pytest
from quantmla_core.backends.cupy import KERNEL_DIR

FULL, EMPTY, PREADY, PFREE = "FULL", "EMPTY", "PREADY", "PFREE"


def attender(n: int, drop: str | None = None):
    """Warpgroup 0 over n tiles: (op, *args) events in the kernel's order."""
    for i in range(n):
        buf = i & 1
        yield ("wait", (FULL, buf))
        if i >= 1:
            yield ("retire", "PV0", i - 1)  # wgmma_wait<0> at the top: its PV of the previous tile
        if i >= 1 and i + 1 < n:
            yield ("arrive", (EMPTY, buf ^ 1))
        yield ("read_k", buf, i)  # QK(i), issued and retired before the softmax
        if i >= 1 and drop != "PFREE":
            yield ("wait", (PFREE, 0))
        yield ("write_p", i)
        yield ("arrive", (PREADY, 0))
        yield ("issue", "PV0", buf, i)  # reads K[buf] and P until retired
    if n:
        yield ("retire", "PV0", n - 1)
        if drop != "PFREE":
            yield ("wait", (PFREE, 0))


def dequantizer(n: int, drop: str | None = None, split: bool = False):
    """Warpgroup 1 over n tiles. ``split``: QMLA_V6_PV_AT < 3, the next key tile is written in two parts, one
    before and one beside its PV, and announced after the second."""
    if not n:
        return
    yield ("write_k", 0, 0, "all")
    yield ("arrive", (FULL, 0))
    for i in range(n):
        buf = i & 1
        nxt = i + 1 < n
        if nxt:
            if i + 1 >= 2 and drop != "EMPTY":
                yield ("wait", (EMPTY, buf ^ 1))
            yield ("write_k", buf ^ 1, i + 1, "first" if split else "all")
            if not split:
                yield ("arrive", (FULL, buf ^ 1))
        if drop != "PREADY":
            yield ("wait", (PREADY, 0))
        yield ("read_p", i)  # the rescale factors, then P by its PV
        yield ("issue", "PV1", buf, i)
        if split and nxt:
            yield ("write_k", buf ^ 1, i + 1, "rest")
            yield ("arrive", (FULL, buf ^ 1))
        yield ("retire", "PV1", i)
        yield ("arrive", (PFREE, 0))


class Violation(AssertionError):
    pass


def run_protocol(n: int, rng: random.Random, drop: str | None = None, split: bool = False, deq=None) -> None:
    """One random interleaving of both roles (``deq``: the dequantizer's events, default :func:`dequantizer`);
    raises Violation on a broken rule."""
    roles = {"A": attender(n, drop), "D": deq if deq is not None else dequantizer(n, drop, split)}
    pending: dict = {}  # barrier -> arrivals not yet matched by the other side's sync
    held = {0: None, 1: None}  # key tile buffer -> tile it holds
    k_readers = {0: set(), 1: set()}  # buffer -> PVs in flight on it
    p_tile, p_readers = None, set()
    done_reading: dict = {}  # tile -> readers of its key tile that retired
    events = {"A": None, "D": None}
    finished = set()

    def step(role):
        nonlocal p_tile
        ev = events[role]
        op = ev[0]
        if op == "wait":
            pending[ev[1]] -= 1
        elif op == "arrive":
            if pending.get(ev[1], 0) >= 1:
                raise Violation(f"{ev[1]}: a second arrival before the other side synced")
            pending[ev[1]] = pending.get(ev[1], 0) + 1
        elif op == "write_k":
            buf, tile = ev[1], ev[2]
            if ev[3] != "first":
                complete.add((buf, tile))
            if k_readers[buf]:
                raise Violation(f"key tile {buf} rewritten for tile {tile} while {k_readers[buf]} read it")
            old = held[buf]  # the same tile: the second part of a split write
            if old is not None and old != tile and done_reading.get(old, set()) != {"QK", "PV0", "PV1"}:
                raise Violation(f"key tile {buf} rewritten for tile {tile} before tile {old}'s readers retired")
            held[buf] = tile
        elif op == "read_k":
            buf, tile = ev[1], ev[2]
            if held[buf] != tile or (buf, tile) not in complete:
                raise Violation(f"QK of tile {tile} read key tile {buf} holding {held[buf]}")
            done_reading.setdefault(tile, set()).add("QK")
        elif op == "write_p":
            if p_readers:
                raise Violation(f"P rewritten for tile {ev[1]} while {p_readers} read tile {p_tile}")
            if p_tile is not None and p_tile != ev[1] - 1:
                raise Violation(f"P skipped a tile: {p_tile} -> {ev[1]}")
            if ev[1] >= 1 and ("read_p", ev[1] - 1) not in seen_reads:
                raise Violation(f"rescale factors of tile {ev[1] - 1} overwritten before the dequantizer read them")
            p_tile = ev[1]
        elif op == "read_p":
            if p_tile != ev[1]:
                raise Violation(f"the dequantizer read P / factors of tile {p_tile} for tile {ev[1]}")
            seen_reads.add(("read_p", ev[1]))
        elif op == "issue":
            name, buf, tile = ev[1:]
            if held[buf] != tile or p_tile != tile:
                raise Violation(f"{name} of tile {tile} on key tile {held[buf]}, P of tile {p_tile}")
            k_readers[buf].add((name, tile))
            p_readers.add((name, tile))
        elif op == "retire":
            name, tile = ev[1], ev[2]
            for buf in (0, 1):
                k_readers[buf].discard((name, tile))
            p_readers.discard((name, tile))
            done_reading.setdefault(tile, set()).add(name)
        events[role] = None

    seen_reads: set = set()
    complete: set = set()  # (buffer, tile) written in full
    while len(finished) < 2:
        ready = []
        for role, gen in roles.items():
            if role in finished:
                continue
            if events[role] is None:
                events[role] = next(gen, None)
                if events[role] is None:
                    finished.add(role)
                    continue
            ev = events[role]
            if ev[0] != "wait" or pending.get(ev[1], 0) >= 1:
                ready.append(role)
        if not ready:
            if len(finished) < 2:
                raise Violation(f"deadlock: {[(r, events[r]) for r in roles if r not in finished]}")
            break
        step(rng.choice(ready))
    if any(pending.values()):
        raise Violation(f"unmatched arrivals at the end: {pending}")


@pytest.mark.parametrize("split", [False, True], ids=["pv_at3", "pv_at1_2"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_v6_protocol_holds_under_random_interleavings(n, split):
    rng = random.Random(1000 + n)
    for _ in range(300):
        run_protocol(n, rng, split=split)


@pytest.mark.parametrize("split", [False, True], ids=["pv_at3", "pv_at1_2"])
@pytest.mark.parametrize("drop", ["EMPTY", "PFREE", "PREADY"])
def test_v6_protocol_checker_catches_a_missing_wait(drop, split):
    """Negative controls: without the dequantizer's EMPTY wait, the attender's PFREE waits or the
    dequantizer's PREADY wait, some interleaving breaks a rule."""
    rng = random.Random(7)
    with pytest.raises(Violation):
        for _ in range(300):
            run_protocol(4, rng, drop, split)


def test_v6_protocol_checker_catches_an_early_full_arrival():
    """Negative control of the split write: announcing the key tile after its first part lets QK read a
    half-written tile."""
    rng = random.Random(11)

    def early(n):
        for ev in dequantizer(n, split=True):
            if ev[0] == "arrive" and ev[1][0] == FULL:
                continue  # announced below, after the first part
            yield ev
            if ev[0] == "write_k" and ev[3] != "rest":
                yield ("arrive", (FULL, ev[1]))

    with pytest.raises(Violation, match="read key tile"):
        for _ in range(300):
            run_protocol(4, rng, split=True, deq=early(4))


def v6_source(pair: bool, fold: bool = False) -> str:
    """attention_v6.cu with its ``#if QMLA_V6_PAIR`` and ``#if QMLA_V6_ROPE_FOLD`` blocks resolved for ``pair`` and
    ``fold`` (other directives kept)."""
    resolve = {"#if QMLA_V6_PAIR": pair, "#if QMLA_V6_ROPE_FOLD": fold}
    out, stack = [], []  # stack: per open #if, None (not resolved here) or whether its current branch is kept
    for ln in (KERNEL_DIR / "attention_v6.cu").read_text().splitlines():
        d = ln.strip()
        if d.startswith("#if"):
            stack.append(resolve.get(d))
            if stack[-1] is not None:
                continue
        elif d.startswith("#else") and stack and stack[-1] is not None:
            stack[-1] = not stack[-1]
            continue
        elif d.startswith("#endif") and stack:
            if stack.pop() is not None:
                continue
        if all(k is not False for k in stack):
            out.append(ln)
    return "\n".join(out)


def _sync_statements(role_src: str) -> list[str]:
    """The synchronizing statements of one role's code, in order, with their guards."""
    keep = re.compile(r"v6_wait|v6_arrive|wgmma_wait<0>|v6_pv\(|v6_dequantize<|v6_copy_protected\(|al_s\[|PT_OFF"
                      r"|for \(int seg|for \(int j|for \(;|if \(QMLA_V6_PV_AT|if \(i >= 1 && i \+ 1 < ntiles\) \{")
    return [ln.strip().split("  //")[0] for ln in role_src.splitlines() if keep.search(ln)]


def test_v6_model_follows_the_kernel():
    """The model's order of waits, arrivals, writes and MMAs is the kernel's (a change to either must
    change this list, and then the model). The attender runs the model's loop over the segments of its tiles
    (packed, sink, local); the dequantizer over packed next tiles, then protected ones (written whole, as
    "all": the model's ``split`` covers every tile, a superset of the kernel's orders)."""
    src = v6_source(pair=False)
    att = src[src.index("// ======================================================== attender"):src.index("} else {\n            // ===")]
    deq = src[src.index("// ======================================================== dequantizer"):src.index("// ---------------------------------------------------------------- partial results")]
    assert _sync_statements(att) == [
        "for (int seg = 0; seg < 3; ++seg) {",
        "for (int j = 0; j < sg.n; ++j, ++i) {",  # i: the model's tile index
        "v6_wait(BAR_FULL + buf);",
        "wgmma_wait<0>();",  # its PV of tile i - 1 ("retire PV0")
        "if (i >= 1 && i + 1 < ntiles) {",
        "v6_arrive(BAR_EMPTY + (buf ^ 1));",
        "wgmma_wait<0>();",  # QK(i) ("read_k")
        "if (i >= 1) v6_wait(BAR_PFREE);",
        "*(u32*)(smem + PT_OFF + sw128_chunk(rw0, c, RT) + 4 * q4) = pack_bf16x2(S[c][0], S[c][1]);",
        "*(u32*)(smem + PT_OFF + sw128_chunk(rw0 + 8, c, RT) + 4 * q4) = pack_bf16x2(S[c][2], S[c][3]);",
        "al_s[rw0] = al[0];",
        "al_s[rw0 + 8] = al[1];",
        "v6_arrive(BAR_PREADY);",
        "v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));",
        "wgmma_wait<0>();",
        "v6_wait(BAR_PFREE);",
    ]
    handoff = ["v6_wait(BAR_PREADY);", "qmla_rescale_rows<true>(acc, al_s[rw0], al_s[rw0 + 8]);",
               "v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));"]
    assert _sync_statements(deq) == [
        "v6_dequantize<0, 3>(cd, smem, rs_s, p);",  # tile 0 in one part, packed
        "v6_copy_protected(smem, v6_protected_tile(sp, 0), pr, p, rs_s);",  # or protected
        "v6_arrive(BAR_FULL);",
        "for (; i + 1 < sp.np; ++i) {",  # the next tile packed
        "if (i + 1 >= 2) v6_wait(BAR_EMPTY + (buf ^ 1));",
        "v6_dequantize<0, QMLA_V6_PV_AT>(cd, kn, rn, p);",  # "first" (or "all"; rn: kn's RoPE scales)
        "if (QMLA_V6_PV_AT == 3) {",
        "v6_arrive(BAR_FULL + (buf ^ 1));",
        *handoff,
        "if (QMLA_V6_PV_AT < 3) {",
        "v6_dequantize<QMLA_V6_PV_AT, 3>(cd, kn, rn, p);",  # "rest", then announced
        "v6_arrive(BAR_FULL + (buf ^ 1));",
        "wgmma_wait<0>();",
        "v6_arrive(BAR_PFREE);",
        "for (; i < ntiles; ++i) {",  # the next tile, if any, protected: written whole ("all")
        "if (i + 1 >= 2) v6_wait(BAR_EMPTY + (buf ^ 1));",
        "v6_copy_protected(kn, v6_protected_tile(sp, i + 1 - sp.np), pr, p, rn);",
        "v6_arrive(BAR_FULL + (buf ^ 1));",
        *handoff,
        "wgmma_wait<0>();",
        "v6_arrive(BAR_PFREE);",
    ]
    # the next tile is guarded by i + 1 < ntiles in both loops, as in the model (np <= ntiles); kn and rn are the
    # next tile's key tile and RoPE scales
    assert "if (i + 1 < ntiles) {\n                    u8* kn = smem + (buf ^ 1) * KT_BYTES;" in deq
    assert deq.count("u8* kn = smem + (buf ^ 1) * KT_BYTES;") == 2 and deq.count("float* rn = rs_s + (buf ^ 1) * T;") == 2
    assert "const int ntiles = sp.np + sp.ns + sp.nl;" in src


def test_v6_fold_reads_scales_inside_the_tiles_handoff():
    """With QMLA_V6_ROPE_FOLD the RoPE scales travel with their key tile: the dequantizer writes them in the calls the
    model counts as writing the key tile (v6_dequantize, v6_copy_protected, both given the tile's scale slots), and the
    attender reads slot buf between its wait for that tile (FULL) and its next arrival on EMPTY (the next tile's)."""
    src = v6_source(pair=False, fold=True)
    att = src[src.index("// ======================================================== attender"):src.index("} else {\n            // ===")]
    order = [ln.strip() for ln in att.splitlines()
             if re.search(r"v6_wait\(BAR_FULL|v6_arrive\(BAR_EMPTY|rs_s|wgmma_wait<0>|for \(int j = 0; j < sg", ln)]
    assert order == ["for (int j = 0; j < sg.n; ++j, ++i) {", "v6_wait(BAR_FULL + buf);", "wgmma_wait<0>();",
                     "v6_arrive(BAR_EMPTY + (buf ^ 1));", "wgmma_wait<0>();", "const float* rsc = rs_s + buf * T;",
                     "wgmma_wait<0>();"]
    helpers = src[src.index("__device__ __forceinline__ void v6_copy_protected"):src.index("// the thread's codes of tile tt")]
    assert "if (QMLA_V6_ROPE_FOLD && (p & 1) == 0) rsc[p >> 1] = 1.0f;" in helpers
    assert "if (p % RCK == 0) rsc[p / RCK] = s;" in helpers
