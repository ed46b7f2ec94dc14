"""CPU models of the Gluon kernels' mbarrier handoffs: an mbarrier with parity waits, and a checker that steps the
partitions' synchronizing events under one random interleaving.

Events (tuples yielded by a partition's generator):

* ``("wait", bar, parity)``: blocks until ``bar`` has completed a phase of that parity;
* ``("arrive", bar)``: one arrival;
* ``("write", buf, value)``: the buffer holds ``value`` from now on (no asynchronous reader of it may be pending);
* ``("read", buf, value)``: a synchronous read that must see ``value``;
* ``("issue", name, [(buf, value), ...])``: asynchronous reads (``wgmma``) by reader ``name`` that must see those
  values and stay pending until ``("retire", name)``.
"""

from __future__ import annotations

import random


class Barrier:
    """An mbarrier: ``count`` arrivals complete a phase; ``wait(parity)`` passes once the phase of that parity has
    completed (the current phase's parity differs), so a fresh barrier passes parity 1."""

    def __init__(self, count: int):
        self.count, self.pending, self.completed = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.completed, self.pending = self.completed + 1, self.count

    def passes(self, parity: int) -> bool:
        return (self.completed & 1) != parity


def run_interleaved(procs: dict, bars: dict, held: dict, rnd: random.Random) -> None:
    """Steps the generators ``procs`` (name -> events) in a random order among those not blocked on a wait, over the
    barriers ``bars`` and buffers ``held`` (buffer -> value); AssertionError on a deadlock, on a write to a buffer
    with a pending asynchronous reader, or on a read that sees another value."""
    readers: dict = {}  # buffer -> names of pending asynchronous readers
    nxt = {name: next(g, None) for name, g in procs.items()}
    while any(ev is not None for ev in nxt.values()):
        ready = [p for p, ev in nxt.items() if ev is not None and (ev[0] != "wait" or bars[ev[1]].passes(ev[2]))]
        assert ready, f"deadlock at {nxt}"
        p = rnd.choice(ready)
        ev = nxt[p]
        if ev[0] == "arrive":
            bars[ev[1]].arrive()
        elif ev[0] == "write":
            assert not readers.get(ev[1]), f"{p} overwrites {ev[1]} under a pending reader {readers[ev[1]]}"
            held[ev[1]] = ev[2]
        elif ev[0] == "read":
            assert held[ev[1]] == ev[2], f"{p} reads {held[ev[1]]} from {ev[1]}, expected {ev[2]}"
        elif ev[0] == "issue":
            for buf, want in ev[2]:
                assert held[buf] == want, f"{p} reads {held[buf]} from {buf}, expected {want}"
                readers.setdefault(buf, set()).add(ev[1])
        elif ev[0] == "retire":
            for rs in readers.values():
                rs.discard(ev[1])
        nxt[p] = next(procs[p], None)


def failures(run, seeds: int = 300) -> int:
    """How many of the interleavings ``run(seed)`` for seeds ``0 .. seeds - 1`` raise an AssertionError."""
    count = 0
    for seed in range(seeds):
        try:
            run(seed)
        except AssertionError:
            count += 1
    return count
