"""Node-to-node trust: signed requests, and the name of the API key a forwarded request carries.

The fleet secret (``TRIOSHED_FLEET_SECRET``, the same on every node) never travels. Each
node-to-node request (a forwarded request, a state poll) carries:

- :data:`FORWARDED`: the name of the node that sent it (a forwarded request is served where it
  lands, so a request makes at most one hop);
- :data:`KEY`: the *name* of the API key the first node identified (absent: no key, where that
  node requires none). Never its secret, its digest or its rights: the serving node looks the
  name up in its own keys (the shared store's, its keys file's) and applies its own record;
- :data:`SIGNATURE`: ``v1;t=<unix time>;n=<nonce>;to=<receiving node>;d=<body digest>;s=<mac>``,
  where ``mac`` is HMAC-SHA256 under the secret over the method, the path with its query, the
  body's SHA-256 (``d``), the time, the nonce, the sending node, the receiving node and the key
  name (:func:`message`).

The receiving node (:meth:`FleetAuth.verify`) refuses (401) a request whose time is more than
the window (``TRIOSHED_FLEET_WINDOW``, 30 s) from its own clock, whose MAC is wrong, that names
another node as its receiver, or whose nonce it has seen within the window (a replay); then,
once the body is read, one whose body is not the one signed (:meth:`FleetAuth.check_body`). So
seeing one request lets no one forge another, change its body, key or receiver, or send it again.
A node without a secret takes no node-to-node request at all (403). The secret is never logged.

Signing costs one SHA-256 of the body, computed once per forwarded request whichever nodes it is
tried on, and one HMAC over a short string per node.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from trioshed.errors import Forbidden, Unauthorized

FORWARDED = "X-Trioshed-Forwarded"
KEY = "X-Trioshed-Fleet-Key"
SIGNATURE = "X-Trioshed-Fleet-Signature"
#: The bearer header of earlier versions: never sent, still dropped from what is relayed.
LEGACY_SECRET = "X-Trioshed-Fleet-Secret"
#: Every fleet header, lower case: the relay never passes a client's own on.
HEADERS = frozenset(h.lower() for h in (FORWARDED, KEY, SIGNATURE, LEGACY_SECRET))

#: Seconds a signed request's time may be from the receiver's clock (the nodes' clocks must agree
#: that well: NTP).
WINDOW = 30.0
_VERSION = "v1"

#: Set for a request another node forwarded here (it is served here, never sent on), and for a
#: request sent back to be served here after every node it was sent to failed.
serve_here: ContextVar[bool] = ContextVar("trioshed_fleet_serve_here", default=False)


def body_digest(body: bytes) -> str:
    """The SHA-256 of a request's body, as signed (hex)."""
    return hashlib.sha256(body).hexdigest()


def message(method: str, path: str, digest: str, when: str, nonce: str, origin: str, to: str, key: str) -> bytes:
    """What the MAC covers, one field a line (no field holds a newline: the relay refuses them)."""
    return "\n".join((_VERSION, method, path, digest, when, nonce, origin, to, key)).encode()


@dataclass(frozen=True)
class Signed:
    """A node-to-node request whose signature held: who sent it, for which key (None: no key),
    the digest of the body it must carry, and its signature (the same request asked again)."""

    origin: str
    key: str | None
    digest: str
    signature: str


#: The signature of the request this task serves, once it held (set by :meth:`FleetAuth.verify`):
#: its body is checked against it when read, and the same request checked again (the fast path
#: handing it to Quart) is not a replay of itself.
current_signed: ContextVar[Signed | None] = ContextVar("trioshed_fleet_signed", default=None)


