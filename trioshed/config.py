"""Settings from ``TRIOSHED_*`` environment variables and CLI flags, plus value parsers.

The variable names are part of the product (see the README table); keep them stable.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from trioshed.core.model import KV_CACHE_TYPES, Device

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip


def parse_duration(value: str | int | float | None) -> float:
    """Parse an Ollama-style keep-alive into seconds: ``math.inf`` means forever.

    Accepts numbers (seconds), numeric strings, and Go durations (``"5m"``, ``"1h30m"``, ``"-1m"``).
    Any negative value means "keep forever"; 0 means "unload as soon as idle".
    """
    if value is None:
        raise ValueError("duration is missing")
    if isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip()
        if not text:
            raise ValueError("duration is empty")
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            pos, total = 0, 0.0
            for match in _DURATION_PART.finditer(body):
                if match.start() != pos:
                    break
                total += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
                pos = match.end()
            if pos != len(body) or pos == 0:
                raise ValueError(
                    f"invalid duration {value!r}: use seconds or a duration like '5m', '1h', '-1'"
                ) from None
            seconds = sign * total
    if math.isnan(seconds):
        raise ValueError(f"invalid duration {value!r}")
    return math.inf if seconds < 0 else seconds


def parse_bytes(value: str | int) -> int:
    """``"24GiB"`` → 25769803776; plain integers are bytes."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
    if not match or match.group(2).lower() not in _BYTE_UNITS:
        raise ValueError(f"invalid size {value!r}: use bytes or a size like '24GiB', '512MiB'")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def parse_devices(value: str) -> tuple[Device, ...]:
    """Parse a declared inventory: ``"cuda:0=24GiB,cuda:1=12GiB"``."""
    devices = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        ident, sep, size = item.partition("=")
        library, sep2, index = ident.partition(":")
        if not sep or not sep2 or not index.isdigit() or not library.isidentifier():
            raise ValueError(
                f"invalid device {item!r} in TRIOSHED_DEVICES: use 'cuda:0=24GiB,cuda:1=12GiB'"
            )
        total = parse_bytes(size)
        devices.append(Device(ident, library, int(index), total, total, name=f"declared {ident}"))
    if len({d.id for d in devices}) != len(devices):
        raise ValueError(f"duplicate device in TRIOSHED_DEVICES={value!r}")
    return tuple(devices)


def parse_host(value: str) -> tuple[str, int]:
    """``"127.0.0.1:11434"``, ``":8080"``, ``"0.0.0.0"``, ``"[::1]:80"`` → (host, port)."""
    text = value.strip().removeprefix("http://")
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.removeprefix(":")
    elif text.count(":") == 1:
        host, _, port = text.partition(":")
    else:
        host, port = text, ""
    if port and not port.isdigit():
        raise ValueError(f"invalid TRIOSHED_HOST {value!r}: use host:port")
    return host or "127.0.0.1", int(port) if port else 11434


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off", ""}:
        return False
    raise ValueError(f"invalid boolean {value!r}")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 11434
    models: Path = field(default_factory=lambda: Path.home() / ".trioshed" / "models")
    keep_alive: float = 300.0
    max_loaded_models: int = 0
    num_parallel: int = 1
    max_queue: int = 512
    load_timeout: float = 300.0
    sched_spread: bool = False
    gpu_overhead: int = 0
    context_length: int = 4096
    num_thread: int = 0
    kv_cache_type: str = "f16"
    flash_attention: bool = False
    llama_server: str | None = None
    devices: tuple[Device, ...] | None = None
    origins: tuple[str, ...] = ()
    api_key: str | None = None
    runner_verbose: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: object) -> Settings:
        """Read ``TRIOSHED_*`` variables; a bad value raises ValueError naming the variable."""
        env = os.environ if env is None else env
        kwargs: dict[str, object] = {}

        def get(name: str) -> str | None:
            value = env.get(f"TRIOSHED_{name}")
            return value if value not in (None, "") else None

        parsers = {
            "HOST": None,
            "MODELS": lambda v: Path(v).expanduser(),
            "KEEP_ALIVE": parse_duration,
            "MAX_LOADED_MODELS": int,
            "NUM_PARALLEL": int,
            "MAX_QUEUE": int,
            "LOAD_TIMEOUT": lambda v: _positive_timeout(parse_duration(v)),
            "SCHED_SPREAD": _bool,
            "GPU_OVERHEAD": parse_bytes,
            "CONTEXT_LENGTH": int,
            "NUM_THREAD": int,
            "KV_CACHE_TYPE": _kv_cache_type,
            "FLASH_ATTENTION": _bool,
            "LLAMA_SERVER": str,
            "DEVICES": parse_devices,
            "ORIGINS": lambda v: tuple(o.strip() for o in v.split(",") if o.strip()),
            "API_KEY": str,
        }
        for name, parse in parsers.items():
            raw = get(name)
            if raw is None:
                continue
            try:
                if name == "HOST":
                    kwargs["host"], kwargs["port"] = parse_host(raw)
                else:
                    assert parse is not None
                    kwargs[name.lower()] = parse(raw)
            except ValueError as exc:
                raise ValueError(f"TRIOSHED_{name}={raw!r}: {exc}") from None
        kwargs.update(overrides)
        settings = cls(**kwargs)  # type: ignore[arg-type]
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in ("num_parallel", "max_queue", "context_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"TRIOSHED_{name.upper()} must be at least 1")
        if self.max_loaded_models < 0:
            raise ValueError("TRIOSHED_MAX_LOADED_MODELS must be 0 (automatic) or more")

    def with_(self, **changes: object) -> Settings:
        return replace(self, **changes)  # type: ignore[arg-type]


def _kv_cache_type(value: str) -> str:
    value = value.strip().lower()
    if value not in KV_CACHE_TYPES:
        raise ValueError(f"use one of {', '.join(KV_CACHE_TYPES)}")
    return value


def _positive_timeout(seconds: float) -> float:
    if seconds <= 0:
        raise ValueError("must be positive")
    return seconds
