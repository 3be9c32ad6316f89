"""API keys: who a request comes from (a tenant) and what it may use. No trio, no I/O but
reading the keys file.

Keys come from ``TRIOSHED_API_KEY`` (one key, named ``default``, no limits: as before) and from
the keys file ``TRIOSHED_KEYS_FILE`` (TOML)::

    [[key]]
    name = "alice"                # what logs and metrics show (the secret never appears)
    key = "sk-alice-..."          # the bearer token
    weight = 2                    # share of runner slots against other keys (default 1)
    max_concurrent = 8            # requests queued or running at once (0 = no limit)
    max_queued = 32               # requests waiting for a runner at once (0 = no limit)
    requests_per_minute = 600     # (0 = no limit)

With no key configured every request is one tenant (``ANONYMOUS``), as before. A key is found
by comparing the presented token with *every* key in constant time (no early exit).
"""

from __future__ import annotations

import hmac
import math
from collections import deque
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path

from trioshed._util import read_toml

_LIMITS = ("max_concurrent", "max_queued", "requests_per_minute")


@dataclass(frozen=True)
class ApiKey:
    name: str
    secret: str = field(repr=False, compare=False)
    weight: float = 1.0
    max_concurrent: int = 0  # 0: no limit
    max_queued: int = 0
    requests_per_minute: int = 0


ANONYMOUS = ApiKey("", "")  # no keys configured: everyone is one tenant

#: The key of the request this task serves (set by the HTTP edge's guard; the scheduler reads it).
current_key: ContextVar[ApiKey] = ContextVar("trioshed_api_key", default=ANONYMOUS)


class KeyRing:
    """The configured keys. ``required`` when there is at least one."""

    def __init__(self, keys: Sequence[ApiKey] = ()) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must be unique: {', '.join(sorted(names))}")
        secrets = [k.secret for k in keys]
        if len(set(secrets)) != len(secrets) or not all(secrets):
            raise ValueError("every API key needs its own non-empty secret")
        self.keys = tuple(keys)
        self._secrets = tuple(k.secret.encode() for k in keys)

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def identify(self, presented: str) -> ApiKey | None:
        """The key whose secret is ``presented``, compared with every key in constant time."""
        token = presented.encode()
        found = None
        for key, secret in zip(self.keys, self._secrets, strict=True):
            if hmac.compare_digest(token, secret) and found is None:
                found = key
        return found


    def identify_headers(self, authorization: str | None, x_api_key: str | None) -> ApiKey | None:
        """The key sent as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``: both are
        always compared, in constant time, so the answer tells neither which nor how close."""
        auth = authorization or ""
        bearer = self.identify(auth[len("Bearer ") :] if auth.startswith("Bearer ") else "")
        header = self.identify(x_api_key or "")
        return bearer or header


def load_keys_file(path: Path) -> tuple[ApiKey, ...]:
    """``[[key]]`` tables (see the module's docstring); ValueError naming the file and entry."""
    data = read_toml(path, "keys file")
    unknown = set(data) - {"key"}
    if unknown:
        raise ValueError(f"keys file {path}: unknown table {', '.join(sorted(unknown))}; write [[key]] entries")
    keys = []
    for i, entry in enumerate(data.get("key", []), start=1):
        where = f"keys file {path}: key #{i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: write [[key]] tables")
        extra = set(entry) - {"name", "key", "weight", *_LIMITS}
        if extra:
            raise ValueError(f"{where}: unknown field {', '.join(sorted(extra))}")
        name, secret = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{where}: name must be letters, digits, '-' or '_'")
        if not isinstance(secret, str) or len(secret) < 8:
            raise ValueError(f"{where} ({name}): key must be a string of at least 8 characters")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(f"{where} ({name}): weight must be a positive number")
        limits = {}
        for limit in _LIMITS:
            value = entry.get(limit, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where} ({name}): {limit} must be a whole number, 0 for no limit")
            limits[limit] = value
        keys.append(ApiKey(name, secret, float(weight), **limits))
    return tuple(keys)


def keyring(api_key: str | None, keys_file: Path | None) -> KeyRing:
    keys = [ApiKey("default", api_key)] if api_key else []
    if keys_file is not None:
        keys += load_keys_file(keys_file)
    return KeyRing(keys)


class RequestRate:
    """Requests per minute per key over a sliding 60 s window, ``now`` passed in."""

    def __init__(self) -> None:
        self._seen: dict[str, deque[float]] = {}

    def admit(self, key: ApiKey, now: float) -> int | None:
        """Count a request of ``key``; None when admitted, else the seconds until it would be."""
        limit = key.requests_per_minute
        if not limit:
            return None
        seen = self._seen.setdefault(key.name, deque())
        while seen and seen[0] <= now - 60.0:
            seen.popleft()
        if len(seen) >= limit:
            return max(1, math.ceil(seen[0] + 60.0 - now))
        seen.append(now)
        return None
