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
    role = "user"                 # "user" (default): generate, chat, embed, rerank, show, list;
                                  # "admin": also pull, push, create, copy, delete, load, unload,
                                  # pin, everyone's usage, /metrics, the log tail
    models = ["gemma3*", "qwen3:8b"]  # the models it may use (glob patterns; default: all)
    tokens_per_minute = 20000     # token budgets, prompt + completion (0 = no limit) ...
    tokens_per_day = 2000000
    prompt_tokens_per_day = 0     # ... or separately: prompt_/completion_tokens_per_minute/_day

``TRIOSHED_API_KEY`` is an admin key. With no key configured every request is one tenant (``ANONYMOUS``), as before. A key is found
by comparing the presented token's SHA-256 digest with *every* key's in constant time (no early
exit). Keys made over the API (:mod:`trioshed.api.routes.keys`) live in the store as digests only: the
ring in force is the file's keys merged with the store's (:func:`merge`).
"""

from __future__ import annotations

import fnmatch
import functools
import hashlib
import hmac
import math
import re
from collections import deque
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field, replace
from pathlib import Path

from trioshed._util import read_toml

_LIMITS = ("max_concurrent", "max_queued", "requests_per_minute")
#: Token budgets, enforced from recorded usage (trioshed.usage.ledger): (field, which tokens, window)
BUDGETS: tuple[tuple[str, str, str], ...] = tuple(
    (f"{kind}tokens_per_{window}", kind.rstrip("_") or "total", window)
    for kind in ("", "prompt_", "completion_") for window in ("minute", "day")
)  # fmt: skip
_BUDGET_FIELDS = tuple(b[0] for b in BUDGETS)
#: The whole-number fields of a key: its limits and its budgets (0: none).
LIMIT_FIELDS = (*_LIMITS, *_BUDGET_FIELDS)
ROLES = ("user", "admin")
#: ``TRIOSHED_API_KEY``'s name on every node: no keys file, store or API call may use it.
RESERVED = "default"
_GLOB = re.compile(r"[A-Za-z0-9._:/@*?\[\]!+-]+")


@dataclass(frozen=True)
class ApiKey:
    name: str
    secret: str = field(repr=False, compare=False)
    weight: float = 1.0
    max_concurrent: int = 0  # 0: no limit
    max_queued: int = 0
    requests_per_minute: int = 0
    role: str = "user"
    models: tuple[str, ...] = ()  # glob patterns of the models it may use; () = every model
    tokens_per_minute: int = 0  # 0: no budget
    tokens_per_day: int = 0
    prompt_tokens_per_minute: int = 0
    prompt_tokens_per_day: int = 0
    completion_tokens_per_minute: int = 0
    completion_tokens_per_day: int = 0
    digest: str = field(default="", repr=False, compare=False)  # the secret's (digest()): keys from the store have no secret
    #: Honoured only on the strength of the shared store (made or changed over the API): refused
    #: once the store has not been read for ``TRIOSHED_KEYS_STALE`` (a revoke could be missed).
    stored: bool = field(default=False, repr=False, compare=False)

    @property
    def admin(self) -> bool:
        return self.role == "admin"

    def may_use(self, model: str) -> bool:
        """Whether this key may use (and see) the model named ``model``: one of its patterns
        matches the name, or the name without its ``:latest`` tag."""
        if not self.models:
            return True
        names = (model, model.removesuffix(":latest")) if model.endswith(":latest") else (model,)
        return any(fnmatch.fnmatchcase(n, p) for p in self.models for n in names)

    def budgets(self) -> tuple[tuple[str, str, str, int], ...]:
        """(field, which tokens, window, limit) of each budget this key has."""
        return self._budgets

    @functools.cached_property
    def _budgets(self) -> tuple[tuple[str, str, str, int], ...]:  # asked per request: computed once
        return tuple((f, kind, w, getattr(self, f)) for f, kind, w in BUDGETS if getattr(self, f))


ANONYMOUS = ApiKey("", "", role="admin")  # no keys configured: everyone is one tenant
#: Who asks a public route (``GET /``, the status page, a public ``/metrics``) without a key on a
#: server that has keys: no admin.
PUBLIC = ApiKey("", "", role="user")

#: The key of the request this task serves (set by the HTTP edge's guard; the scheduler reads it).
current_key: ContextVar[ApiKey] = ContextVar("trioshed_api_key", default=ANONYMOUS)


class KeyRing:
    """The configured keys. ``required`` when there is at least one."""

    def __init__(self, keys: Sequence[ApiKey] = ()) -> None:
        names = [k.name for k in keys]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must be unique: {', '.join(sorted(names))}")
        if not all(k.secret or k.digest for k in keys):
            raise ValueError("every API key needs its own non-empty secret")
        digests = [k.digest or digest(k.secret) for k in keys]
        if len(set(digests)) != len(digests):
            raise ValueError("every API key needs its own non-empty secret")
        self.keys = tuple(keys)
        self._digests = tuple(d.encode() for d in digests)
        self._by_name = {k.name: k for k in keys}

    @property
    def required(self) -> bool:
        return bool(self.keys)

    def identify(self, presented: str) -> ApiKey | None:
        """The key whose secret is ``presented``: its digest compared with every key's in constant time."""
        token = digest(presented).encode()
        found = None
        for key, known in zip(self.keys, self._digests, strict=True):
            if hmac.compare_digest(token, known) and found is None and presented:
                found = key
        return found


    def by_name(self, name: str) -> ApiKey | None:
        """The key named ``name`` (a forwarded request's: names are not secrets)."""
        return self._by_name.get(name)

    def identify_headers(self, authorization: str | None, x_api_key: str | None) -> ApiKey | None:
        """The key sent as ``Authorization: Bearer <key>`` or ``x-api-key: <key>``: both are
        always compared, in constant time, so the answer tells neither which nor how close."""
        auth = authorization or ""
        bearer = self.identify(auth[len("Bearer ") :] if auth.startswith("Bearer ") else "")
        header = self.identify(x_api_key or "")
        return bearer or header


