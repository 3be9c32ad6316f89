"""The settings' values as people write them: durations (``"5m"``, ``"-1"``), byte sizes
(``"24GiB"``), a declared device inventory, RPC servers, the listen address; parsed into plain
values, with an error that says how to write them (pure, no I/O)."""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

from trioshed.core.model import Device

__all__ = [
    "LONGEST_DURATION",
    "RpcServer",
    "is_private_address",
    "parse_bytes",
    "parse_devices",
    "parse_duration",
    "parse_host",
    "parse_rpc_servers",
]

_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_BYTE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4,
}  # fmt: skip


#: Go's longest ``time.Duration`` in seconds (~292 years): what Ollama's keep-alive can hold.
LONGEST_DURATION = 2**63 / 1e9


def parse_duration(value: str | int | float | None) -> float:
    """Parse an Ollama-style keep-alive into seconds: ``math.inf`` means forever.

    Accepts numbers (seconds), numeric strings, and Go durations (``"5m"``, ``"1h30m"``, ``"-1m"``).
    Any negative value means "keep forever", and so does one of :data:`LONGEST_DURATION` or more
    (``1e308``, ``"9999999999h"``); 0 means "unload as soon as idle".
    """
    if value is None:
        raise ValueError("duration is missing")
    if isinstance(value, bool) or not isinstance(value, int | float | str):
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
    # Negative, or longer than Go's longest duration (~292 years): forever, as Ollama keeps it
    return math.inf if seconds < 0 or seconds >= LONGEST_DURATION else seconds


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


@dataclass(frozen=True)
class RpcServer:
    """One ``TRIOSHED_RPC_SERVERS`` entry: a llama.cpp ``rpc-server`` trioshed may place layers on.

    ``declared`` caps the memory trioshed uses there (None: what the server reports).
    """

    host: str
    port: int
    declared: int | None = None

    @property
    def address(self) -> str:
        """``host:port`` as llama-server's ``--rpc`` takes it (IPv6 in brackets)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def device_id(self) -> str:
        return f"rpc:{self.address}"


def parse_rpc_servers(value: str) -> tuple[RpcServer, ...]:
    """``"10.0.0.2:50052=24GiB,gpu-box:50052"`` → endpoints (the port is required)."""
    servers = []
    for item in filter(None, (part.strip() for part in value.split(","))):
        where, _, size = item.partition("=")
        if where.startswith("["):
            host, _, rest = where[1:].partition("]")
            port = rest.removeprefix(":")
        else:
            host, _, port = where.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or "/" in host:
            raise ValueError(f"invalid RPC server {item!r}: use host:port or host:port=24GiB")
        servers.append(RpcServer(host, int(port), parse_bytes(size) if size else None))
    if len({s.address for s in servers}) != len(servers):
        raise ValueError("an RPC server is listed twice")
    return tuple(servers)


def is_private_address(address: str) -> bool:
    """Loopback, RFC 1918/4193 private, link-local or CGNAT (100.64/10, e.g. a tailnet)."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    cgnat = isinstance(ip, ipaddress.IPv4Address) and ip in ipaddress.ip_network("100.64.0.0/10")
    return bool(ip.is_loopback or ip.is_private or ip.is_link_local or cgnat)


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
