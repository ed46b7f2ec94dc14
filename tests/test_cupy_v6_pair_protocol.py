"""The handoff protocol of CuPy kernel v6's two-CTA clusters (``QMLA_V6_PAIR``), checked on the CPU.

Two CTAs share each packed key tile: each one's dequantizer converts half of the tokens and stores them into
its own key tile and sends its rows to its peer's by bulk copies. Key tiles change hands through mbarriers of each CTA
(FULL: the own dequantizer's arrival, which expects the peer's bytes; EMPTY: the own attender, the peer
attender and the peer dequantizer), P and the rescale factors through the CTA's named barriers, as without
pairs. A Python model of the four roles, pinned to the kernel by the order of its synchronizing statements,
runs under many random interleavings and asserts: no deadlock; a wait never finds its mbarrier two phases on
(parity would alias); a key tile is rewritten in either CTA only once QK and both PVs of the tile it held have
retired there; QK and the PVs read a tile whose two halves have both landed; every barrier ends balanced.
Negative controls break the protocol (an EMPTY that forgets a reader, a FULL that does not wait for the
peer's bytes, a dropped wait) and expect the checker to object."""

from __future__ import annotations

import random
import re

import pytest
from test_cupy_v6_protocol import Violation, v6_source

FULL, EMPTY, PREADY, PFREE = "FULL", "EMPTY", "PREADY", "PFREE"


def attender(x: int, n: int):
    """Warpgroup 0 of CTA x over n tiles, in the kernel's order."""
    for i in range(n):
        buf = i & 1
        yield ("mwait", (x, FULL, buf), i >> 1)
        if i >= 1:
            yield ("retire", x, "PV0", i - 1)
        if i >= 1 and i + 1 < n:  # that key tile is done, here and for the peer's writes into ours
            yield ("marrive", (x, EMPTY, buf ^ 1), 0)
            yield ("marrive", (1 - x, EMPTY, buf ^ 1), 0)
        yield ("read_k", x, buf, i)
        if i >= 1:
            yield ("wait", (x, PFREE))
        yield ("write_p", x, i)
        yield ("arrive", (x, PREADY))
        yield ("issue", x, "PV0", buf, i)
    if n:
        yield ("retire", x, "PV0", n - 1)
        yield ("wait", (x, PFREE))


def dequantizer(x: int, n: int, np_: int, drop: str | None = None):
    """Warpgroup 1 of CTA x over n tiles, the first np_ packed (halves shared), the rest protected (whole)."""

    def put(j: int, buf: int):
        if j < np_:
            yield ("write_k", x, buf, j, x)  # its half, here
            yield ("write_remote", 1 - x, buf, j, x)  # and in the peer (bulk copies: counted on the peer's FULL)
            yield ("marrive", (x, FULL, buf), 0 if drop == "tx" else 1)
        else:
            yield ("write_k", x, buf, j, "all")
            yield ("marrive", (x, FULL, buf), 0)

    if not n:
        return
    yield from put(0, 0)
    for i in range(n):
        buf = i & 1
        if i + 1 < n:
            if i + 1 >= 2 and drop != "EMPTY":
                yield ("mwait", (x, EMPTY, buf ^ 1), (i - 1) >> 1)
            yield from put(i + 1, buf ^ 1)
        yield ("wait", (x, PREADY))
        yield ("read_p", x, i)
        yield ("issue", x, "PV1", buf, i)
        yield ("retire", x, "PV1", i)
        yield ("arrive", (x, PFREE))
        if i + 2 < n:  # its PV of this tile retired: the peer may write its buffer
            yield ("marrive", (1 - x, EMPTY, buf), 0)


class MBarrier:
    """Phase, arrivals still pending and transaction count of one mbarrier."""

    def __init__(self, expected: int):
        self.expected, self.pending, self.tx, self.phase = expected, expected, 0, 0

    def _settle(self) -> None:
        if self.pending == 0 and self.tx == 0:
            self.phase += 1
            self.pending = self.expected


