"""Kernel v5's mbarrier protocol (``attention_v5_kernel.py``), modelled on the CPU: one attender beside the converter,
or two attenders on alternate pages (``ATTENDERS`` 2), under many random interleavings.

Checked: no deadlock; the converter never overwrites a key slot while a ``wgmma`` of an attender still reads it;
each product reads the page it was issued for; attender 1 reads the queries only after attender 0 stored them, and
attender 0 reads attender 1's sums only after they were stored; the attenders together attend to every page the
converter walks, each once. Negative controls drop one wait (or hand a slot back before its product retired) and
expect a violation. The model's order of waits and arrivals is pinned to the kernel's source.
"""

from __future__ import annotations

import inspect
import random
import re

import pytest

from mbarrier_model import Barrier, failures, run_interleaved

pytest.importorskip("triton")
from quantmla_core.backends.triton import attention_v5_kernel as v5  # noqa: E402


def _walk(n: int, attenders: int) -> int:
    """Pages the converter walks for ``n`` packed and protected pages: at least one, an even count for two."""
    return max(n, 1) if attenders == 1 else 2 * max((n + 1) // 2, 1)


def _converter(n: int, attenders: int, drop: str | None):
    """``converter_partition``: wait for the slot, write page i into it, hand it over."""
    for i in range(_walk(n, attenders)):
        s = i % 2
        if drop != "kempty":
            yield ("wait", ("kempty", s), ((i // 2) & 1) ^ 1)
        yield ("write", ("k", s), i)
        yield ("arrive", ("kfull", s))


def _pages_of(who: int, n: int, attenders: int) -> list[int]:
    """The pages attender ``who`` walks."""
    if attenders == 1:
        return list(range(max(n, 1)))
    return [2 * k + who for k in range(max((n + 1) // 2, 1))]


def _attender(who: int, n: int, attenders: int, drop: str | None):
    """``attender_partition(WHO, ATTENDERS)``: QK and the output product of each of its pages (one ``wgmma`` reader
    per attender, retired by each ``warpgroup_mma_wait(0)``), the queries' and the sums' handoffs."""
    me = f"attender {who}"
    if who == 0:  # the queries stored 64 channels at a time (``_load_q``: 8 content chunks, 1 RoPE chunk)
        for c in range(9):
            yield ("write", ("q",), f"queries {c + 1}/9")
        if attenders == 2:
            yield ("arrive", ("qready",))
    elif drop != "qready":
        yield ("wait", ("qready",), 0)
    for k, i in enumerate(_pages_of(who, n, attenders)):
        s = i % 2
        yield ("wait", ("kfull", s), (i // 2) & 1 if attenders == 1 else k & 1)
        yield ("issue", me, [(("k", s), i), (("q",), "queries 9/9")])  # QK(i)
        yield ("retire", me)  # QK(i) and (one attender) the output product of page i - 1
        if attenders == 1 and i > 0:
            yield ("arrive", ("kempty", 1 - s))
        yield ("write", ("p", who), i)
        yield ("issue", me, [(("k", s), i), (("p", who), i)])  # the output product of page i
        if attenders == 2 and drop == "retire":  # a control: the slot handed back while its product still reads it
            yield ("arrive", ("kempty", s))
            yield ("retire", me)
        elif attenders == 2:
            yield ("retire", me)
            yield ("arrive", ("kempty", s))
    yield ("retire", me)
    if attenders == 2 and who == 1:
        yield ("write", ("sums",), "attender 1")
        yield ("arrive", ("mdone",))
    elif attenders == 2:
        if drop != "mdone":
            yield ("wait", ("mdone",), 0)
        yield ("read", ("sums",), "attender 1")


def _run(n: int, attenders: int, seed: int, drop: str | None = None) -> None:
    bars = {(name, s): Barrier(1) for name in ("kfull", "kempty") for s in (0, 1)}
    bars.update({("qready",): Barrier(1), ("mdone",): Barrier(1)})
    held = {("k", 0): None, ("k", 1): None, ("q",): None, ("p", 0): None, ("p", 1): None, ("sums",): None}
    procs = {"converter": _converter(n, attenders, drop)}
    procs.update({f"attender {w}": _attender(w, n, attenders, drop) for w in range(attenders)})
    run_interleaved(procs, bars, held, random.Random(seed))


@pytest.mark.parametrize("attenders", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 2, 3, 4, 7])
def test_v5_protocol_holds_under_random_interleavings(n, attenders):
    for seed in range(300):
        _run(n, attenders, seed)


@pytest.mark.parametrize("attenders", [1, 2])
@pytest.mark.parametrize("n", [0, 1, 2, 5, 8])
def test_v5_attenders_share_the_converters_walk(n, attenders):
    """Every page the converter walks is attended once: the packed and protected pages, then (two attenders, an odd
    count) one dead page."""
    pages = sorted(p for w in range(attenders) for p in _pages_of(w, n, attenders))
    assert pages == list(range(_walk(n, attenders)))


@pytest.mark.parametrize("drop,attenders", [("kempty", 1), ("kempty", 2), ("qready", 2), ("mdone", 2),
                                            ("retire", 2)])
def test_v5_protocol_controls_fail_without_a_wait(drop, attenders):
    assert failures(lambda seed: _run(5, attenders, seed, drop)) > 0


def _sync_calls(fn) -> list[str]:
    """The mbarrier calls of a partition's source, in order."""
    return [f"{op} {bar}" for op, bar in re.findall(r"mbarrier\.(wait|arrive)\((\w+)", inspect.getsource(fn.fn))]


@pytest.mark.skipif(v5.split_kernel_v5 is None, reason="this triton has no Gluon: kernel v5 is not defined")
def test_v5_model_follows_the_kernel():
    """The source's waits and arrivals in order: the queries' handoff, the probe build's loop, one attender's, two
    attenders', the sums' handoff; the converter's probe loop, then its real one."""
    assert _sync_calls(v5.attender_partition) == [
        "arrive qready", "wait qready", "wait kfull", "arrive kempty", "wait kfull", "arrive kempty", "wait kfull",
        "arrive kempty", "arrive mdone", "wait mdone"]
    assert _sync_calls(v5.converter_partition) == ["wait kempty", "arrive kfull", "wait kempty", "arrive kfull"]
