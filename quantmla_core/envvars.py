"""Fast reads of the ``QUANTMLA_*`` environment variables that decode calls consult every time.

``os.environ.get`` re-encodes its key on each call; on a decode step of a 60-layer model that
is hundreds of lookups. :func:`getenv` encodes each name once and reads the live mapping behind
``os.environ`` (so ``os.environ[...] = ...``, ``monkeypatch.setenv`` and ``putenv`` through
``os.environ`` are seen at once), falling back to ``os.environ.get`` where that mapping is not
available.
"""

from __future__ import annotations

import os

_KEYS: dict[str, object] = {}


def getenv(name: str, default: str | None = None) -> str | None:
    """``os.environ.get(name, default)``, without re-encoding ``name`` on every call."""
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
