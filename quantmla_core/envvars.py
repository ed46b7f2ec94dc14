"""Fast reads of the ``QUANTMLA_*`` environment variables that decode calls consult every time.

``os.environ.get`` re-encodes its key on each call; on a decode step of a 60-layer model that
is hundreds of lookups. :func:`getenv` encodes each name once and reads the live mapping behind
``os.environ`` (so ``os.environ[...] = ...``, ``monkeypatch.setenv`` and ``putenv`` through
``os.environ`` are seen at once), falling back to ``os.environ.get`` where that mapping is not
available.

:func:`recording` lists the variables a computation read, so that its result can be kept and
reused while :func:`snapshot` of those names stays the same (a launcher's plan, decided by its
knobs, without parsing the knobs again on every call).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

_KEYS: dict[str, object] = {}
_LOCAL = threading.local()


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without re-encoding ``name`` on every call."""
    readers = getattr(_LOCAL, "readers", None)
    if readers:
        for names in readers:
            names.append(name)
    env = os.environ
    data = getattr(env, "_data", None)
    encodekey = getattr(env, "encodekey", None)
    decodevalue = getattr(env, "decodevalue", None)
    if data is None or encodekey is None or decodevalue is None:
        return env.get(name, default)
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS.setdefault(name, encodekey(name))
    raw = data.get(key)
    return default if raw is None else decodevalue(raw)


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect, in a list, the name of every variable :func:`getenv` reads in this thread inside
    the ``with`` block (nested blocks each see their own reads and the inner ones')."""
    names: list[str] = []
    readers = getattr(_LOCAL, "readers", None)
    if readers is None:
        readers = _LOCAL.readers = []
    readers.append(names)
    try:
        yield names
    finally:
        readers.remove(names)


def snapshot(names: tuple[str, ...]) -> tuple[str | None, ...]:
    """The values of ``names`` now as the environment holds them (encoded; None where unset): equal
    snapshots mean :func:`getenv` reads the same."""
    env = os.environ
    data = getattr(env, "_data", None)
    encodekey = getattr(env, "encodekey", None)
    if data is None or encodekey is None:
        return tuple(env.get(n) for n in names)
    keys = _KEYS
    out = []
    for n in names:
        key = keys.get(n)
        if key is None:
            key = keys.setdefault(n, encodekey(n))
        out.append(data.get(key))
    return tuple(out)
