"""Addresses and secrets in the settings: whether a host names every address, a fleet node's
URL, the peers' list and the fleet's secret (pure)."""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

#: The fewest characters of a fleet secret: it keys the HMAC every node-to-node request is signed
#: with, and one captured request lets anyone try guesses offline.
SECRET_LENGTH = 16


def unspecified_address(host: str) -> bool:
    """Whether ``host`` is 0.0.0.0 or :: (every address: none another machine could dial)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def node_url(value: str, *, port_required: bool = False) -> str:
    """``http://host:port`` or ``https://host:port`` (no path), trailing ``/`` dropped; ValueError
    for anything else, a port out of 1-65535 included."""
    url = value.strip().rstrip("/")
    found = re.fullmatch(r"(https?)://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+)(?::(\d{1,5}))?", url)
    if found is None or (port_required and found.group(3) is None):
        raise ValueError(f"invalid node URL {url[:200]!r}: use http://host:port or https://host:port")
    if found.group(3) is not None and not 0 < int(found.group(3)) < 65536:
        raise ValueError(f"invalid node URL {url[:200]!r}: its port must be 1-65535")
    if found.group(2).startswith("["):
        try:
            ipaddress.IPv6Address(found.group(2)[1:-1])
        except ValueError:
            raise ValueError(f"invalid node URL {url[:200]!r}: not an IPv6 address in brackets") from None
    urlsplit(url).port  # noqa: B018  # the reader every node uses agrees (raises ValueError else)
    return url


def fleet_url(value: str) -> str:
    """``http://10.0.0.2:11434`` (or ``https://``, where a TLS proxy stands in front of the node):
    where the other nodes reach this one, with an explicit port."""
    try:
        url = node_url(value, port_required=True)
    except ValueError:
        raise ValueError("use http://host:port (or https://host:port), this node's address as the other nodes of the fleet reach it") from None
    if unspecified_address(urlsplit(url).hostname or ""):
        raise ValueError("0.0.0.0 and :: are no address another node can reach: give this node's own")
    return url


def peer_urls(value: str) -> tuple[str, ...]:
    """``"http://10.0.0.2:11434,https://node3.internal"`` -> the nodes' base URLs."""
    urls: list[str] = []
    for part in value.split(","):
        if part.strip():
            try:
                urls.append(node_url(part))
            except ValueError as exc:
                raise ValueError(f"{exc} (comma-separated)") from None
    return tuple(urls)


def fleet_secret(value: str) -> str:
    """The fleet's secret: at least :data:`SECRET_LENGTH` visible ASCII characters (it is the
    key of the signatures; any byte outside ASCII would break every node-to-node request)."""
    if not re.fullmatch(r"[\x21-\x7e]*", value):
        raise ValueError("use visible ASCII characters only (letters, digits, punctuation; no spaces), e.g. `openssl rand -hex 32`")
    if len(value) < SECRET_LENGTH:
        raise ValueError(f"use at least {SECRET_LENGTH} characters (a long random string, e.g. `openssl rand -hex 32`)")
    return value
