"""Addresses in the settings: whether a host names every address, and a fleet node's URL (pure)."""

from __future__ import annotations

import ipaddress
import re


def unspecified_address(host: str) -> bool:
    """Whether ``host`` is 0.0.0.0 or :: (every address: none another machine could dial)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return host in ("", "*")


def fleet_url(value: str) -> str:
    """``http://10.0.0.2:11434``: where the other nodes reach this one (trioshed's own HTTP/1.1
    client relays to it: plain HTTP, an explicit port)."""
    url = value.strip().rstrip("/")
    found = re.fullmatch(r"http://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", url)
    if found is None or not 0 < int(found.group(2)) < 65536:
        raise ValueError("use http://host:port, this node's address as the other nodes of the fleet reach it")
    if unspecified_address(found.group(1)):
        raise ValueError("0.0.0.0 and :: are no address another node can reach: give this node's own")
    return url