def check_glob(pattern: object) -> str:
    """A model pattern of the keys file: a name with ``*``, ``?`` and ``[...]``; ValueError else."""
    if not isinstance(pattern, str) or not pattern or not _GLOB.fullmatch(pattern):
        raise ValueError(f"bad model pattern {pattern!r}: use model names with *, ? or [...]")
    depth = 0
    for c in pattern:  # brackets must pair up and not nest ("[" alone would match itself silently)
        if c == "[":
            if depth:
                raise ValueError(f"bad model pattern {pattern!r}: '[' inside [...]")
            depth = 1
        elif c == "]":
            if not depth:
                raise ValueError(f"bad model pattern {pattern!r}: ']' without '['")
            depth = 0
    if depth:
        raise ValueError(f"bad model pattern {pattern!r}: '[' without ']'")
    if "[]" in pattern or "[!]" in pattern:
        raise ValueError(f"bad model pattern {pattern!r}: empty [...]")
    return pattern


def _line_numbers(text: str) -> tuple[list[int], dict[tuple[int, str], int]]:
    """Where each ``[[key]]`` table starts (1-based lines), and each field's line in table i."""
    starts: list[int] = []
    fields: dict[tuple[int, str], int] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if re.match(r"\[\[\s*key\s*\]\]", stripped):
            starts.append(number)
        elif starts and (m := re.match(r"([A-Za-z0-9_\-\"']+)\s*=", stripped)):
            fields.setdefault((len(starts), m.group(1).strip("\"'")), number)
    return starts, fields


