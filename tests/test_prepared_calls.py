"""``backends.prepared_calls.reuse_or_prepare``, the eager launchers' kept calls (both launchers' suites test their
keys: ``tests/test_cupy_prepared.py``, ``tests/test_triton_prepared.py``)."""

from __future__ import annotations

from quantmla_core.backends.prepared_calls import reuse_or_prepare
from quantmla_core.envvars import getenv

KNOB = "QUANTMLA_TEST_PREPARED_KNOB"


def _maker(made: list):
    def make():
        made.append(getenv(KNOB))
        return object()
    return make


def test_a_kept_call_is_reused_while_the_variables_it_read_hold(monkeypatch):
    kept, made = {}, []
    monkeypatch.setenv(KNOB, "a")
    first = reuse_or_prepare(kept, ("k",), 4, _maker(made), lambda call: True)
    assert reuse_or_prepare(kept, ("k",), 4, _maker(made), lambda call: True) is first and made == ["a"]
    monkeypatch.setenv("QUANTMLA_TEST_UNREAD", "1")
    assert reuse_or_prepare(kept, ("k",), 4, _maker(made), lambda call: True) is first
    monkeypatch.setenv(KNOB, "b")
    second = reuse_or_prepare(kept, ("k",), 4, _maker(made), lambda call: True)
    assert second is not first and made == ["a", "b"] and list(kept) == [("k",)]


def test_calls_that_hold_copies_are_not_kept_and_the_oldest_goes_first():
    kept, made = {}, []
    reuse_or_prepare(kept, ("copy",), 2, _maker(made), lambda call: False)
    reuse_or_prepare(kept, ("copy",), 2, _maker(made), lambda call: False)
    assert len(made) == 2 and not kept
    for key in ("a", "b", "c"):
        reuse_or_prepare(kept, (key,), 2, _maker(made), lambda call: True)
    assert list(kept) == [("b",), ("c",)]
    reuse_or_prepare(kept, ("b",), 2, _maker(made), lambda call: True)  # kept: reused, nothing made
    assert len(made) == 5