def run_pair_protocol(n: int, np_: int, rng: random.Random, drop: str | None = None, empty_count: int = 3) -> None:
    """One random interleaving of the four roles; raises Violation on a broken rule."""
    roles = {("A", x): attender(x, n) for x in (0, 1)}
    roles.update({("D", x): dequantizer(x, n, np_, drop) for x in (0, 1)})
    mbar = {(x, k, b): MBarrier(1 if k == FULL else empty_count) for x in (0, 1) for k in (FULL, EMPTY) for b in (0, 1)}
    named: dict = {}
    tile_in = {(x, b): (None, set()) for x in (0, 1) for b in (0, 1)}  # key tile -> (tile, halves landed)
    readers = {(x, b): set() for x in (0, 1) for b in (0, 1)}
    done = {x: {} for x in (0, 1)}  # CTA -> tile -> readers retired
    p_tile, p_readers, p_read = {0: None, 1: None}, {0: set(), 1: set()}, set()
    events = {r: None for r in roles}
    finished: set = set()

    def whole(x: int, b: int, tile: int) -> bool:
        t, halves = tile_in[(x, b)]
        return t == tile and (halves == {0, 1} or halves == {"all"})

    def write(x: int, b: int, tile: int, half) -> None:
        if readers[(x, b)]:
            raise Violation(f"CTA {x} key tile {b} written for tile {tile} while {readers[(x, b)]} read it")
        old, halves = tile_in[(x, b)]
        if old != tile:
            if old is not None and done[x].get(old, set()) != {"QK", "PV0", "PV1"}:
                raise Violation(f"CTA {x} key tile {b} written for tile {tile} before tile {old}'s readers retired")
            halves = set()
        tile_in[(x, b)] = (tile, halves | {half})

    def ready(ev) -> bool:
        if ev[0] == "wait":
            return named.get(ev[1], 0) >= 1
        if ev[0] == "mwait":
            m = mbar[ev[1]]
            if m.phase >= ev[2] + 2:
                raise Violation(f"{ev[1]} is two phases past the awaited {ev[2]}: the parity aliases")
            return m.phase > ev[2]
        return True

    def step(ev) -> None:
        op = ev[0]
        if op == "wait":
            named[ev[1]] -= 1
        elif op == "arrive":
            if named.get(ev[1], 0) >= 1:
                raise Violation(f"{ev[1]}: a second arrival before the other side synced")
            named[ev[1]] = named.get(ev[1], 0) + 1
        elif op == "marrive":
            m = mbar[ev[1]]
            m.pending -= 1
            m.tx += ev[2]
            m._settle()
        elif op == "write_k":
            write(ev[1], ev[2], ev[3], ev[4])
        elif op == "write_remote":
            write(ev[1], ev[2], ev[3], ev[4])
            m = mbar[(ev[1], FULL, ev[2])]
            m.tx -= 1
            m._settle()
        elif op == "read_k":
            x, b, tile = ev[1:]
            if not whole(x, b, tile):
                raise Violation(f"QK of tile {tile} in CTA {x} read key tile {b} holding {tile_in[(x, b)]}")
            done[x].setdefault(tile, set()).add("QK")
        elif op == "write_p":
            x, tile = ev[1:]
            if p_readers[x] or (tile >= 1 and (x, tile - 1) not in p_read):
                raise Violation(f"CTA {x}: P rewritten for tile {tile} too early")
            p_tile[x] = tile
        elif op == "read_p":
            if p_tile[ev[1]] != ev[2]:
                raise Violation(f"CTA {ev[1]}: the dequantizer read P of tile {p_tile[ev[1]]} for tile {ev[2]}")
            p_read.add((ev[1], ev[2]))
        elif op == "issue":
            x, name, b, tile = ev[1:]
            if not whole(x, b, tile) or p_tile[x] != tile:
                raise Violation(f"{name} of tile {tile} in CTA {x} on key tile {tile_in[(x, b)]}, P {p_tile[x]}")
            readers[(x, b)].add((name, tile))
            p_readers[x].add((name, tile))
        elif op == "retire":
            x, name, tile = ev[1:]
            for b in (0, 1):
                readers[(x, b)].discard((name, tile))
            p_readers[x].discard((name, tile))
            done[x].setdefault(tile, set()).add(name)

    while len(finished) < len(roles):
        runnable = []
        for r, gen in roles.items():
            if r in finished:
                continue
            if events[r] is None:
                events[r] = next(gen, None)
                if events[r] is None:
                    finished.add(r)
                    continue
            if ready(events[r]):
                runnable.append(r)
        if not runnable:
            if len(finished) < len(roles):
                raise Violation(f"deadlock: {[(r, events[r]) for r in roles if r not in finished]}")
            break
        r = rng.choice(runnable)
        step(events[r])
        events[r] = None
    if any(named.values()):
        raise Violation(f"unmatched named-barrier arrivals at the end: {named}")
    for key, m in mbar.items():
        if m.pending != m.expected or m.tx:
            raise Violation(f"{key} ends inside a phase: {m.pending} of {m.expected} arrivals pending, tx {m.tx}")


@pytest.mark.parametrize("n,np_", [(1, 1), (1, 0), (2, 2), (3, 3), (4, 2), (5, 5), (7, 4), (3, 0)])
def test_v6_pair_protocol_holds_under_random_interleavings(n, np_):
    rng = random.Random(2000 + 10 * n + np_)
    for _ in range(400):
        run_pair_protocol(n, np_, rng)


@pytest.mark.parametrize("drop,count,match", [
    (None, 2, "written for tile|read key tile|on key tile"),  # EMPTY forgets one of its three readers
    ("EMPTY", 3, "written for tile|read key tile|on key tile|phases past"),  # the dequantizer does not wait for it
    ("tx", 3, "read key tile|on key tile|deadlock"),  # FULL does not expect the peer's half
])
def test_v6_pair_protocol_checker_catches_a_broken_handoff(drop, count, match):
    rng = random.Random(17)
    with pytest.raises(Violation, match=match):
        for _ in range(400):
            run_pair_protocol(5, 5, rng, drop, count)


