"""quantmla_core.envvars.getenv follows os.environ exactly, including changes made through it."""

import os

import pytest
from quantmla_core.envvars import getenv


def test_getenv_sees_set_change_and_delete(monkeypatch):
    name = "QUANTMLA_TEST_ENVVARS_X"
    monkeypatch.delenv(name, raising=False)
    assert getenv(name) is None and getenv(name, "d") == "d"
    monkeypatch.setenv(name, "v1")
    assert getenv(name) == "v1" == os.environ.get(name)
    os.environ[name] = "välue-2"  # non-ASCII round trip
    assert getenv(name) == "välue-2"
    monkeypatch.delenv(name)
    assert getenv(name, "gone") == "gone"


def test_getenv_falls_back_without_the_live_mapping(monkeypatch):
    class Plain(dict):
        pass

    monkeypatch.setattr(os, "environ", Plain(QUANTMLA_TEST_ENVVARS_Y="y"))
    assert getenv("QUANTMLA_TEST_ENVVARS_Y") == "y" and getenv("QUANTMLA_TEST_ENVVARS_Z", "z") == "z"


@pytest.mark.parametrize("name", ["QUANTMLA_CUPY_ATTENTION", "QUANTMLA_TRITON_ATTENTION", "QUANTMLA_BACKEND", "PATH"])
def test_getenv_matches_os_environ(name):
    assert getenv(name) == os.environ.get(name)


def test_recording_lists_reads_per_block(monkeypatch):
    from quantmla_core.envvars import recording

    monkeypatch.setenv("QUANTMLA_TEST_ENVVARS_A", "a")
    getenv("QUANTMLA_TEST_ENVVARS_OUTSIDE")
    with recording() as outer:
        getenv("QUANTMLA_TEST_ENVVARS_A")
        with recording() as inner:
            getenv("QUANTMLA_TEST_ENVVARS_B", "b")
        getenv("QUANTMLA_TEST_ENVVARS_C")
    getenv("QUANTMLA_TEST_ENVVARS_AFTER")
    assert outer == ["QUANTMLA_TEST_ENVVARS_A", "QUANTMLA_TEST_ENVVARS_B", "QUANTMLA_TEST_ENVVARS_C"]
    assert inner == ["QUANTMLA_TEST_ENVVARS_B"]


def test_recording_is_per_thread():
    import threading

    from quantmla_core.envvars import recording

    with recording() as mine:
        t = threading.Thread(target=getenv, args=("QUANTMLA_TEST_ENVVARS_OTHER_THREAD",))
        t.start()
        t.join()
    assert mine == []


def test_snapshot_follows_the_environment(monkeypatch):
    from quantmla_core.envvars import snapshot

    names = ("QUANTMLA_TEST_ENVVARS_S1", "QUANTMLA_TEST_ENVVARS_S2")
    monkeypatch.delenv(names[0], raising=False)
    monkeypatch.setenv(names[1], "x")
    before = snapshot(names)
    assert before[0] is None and before[1] is not None and snapshot(names) == before
    monkeypatch.setenv(names[0], "")
    assert snapshot(names)[0] is not None and snapshot(names) != before
    monkeypatch.setenv(names[1], "y")
    monkeypatch.delenv(names[0])
    assert snapshot(names)[0] is None and snapshot(names) != before
    monkeypatch.setenv(names[1], "x")
    assert snapshot(names) == before


@pytest.mark.parametrize("raw,want", [(None, None), ("", None), ("  ", None), ("16", 16), (" 64 ", 64)])
def test_env_int_choice_reads(monkeypatch, raw, want):
    from quantmla_core.envvars import env_int_choice

    if raw is None:
        monkeypatch.delenv("QUANTMLA_TEST_CHOICE", raising=False)
    else:
        monkeypatch.setenv("QUANTMLA_TEST_CHOICE", raw)
    assert env_int_choice("QUANTMLA_TEST_CHOICE", (16, 32, 64)) == want


@pytest.mark.parametrize("raw", ["48", "016", "sixteen", "16.0"])
def test_env_int_choice_refuses(monkeypatch, raw):
    from quantmla_core.envvars import env_int_choice

    monkeypatch.setenv("QUANTMLA_TEST_CHOICE", raw)
    with pytest.raises(ValueError, match=rf"QUANTMLA_TEST_CHOICE: expected one of 16, 32, 64, got '{raw}'"):
        env_int_choice("QUANTMLA_TEST_CHOICE", (16, 32, 64))