def load_keys_file(path: Path) -> tuple[ApiKey, ...]:
    """``[[key]]`` tables (see the module's docstring); ValueError naming the file, the line and
    the entry."""
    data = read_toml(path, "keys file")
    unknown = set(data) - {"key"}
    if unknown:
        raise ValueError(f"keys file {path}: unknown table {', '.join(sorted(unknown))}; write [[key]] entries")
    try:
        starts, lines = _line_numbers(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        starts, lines = [], {}
    keys = []
    entries = data.get("key", [])
    if not isinstance(entries, list):
        raise ValueError(f"keys file {path}: write [[key]] tables")
    for i, entry in enumerate(entries, start=1):
        start = starts[i - 1] if i <= len(starts) else None

        def where(field: str | None = None, i: int = i, start: int | None = start) -> str:
            line = lines.get((i, field), start) if field else start
            return f"keys file {path}" + (f" line {line}" if line else "") + f": key #{i}"

        if not isinstance(entry, dict):
            raise ValueError(f"{where()}: write [[key]] tables")
        extra = set(entry) - {"name", "key", "weight", "role", "models", *_LIMITS, *_BUDGET_FIELDS}
        if extra:
            first = sorted(extra)[0]
            raise ValueError(f"{where(first)}: unknown field {', '.join(sorted(extra))}")
        name, secret = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not name or not name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"{where('name')}: name must be letters, digits, '-' or '_'")
        if name == RESERVED:
            raise ValueError(f"{where('name')}: the name {RESERVED!r} is TRIOSHED_API_KEY's on every node: choose another")
        if not isinstance(secret, str) or len(secret) < 8:
            raise ValueError(f"{where('key')} ({name}): key must be a string of at least 8 characters")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0 < weight < math.inf:
            raise ValueError(f"{where('weight')} ({name}): weight must be a positive number")
        limits: dict[str, int] = {}
        for limit in (*_LIMITS, *_BUDGET_FIELDS):
            value = entry.get(limit, 0)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where(limit)} ({name}): {limit} must be a whole number, 0 for no limit")
            limits[limit] = value
        role = entry.get("role", "user")
        if role not in ROLES:
            raise ValueError(f"{where('role')} ({name}): role must be \"user\" or \"admin\", not {role!r}")
        models = entry.get("models", [])
        if isinstance(models, str):
            models = [models]
        if not isinstance(models, list) or ("models" in entry and not models):
            raise ValueError(f"{where('models')} ({name}): models must be a list of model names or patterns")
        try:
            patterns = tuple(check_glob(m) for m in models)
        except ValueError as exc:
            raise ValueError(f"{where('models')} ({name}): {exc}") from None
        keys.append(ApiKey(name, secret, float(weight), role=role, models=patterns, **limits))  # type: ignore[arg-type]  # limits: whole numbers only
    return tuple(keys)


def digest(secret: str) -> str:
    """What the store keeps of a secret: SHA-256, hex. A fast hash is right for the long random
    secrets ``trioshed keys create`` makes (32 random bytes); a short secret from a keys file is
    only as strong as it is long."""
    return hashlib.sha256(secret.encode()).hexdigest()


def merge(local: Sequence[ApiKey], stored: Sequence[ApiKey], revoked: frozenset[str] = frozenset()) -> list[ApiKey]:
    """The keys in force: ``TRIOSHED_API_KEY``'s and the file's (``local``), less those revoked
    in the store and those the store holds by name or secret (the store's copy wins: a rotated or
    updated key, in the local key's place), plus the store's other keys; ``stored`` holds no
    revoked key. ``TRIOSHED_API_KEY``'s key (:data:`RESERVED`) is never replaced nor revoked by
    the store, and a stored key of that name is ignored. A store's copy whose secret the file
    holds too is the file's as well (not :attr:`ApiKey.stored`)."""
    by_name = {k.name: k for k in stored if k.name != RESERVED}
    digests = {k.digest for k in by_name.values()}
    out: list[ApiKey] = []
    for k in local:  # in the file's order (the status page's), the store's copy in its place
        mine = k.digest or digest(k.secret)
        if k.name == RESERVED:
            out.append(k)
        elif k.name in by_name:
            copy = by_name.pop(k.name)
            out.append(replace(copy, stored=False) if copy.digest == mine else copy)
        elif k.name not in revoked and mine not in digests:
            out.append(k)
    reserved = {k.digest or digest(k.secret) for k in out if k.name == RESERVED}
    return [*out, *(k for k in by_name.values() if k.digest not in reserved)]


def budgets_need_sharing(keys: Sequence[ApiKey]) -> None:
    """ValueError when ``keys`` give token budgets to nodes of a fleet that share no database:
    each node counts only what it served, so a key could spend its budget once per node."""
    budgeted = [k.name for k in keys if k.budgets()]
    if budgeted:
        raise ValueError(
            f"TRIOSHED_KEYS_FILE gives token budgets ({', '.join(budgeted[:5])}) to a fleet without TRIOSHED_DATABASE: "
            "each node would count only what it served, and a key could spend its budget once per node; "
            "share a PostgreSQL TRIOSHED_DATABASE between the nodes, or remove the budgets"
        )


def keyring(
    api_key: str | None, keys_file: Path | None, stored: Sequence[ApiKey] = (), revoked: frozenset[str] = frozenset()
) -> KeyRing:
    keys = [ApiKey(RESERVED, api_key, role="admin")] if api_key else []
    if keys_file is not None:
        keys += load_keys_file(keys_file)
    return KeyRing(merge(keys, stored, revoked) if stored or revoked else keys)


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
