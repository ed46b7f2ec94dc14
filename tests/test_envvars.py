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
