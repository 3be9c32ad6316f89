"""Settings from ``TRIOSHED_*`` environment variables, CLI flags and a settings file (their values
parsed by :mod:`trioshed.config_values`).

The variable names are part of the product (docs/settings.md lists them; a test keeps the two in step); keep them stable.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trioshed._util import read_toml
from trioshed.config_values import (
    RpcServer,
    parse_bytes,
    parse_devices,
    parse_duration,
    parse_host,
    parse_rpc_servers,
)
from trioshed.core.addresses import fleet_secret, fleet_url, peer_urls, unspecified_address
from trioshed.core.dburl import redact
from trioshed.core.model import KV_CACHE_TYPES, Device
from trioshed.core.speculation import DEFAULT as SPECULATION_DEFAULT
from trioshed.core.speculation import parse_speculation
from trioshed.keys import budgets_need_sharing, keyring


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"invalid boolean {value!r}")


def _auto_bool(value: str) -> bool | None:
    """A boolean, or ``auto`` (None: trioshed chooses)."""
    return None if value.strip().lower() == "auto" else _bool(value)


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 11434
    models: Path = field(default_factory=lambda: Path.home() / ".trioshed" / "models")
    keep_alive: float = 300.0
    max_loaded_models: int = 0
    num_parallel: int = 1
    max_queue: int = 512
    max_extra_wait: float = 5.0  # seconds a request's swap may be held for a loaded model's queue
    load_timeout: float = 300.0
    sched_spread: bool = False
    gpu_overhead: int = 0
    context_length: int = 0  # 0: automatic, per request (trioshed.core.context)
    context_max: int = 0  # caps the automatic context (0: the model's trained context)
    num_thread: int = 0
    kv_cache_type: str = "f16"
    flash_attention: bool | None = None  # None: auto (on where every backend has the kernel)
    llama_server: str | None = None
    devices: tuple[Device, ...] | None = None
    origins: tuple[str, ...] = ()
    api_key: str | None = None
    keys_file: Path | None = None  # more API keys, with names, weights and limits (trioshed.keys)
    #: Usage per key and model (trioshed.usage): the SQLite file (None: usage.db beside the
    #: models folder), and whether usage is recorded at all.
    usage_db: Path | None = None
    usage: bool = True
    #: The shared store of a team of nodes (trioshed.usage.store): ``postgresql://...`` (keys,
    #: usage and budgets shared by every node pointing at it); None: the SQLite file above.
    database: str | None = None
    node_name: str | None = None  # this node's name in usage rows (None: the host name)
    #: When the shared store cannot be read: budgets count what this node knows (False, the
    #: default: serving goes on) or keys with budgets are refused (True).
    budgets_fail_closed: bool = False
    runner_verbose: bool = True
    rpc_servers: tuple[RpcServer, ...] = ()
    rpc_allow_public: bool = False
    rpc_probe_interval: float = 30.0
    log_format: str = "text"  # "json": one JSON object per log line, one line per request
    shutdown_timeout: float = 10.0
    stream_idle_timeout: float = 300.0
    stream_batch: float = 0.05  # under load, the longest a stream waits between reads of its runner
    stream_batch_from: int = 8  # concurrent streams from which the batching applies
    max_body: int = 32 * 1024 * 1024
    http_idle_timeout: float = 30.0
    max_connections: int = 512
    allow_symlinks: bool = False
    metrics_public: bool = False  # GET /metrics without an API key (an endpoint picker sends none)
    #: Warm returns: where slots are saved before an unload, the disk budget (0 disables the
    #: feature) and how long an unload waits for a save (trioshed.runner.slots).
    kv_cache_dir: Path = field(default_factory=lambda: _cache_home() / "trioshed" / "kv")
    kv_cache_budget: int = 4 * 1024**3
    kv_save_timeout: float = 5.0
    #: llama-server's ``--cache-ram`` per runner (host-memory prompt cache), counted in its
    #: system-memory estimate; 0 turns that cache off.
    cache_ram: int = 1024**3
    vulkan_software: bool = False  # use software Vulkan devices (lavapipe): tests, CI
    #: Serve the generating routes as plain ASGI (trioshed.api.pipeline.fast_path); off: through Quart, as
    #: every other route (same answers, more CPU per request; for comparing the two).
    fast_routes: bool = True
    #: Speculative decoding for every runner unless models.toml says otherwise
    #: (trioshed.core.speculation: off, ngram, or an n-gram kind by llama.cpp's name).
    speculation: str = SPECULATION_DEFAULT
    #: Runners with batch-invariant kernels: flash attention on and weights not repacked, so a
    #: token checked in a verification batch gets the numbers it gets alone
    #: (RunnerOptions.batch_invariant).
    batch_invariant: bool = False
    #: A fleet (trioshed.fleet): the other nodes' URLs, the secret every node shares (no fleet
    #: without it), how often the nodes' states are read, and how old a state may be before
    #: routing ignores the node. Its name in the fleet is ``node_name`` (None: the host name and
    #: port there).
    peers: tuple[str, ...] = ()
    fleet_secret: str | None = field(default=None, repr=False)
    fleet_interval: float = 1.0
    fleet_stale: float = 5.0
    #: Where the other nodes reach this one, written to the shared database for them (nodes that
    #: find each other through ``database``, no ``peers``); None: http://<host>:<port>.
    fleet_url: str | None = None
    #: The certificates nodes reached over https:// are verified against (None: the system's), and
    #: how far a signed node-to-node request's time may be from this node's clock.
    fleet_ca: Path | None = None
    fleet_window: float = 30.0
    #: How long keys made over the API are honoured without a reading of a shared store (trioshed.usage.keysync).
    keys_stale: float = 30.0

    @classmethod
    def from_env(
        cls, env: Mapping[str, str] | None = None, *, file: Path | None = None, **overrides: object
    ) -> Settings:
        """Settings from, by precedence: ``overrides`` (CLI flags), ``TRIOSHED_*`` variables,
        the settings ``file`` (TOML), the defaults. A bad value raises ValueError naming the
        variable, or the file and the key."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = load_settings_file(file) if file is not None else {}
        for name in SETTING_NAMES:
            raw = env.get(f"TRIOSHED_{name.upper()}")
            if raw in (None, ""):
                continue
            assert raw is not None
            try:
                kwargs.update(_parse_setting(name, raw))
            except ValueError as exc:
                shown = redact(raw) if name == "database" else "***" if name in _SECRETS else raw  # never a secret
                raise ValueError(f"TRIOSHED_{name.upper()}={shown!r}: {exc}") from None
        kwargs.update(overrides)
        settings = cls(**kwargs)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        if self.context_length < 0 or self.context_max < 0:
            raise ValueError("TRIOSHED_CONTEXT_LENGTH and TRIOSHED_CONTEXT_MAX must be 0 (automatic) or more")
        for name in ("num_parallel", "max_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"TRIOSHED_{name.upper()} must be at least 1")
        if self.max_loaded_models < 0:
            raise ValueError("TRIOSHED_MAX_LOADED_MODELS must be 0 (automatic) or more")
        if self.keys_file is not None:
            keyring(self.api_key, self.keys_file)  # a bad keys file stops serve at start-up
        if self.peers and not self.fleet_secret:
            raise ValueError("TRIOSHED_PEERS needs TRIOSHED_FLEET_SECRET: nodes trust each other only with the fleet's secret")
        if problem := self.fleet_url_problem():
            raise ValueError(problem)
        if self.fleet_discovery == "peers" and not self.database and self.keys_file is not None:
            budgets_need_sharing(keyring(None, self.keys_file).keys)  # N nodes would count N budgets

    @property
    def fleet_discovery(self) -> str:
        """How this node finds the other nodes of its fleet: ``"peers"`` (the static list),
        ``"database"`` (the shared PostgreSQL, no list), or ``""`` (in no fleet)."""
        if not self.fleet_secret:
            return ""
        return "database" if self.database and not self.peers else "peers"

    def fleet_url_problem(self) -> str | None:
        """Why this node cannot say where the other nodes reach it (None: it can)."""
        if self.fleet_discovery != "database" or self.fleet_url or not unspecified_address(self.host):
            return None
        return (f"TRIOSHED_HOST={self.host} listens on every address and names none the other nodes of the fleet can reach: "
                "set TRIOSHED_FLEET_URL to this node's http://host:port as they see it (written to TRIOSHED_DATABASE for them)")  # fmt: skip

    @property
    def usage_path(self) -> Path:
        """TRIOSHED_USAGE_DB, else ``<store>.usage.db`` beside the (first) models folder: one per
        store, never shared by a sibling store's server (see trioshed.usage.location)."""
        if self.usage_db is not None:
            return Path(self.usage_db)
        text = str(self.models)  # one folder, or several ":"-separated (as trioshed.models.stores reads it)
        first = Path(text if Path(text).expanduser().is_dir() or os.pathsep not in text else text.split(os.pathsep)[0]).expanduser()
        return first.parent / f"{first.name or 'models'}.usage.db"

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]


