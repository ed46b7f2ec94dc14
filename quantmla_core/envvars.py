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


def _live_mapping(env) -> tuple | None:
    """(``_data``, ``encodekey``, ``decodevalue``) of ``env``'s live mapping, or None where it has none."""
    data = getattr(env, "_data", None)
    encodekey = getattr(env, "encodekey", None)
    decodevalue = getattr(env, "decodevalue", None)
    if data is None or encodekey is None or decodevalue is None:
        return None
    return data, encodekey, decodevalue


def _key(name: str, encodekey) -> object:
    """``name`` as the live mapping's key, encoded once per name (callers try ``_KEYS`` first: the hot path)."""
    key = _KEYS.get(name)
    if key is None:
        key = _KEYS.setdefault(name, encodekey(name))
    return key


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without re-encoding ``name`` on every call."""
    readers = getattr(_LOCAL, "readers", None)
    if readers:
        for names in readers:
            names.append(name)
    live = _live_mapping(os.environ)
    if live is None:
        return os.environ.get(name, default)
    data, encodekey, decodevalue = live
    raw = data.get(_KEYS.get(name) or _key(name, encodekey))
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
    live = _live_mapping(os.environ)
    if live is None:
        return tuple([os.environ.get(n) for n in names])
    data, encodekey, _ = live
    keys = _KEYS
    return tuple([data.get(keys.get(n) or _key(n, encodekey)) for n in names])


def env_int_choice(name: str, allowed: tuple[int, ...]) -> int | None:
    """The integer ``$name`` holds, one of ``allowed``; None where it is unset or blank. Anything else is refused: a
    ValueError naming the variable, the values it may hold and the one it holds."""
    raw = (getenv(name, "") or "").strip()
    if not raw:
        return None
    if raw not in {str(a) for a in allowed}:
        raise ValueError(f"{name}: expected one of {', '.join(map(str, allowed))}, got {raw!r}")
    return int(raw)