class FleetAuth:
    """Signs this node's requests to other nodes and checks theirs (``secret`` None: this node is
    in no fleet). ``name``: this node's name (the receiver a request must name); ``window``: the
    replay window in seconds."""

    def __init__(self, secret: str | None, name: str = "", *, window: float = WINDOW) -> None:
        self._secret = secret.encode() if secret else None
        self.name = name
        self.window = window
        #: nonces seen, by the whole second of their request's time: whole seconds are dropped
        #: once older than the window (a request that old is refused for its time already)
        self._seen: dict[int, set[str]] = {}

    @property
    def enabled(self) -> bool:
        return self._secret is not None

    def claims(self, get: Callable[[str], str | None]) -> bool:
        """Whether the request says it comes from a node (any fleet header)."""
        return any(get(h) is not None for h in (SIGNATURE, FORWARDED, KEY, LEGACY_SECRET))

    def sign(self, method: str, path: str, digest: str, *, to: str, key: str | None, now: float | None = None) -> dict[str, str]:
        """The headers of a request from this node to node ``to`` ("" where its name is not known
        yet: a first state poll) on behalf of the key named ``key``; ``digest``: :func:`body_digest`."""
        assert self._secret is not None
        when = f"{time.time() if now is None else now:.3f}"
        nonce = secrets.token_hex(12)
        mac = hmac.new(self._secret, message(method, path, digest, when, nonce, self.name, to, key or ""), hashlib.sha256)
        out = {FORWARDED: self.name, SIGNATURE: f"{_VERSION};t={when};n={nonce};to={to};d={digest};s={mac.hexdigest()}"}
        if key is not None:
            out[KEY] = key
        return out

    def verify(self, method: str, path: str, get: Callable[[str], str | None], *, any_receiver: bool = False, now: float | None = None) -> Signed:
        """The signed request's sender and key name, once its signature holds (see the module
        docstring); Unauthorized when it does not, Forbidden on a node in no fleet.
        ``any_receiver``: a request may name no receiver (the state route: a first poll)."""
        if self._secret is None:
            raise Forbidden("this node is in no fleet (TRIOSHED_FLEET_SECRET is not set): it takes no node-to-node request")
        now = time.time() if now is None else now
        value = get(SIGNATURE)
        fields = _fields(value)
        origin, key = get(FORWARDED) or "", get(KEY)
        earlier = current_signed.get()
        if earlier is not None and earlier.signature == value and earlier.origin == origin and earlier.key == key:
            return earlier  # this request, asked again on its way (not a replay)
        try:
            when = float(fields["t"])
        except ValueError:
            raise _refused("its time is not a number") from None
        if not abs(now - when) <= self.window:
            raise _refused(
                f"its time is {now - when:+.0f} s from this node's clock, outside the {self.window:g} s window "
                "(a replay, or the nodes' clocks disagree: keep them in time with NTP)"
            )
        expected = hmac.new(
            self._secret, message(method, path, fields["d"], fields["t"], fields["n"], origin, fields["to"], key or ""), hashlib.sha256
        ).hexdigest()  # fmt: skip
        if not hmac.compare_digest(expected.encode(), fields["s"].encode("ascii", "replace")):
            raise _refused("its signature does not match (another secret, or the request was changed on its way)")
        if fields["to"] != self.name and not (any_receiver and fields["to"] == ""):
            raise _refused(f"it was signed for node {fields['to'][:100]!r}, not this one")
        nonce = fields["n"]
        second = int(when)
        seen = self._seen.setdefault(second, set())
        if nonce in seen:
            raise _refused("it was received before (a replay)")
        seen.add(nonce)
        if len(self._seen) > 2 * self.window + 4:  # whole seconds older than the window go
            oldest = now - self.window - 1
            for old in [s for s in self._seen if s < oldest]:
                del self._seen[old]
        signed = Signed(origin, key, fields["d"], value or "")
        current_signed.set(signed)
        return signed

    def check_body(self, signed: Signed, body: bytes) -> None:
        """Unauthorized when ``body`` is not the body the request was signed with."""
        if not hmac.compare_digest(body_digest(body).encode(), signed.digest.encode("ascii", "replace")):
            raise _refused("its body is not the one it was signed with")


def _fields(value: str | None) -> dict[str, str]:
    """The signature header's fields; Unauthorized when it is missing or malformed."""
    if not value:
        raise _refused(f"it carries no {SIGNATURE}")
    version, _, rest = value.partition(";")
    if version != _VERSION:
        raise _refused(f"its signature is not of version {_VERSION}")
    fields: dict[str, str] = {}
    for part in rest.split(";"):
        name, eq, field = part.partition("=")
        if not eq:
            raise _refused("its signature is malformed")
        fields[name] = field
    if set(fields) != {"t", "n", "to", "d", "s"} or not fields["n"]:
        raise _refused("its signature is malformed")
    return fields


def _refused(why: str) -> Unauthorized:
    return Unauthorized(f"node-to-node request refused: {why}; nodes sign their requests with the fleet's TRIOSHED_FLEET_SECRET")