def _cache_home() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")


def _kv_cache_type(value: str) -> str:
    value = value.strip().lower()
    if value not in KV_CACHE_TYPES:
        raise ValueError(f"use one of {', '.join(KV_CACHE_TYPES)}")
    return value


def _log_format(value: str) -> str:
    value = value.strip().lower()
    if value not in ("text", "json"):
        raise ValueError("use text or json")
    return value


def _positive_timeout(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds


def _stream_batch(value: str) -> float:
    seconds = parse_duration(value)
    if not 0 <= seconds <= 1:
        raise ValueError("must be a duration from 0 (off) to 1s, like '50ms'")
    return seconds


def _extra_wait(seconds: float) -> float:
    if seconds < 0 or seconds == math.inf:  # parse_duration reads a negative as "forever"
        raise ValueError("must be 0 (arrival order) or a number of seconds: a request is never passed over without bound")
    return seconds


def _at_least(minimum: int, what: str = "") -> Callable[[str], int]:
    def parse(value: str) -> int:
        number = int(value)
        if number < minimum:
            raise ValueError(f"must be at least {minimum}{what}")
        return number

    return parse


def _database_url(value: str) -> str:
    """``postgresql://`` or ``postgres://`` URL (its password is never repeated in an error)."""
    if not value.startswith(("postgresql://", "postgres://")):
        raise ValueError("write a postgresql://user:password@host:port/database URL (SQLite needs no setting: TRIOSHED_USAGE_DB)")
    return value


def _node_name(value: str) -> str:
    if not value.replace("-", "").replace("_", "").replace(".", "").isalnum() or len(value) > 100:
        raise ValueError("a node name is letters, digits, '.', '-' or '_' (at most 100)")
    return value


#: Every setting: its name in a settings file, and (upper-cased, prefixed) its variable.
_PARSERS: dict[str, Callable[[str], object]] = {
    "host": parse_host,
    "models": lambda v: Path(v).expanduser(),
    "keep_alive": parse_duration,
    "max_loaded_models": _at_least(0, " (0 = automatic)"),
    "num_parallel": _at_least(1),
    "max_queue": _at_least(1),
    "max_extra_wait": lambda v: _extra_wait(parse_duration(v)),
    "load_timeout": lambda v: _positive_timeout(parse_duration(v)),
    "sched_spread": _bool,
    "gpu_overhead": parse_bytes,
    "context_length": _at_least(0, " (0 = automatic)"),
    "context_max": _at_least(0, " (0 = the model's trained context)"),
    "num_thread": _at_least(0, " (0 = llama-server's choice)"),
    "kv_cache_type": _kv_cache_type,
    "flash_attention": _auto_bool,
    "llama_server": str,
    "devices": parse_devices,
    "origins": lambda v: tuple(o.strip() for o in v.split(",") if o.strip()),
    "api_key": str,
    "keys_file": lambda v: Path(v).expanduser(),
    "usage_db": lambda v: Path(v).expanduser(),
    "usage": _bool,
    "database": _database_url,
    "node_name": _node_name,
    "budgets_fail_closed": _bool,
    "rpc_servers": parse_rpc_servers,
    "rpc_allow_public": _bool,
    "rpc_probe_interval": lambda v: _positive_timeout(parse_duration(v)),
    "log_format": _log_format,
    "shutdown_timeout": parse_duration,
    "stream_idle_timeout": lambda v: _positive_timeout(parse_duration(v)),
    "stream_batch": _stream_batch,
    "stream_batch_from": _at_least(1),
    "max_body": parse_bytes,
    "http_idle_timeout": lambda v: _positive_timeout(parse_duration(v)),
    "max_connections": _at_least(1),
    "allow_symlinks": _bool,
    "metrics_public": _bool,
    "kv_cache_dir": lambda v: Path(v).expanduser(),
    "kv_cache_budget": parse_bytes,
    "kv_save_timeout": lambda v: _positive_timeout(parse_duration(v)),
    "cache_ram": parse_bytes,
    "vulkan_software": _bool,
    "fast_routes": _bool,
    "speculation": parse_speculation,
    "batch_invariant": _bool,
    "peers": peer_urls,
    "fleet_secret": fleet_secret,
    "fleet_interval": lambda v: _positive_timeout(parse_duration(v)),
    "fleet_stale": lambda v: _positive_timeout(parse_duration(v)),
    "fleet_url": fleet_url,
    "fleet_ca": lambda v: Path(v).expanduser(),
    "fleet_window": lambda v: _positive_timeout(parse_duration(v)),
    "keys_stale": lambda v: _positive_timeout(parse_duration(v)),
}
_SECRETS = ("api_key", "fleet_secret")
SETTING_NAMES = tuple(_PARSERS)


def _parse_setting(name: str, raw: str) -> dict[str, object]:
    if name == "host":
        host, port = parse_host(raw)
        return {"host": host, "port": port}
    return {name: _PARSERS[name](raw)}


def load_settings_file(path: Path) -> dict[str, object]:
    """Read a settings file: TOML with one key per setting, named like its variable without
    the prefix, in lower case (``keep_alive = "10m"`` for TRIOSHED_KEEP_ALIVE). Values are the
    TOML type that fits (numbers, booleans; a list of strings for ``origins``) or a string as
    the variable would hold it. A relative ``models`` or ``llama_server`` path is taken from the
    file's folder. Raises ValueError naming the file (and the key) on any problem."""
    data = read_toml(path, "settings file")
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        if key not in _PARSERS:
            plain = key.upper().removeprefix("TRIOSHED_").lower()
            hint = f" (write {plain!r}, without the TRIOSHED_ prefix, in lower case)" if plain in _PARSERS else ""
            raise ValueError(f"settings file {path}: unknown key {key!r}{hint}; known keys: {', '.join(_PARSERS)}")
        try:
            raw = _file_value(key, value)
            relative = not Path(raw).expanduser().is_absolute()
            if relative and (key in ("models", "kv_cache_dir", "keys_file", "usage_db", "fleet_ca") or (key == "llama_server" and "/" in raw)):
                raw = str(Path(path).parent / raw)  # a bare llama_server name is looked up on PATH
            kwargs.update(_parse_setting(key, raw))
        except ValueError as exc:
            shown = redact(str(value)) if key == "database" else "***" if key in _SECRETS else value  # never a secret
            raise ValueError(f"settings file {path}: {key} = {shown!r}: {exc}") from None
    return kwargs


def _file_value(key: str, value: object) -> str:
    """A TOML value as the string the environment variable would hold."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    lists = ("origins", "rpc_servers", "peers")
    if key in lists and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    raise ValueError("must be a string, a number or a boolean" + (" (or a list of strings)" if key in lists else ""))
