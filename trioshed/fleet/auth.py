"""Node-to-node trust: the fleet secret, and the API key a forwarded request carries.

A node forwards a request with three headers: :data:`SECRET` (``TRIOSHED_FLEET_SECRET``, the
same on every node), :data:`FORWARDED` (the name of the node it came from: a forwarded request
is always served where it lands, so a request makes at most one hop) and :data:`KEY` (the API
key the first node identified: its name, role, models and limits, never its secret). The
receiving node believes :data:`KEY` only with the right secret, compared in constant time; any
fleet header without it is refused (401), and a node without a secret takes no forwarded
request and serves no fleet route (403). The secret is never logged.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import asdict, fields

from trioshed.errors import Forbidden, Unauthorized
from trioshed.keys import ANONYMOUS, ApiKey

SECRET = "X-Trioshed-Fleet-Secret"
FORWARDED = "X-Trioshed-Forwarded"
KEY = "X-Trioshed-Fleet-Key"
#: Every fleet header, lower case: the relay never passes a client's own on.
HEADERS = frozenset(h.lower() for h in (SECRET, FORWARDED, KEY))

#: Set for a request another node forwarded here (it is served here, never sent on), and for a
#: request sent back to be served here after every node it was sent to failed.
serve_here: ContextVar[bool] = ContextVar("trioshed_fleet_serve_here", default=False)

_KEY_FIELDS = tuple(f.name for f in fields(ApiKey) if f.name != "secret")


class FleetAuth:
    """Checks fleet headers against ``secret`` (None: this node is in no fleet)."""

    def __init__(self, secret: str | None) -> None:
        self._secret = secret.encode() if secret else None

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def claims(self, get: Callable[[str], str | None]) -> bool:
        """Whether the request says it comes from a node (any fleet header)."""
        return get(FORWARDED) is not None or get(SECRET) is not None or get(KEY) is not None

    def check(self, get: Callable[[str], str | None]) -> None:
        """Refuse a request whose fleet secret is missing or wrong (401), or any fleet request on
        a node without a secret (403)."""
        if self._secret is None:
            raise Forbidden("this node is in no fleet (TRIOSHED_FLEET_SECRET is not set): it takes no node-to-node request")
        presented = (get(SECRET) or "").encode()
        if not hmac.compare_digest(presented, self._secret):
            raise Unauthorized(f"missing or wrong {SECRET}: node-to-node requests need the fleet's secret (TRIOSHED_FLEET_SECRET)")

    def headers(self, key: ApiKey | None, origin: str) -> dict[str, str]:
        """The headers a request forwarded by node ``origin`` on behalf of ``key`` carries."""
        assert self._secret is not None
        out = {SECRET: self._secret.decode(), FORWARDED: origin}
        if key is not None:
            out[KEY] = encode_key(key)
        return out


def encode_key(key: ApiKey) -> str:
    """``key`` without its secret, as one header value."""
    data = {k: v for k, v in asdict(key).items() if k in _KEY_FIELDS}
    data["models"] = list(key.models)
    return json.dumps(data, separators=(",", ":"))


def decode_key(value: str | None) -> ApiKey:
    """The key a peer carried (absent: the anonymous tenant, as on a node without keys); a value
    that is not one is refused (401)."""
    if value is None:
        return ANONYMOUS
    try:
        data = json.loads(value)
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            raise ValueError("not a key")
        known = {k: v for k, v in data.items() if k in _KEY_FIELDS}
        known["models"] = tuple(str(m) for m in known.get("models") or ())
        return ApiKey(secret="", **known)
    except (ValueError, TypeError):
        raise Unauthorized(f"{KEY} is not a key this node can read") from None