def _pair_sync_statements(role_src: str) -> list[str]:
    keep = re.compile(r"mbar_wait|v6_pair_|v6_half_dequantize|v6_wait|v6_arrive|wgmma_wait<0>|v6_pv\(|v6_copy_protected\("
                      r"|PT_OFF|for \(int seg|for \(int j|for \(;|if \(i >= 1 && i \+ 1 < ntiles\) \{")
    return [ln.strip().split("  //")[0] for ln in role_src.splitlines() if keep.search(ln)]


def test_v6_pair_model_follows_the_kernel():
    """The model's order of waits, arrivals, writes and MMAs is the pair build's (a change to either must change
    this list, and then the model); the handoff helpers arrive where the model says."""
    src = v6_source(pair=True)
    att = src[src.index("// ======================================================== attender"):src.index("} else {\n            // ===")]
    deq = src[src.index("// ======================================================== dequantizer"):src.index("// ---------------------------------------------------------------- partial results")]
    assert _pair_sync_statements(att) == [
        "for (int seg = 0; seg < 3; ++seg) {",
        "for (int j = 0; j < sg.n; ++j, ++i) {",
        "mbar_wait(V6_FULL(mb, buf), v6_parity(i));",
        "wgmma_wait<0>();",
        "if (i >= 1 && i + 1 < ntiles) {",
        "v6_pair_attender_done(mb, delta, buf ^ 1, lane);",
        "wgmma_wait<0>();",
        "if (i >= 1) v6_wait(BAR_PFREE);",
        "*(u32*)(smem + PT_OFF + sw128_chunk(rw0, c, RT) + 4 * q4) = pack_bf16x2(S[c][0], S[c][1]);",
        "*(u32*)(smem + PT_OFF + sw128_chunk(rw0 + 8, c, RT) + 4 * q4) = pack_bf16x2(S[c][2], S[c][3]);",
        "v6_arrive(BAR_PREADY);",
        "v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));",
        "wgmma_wait<0>();",
        "v6_wait(BAR_PFREE);",
    ]
    tail = ["v6_wait(BAR_PREADY);", "v6_pv(acc, dp, desc_advance(dv, buf * KT_BYTES));", "wgmma_wait<0>();",
            "v6_arrive(BAR_PFREE);", "if (i + 2 < ntiles) v6_pair_pv_done(mb, delta, buf, lane);"]
    assert _pair_sync_statements(deq) == [
        "v6_half_dequantize(cd, smem_s, rank, p);",
        "v6_copy_protected(smem, v6_protected_tile(sp, 0), pr, p, rs_s);",
        "v6_pair_full(mb, delta, smem_s, 0, sp.np > 0, rank, w, lane);",
        "for (; i + 1 < sp.np; ++i) {",
        "if (i + 1 >= 2) mbar_wait(V6_EMPTY(mb, buf ^ 1), v6_parity(i - 1));",
        "v6_half_dequantize(cd, smem_s + (buf ^ 1) * KT_BYTES, rank, p);",
        "v6_pair_full(mb, delta, smem_s + (buf ^ 1) * KT_BYTES, buf ^ 1, true, rank, w, lane);",
        *tail,
        "for (; i < ntiles; ++i) {",
        "if (i + 1 >= 2) mbar_wait(V6_EMPTY(mb, buf ^ 1), v6_parity(i - 1));",
        "v6_copy_protected(smem + (buf ^ 1) * KT_BYTES, v6_protected_tile(sp, i + 1 - sp.np), pr, p, rs_s);",
        "v6_pair_full(mb, delta, smem_s + (buf ^ 1) * KT_BYTES, buf ^ 1, false, rank, w, lane);",
        *tail,
    ]
    # the helpers: the attender arrives on its own EMPTY and the peer's, the dequantizer's PV on the peer's only;
    # FULL expects the peer's bytes for a packed tile; the counts the model assumes
    helpers = src[src.index("__device__ __forceinline__ void v6_pair_full"):src.index("// phase parity")]
    assert "mbar_arrive_expect_tx(V6_FULL(mb, b), V6_PEER_BYTES);" in helpers
    assert "bulk_copy_to_peer(rows + cb * (T * 128) + delta, rows + cb * (T * 128), 8 * 128, V6_FULL(mb, b) + delta);" in helpers
    assert helpers.count("mbar_arrive(V6_EMPTY(mb, b) + delta);") == 2 and helpers.count("mbar_arrive(V6_EMPTY(mb, b));") == 1
    assert "mbar_init(V6_FULL(mb, 0), 4u);" in src and "mbar_init(V6_EMPTY(mb, 0), 12u);" in src
