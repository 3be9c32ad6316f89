"""The Origin, Host and API-key rules of :mod:`trioshed.access` (pure)."""

from __future__ import annotations

import pytest

from trioshed.access import (
    allowed_origins,
    host_allowed,
    is_loopback,
    key_matches,
    origin_allowed,
    same_origin,
)

DEFAULTS = allowed_origins()


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost", "https://localhost", "http://localhost:3000", "https://localhost:8443",
        "http://127.0.0.1", "http://127.0.0.1:5173", "https://127.0.0.1:1", "http://0.0.0.0:8080",
        "HTTP://LOCALHOST:3000", "app://obsidian.md", "file://", "tauri://localhost",
        "vscode-webview://1abc", "vscode-file://vscode-app",
    ],
)  # fmt: skip
def test_the_default_origins_are_allowed(origin: str) -> None:
    assert origin_allowed(origin, DEFAULTS)


@pytest.mark.parametrize(
    "origin",
    [
        # the findings: prefixes of an allowed origin are other sites
        "http://localhost.evil.example", "http://127.0.0.1.evil.example", "https://localhost-evil.example",
        "http://localhost:3000.evil.example", "http://localhost:evil", "http://localhost:", "http://localhost@evil.example",
        "http://evil.example", "https://evil.example", "null", "", "http://0.0.0.0.evil.example:80",
        "ftp://localhost", "http://[::1]:3000", "chrome-extension://abcdef",
    ],
)  # fmt: skip
def test_other_origins_are_refused(origin: str) -> None:
    assert not origin_allowed(origin, DEFAULTS)


def test_configured_origins_add_to_the_defaults_with_the_same_wildcard_rules() -> None:
    patterns = allowed_origins(["https://app.example", "https://*.corp.example", "http://box.lan:*", " "])
    assert origin_allowed("https://app.example", patterns)
    assert origin_allowed("https://APP.example", patterns)
    assert not origin_allowed("https://app.example.evil", patterns)
    assert not origin_allowed("https://app.example:444", patterns)
    assert not origin_allowed("http://app.example", patterns)
    assert origin_allowed("https://wiki.corp.example", patterns)
    assert not origin_allowed("https://corp.example.evil", patterns)
    assert not origin_allowed("https://evil.example/.corp.example", patterns)
    assert origin_allowed("http://box.lan:8080", patterns)
    assert not origin_allowed("http://box.lan.evil:8080", patterns)
    assert origin_allowed("http://localhost:3000", patterns)  # the defaults stay
    assert origin_allowed("https://anything.example", allowed_origins(["*"]))


def test_same_origin_is_the_request_s_own_host() -> None:
    assert same_origin("http://box.lan:11434", "box.lan:11434")
    assert not same_origin("http://evil.example", "box.lan:11434")
    assert not same_origin("http://box.lan:11434", "")


@pytest.mark.parametrize(
    ("host", "allowed"),
    [
        (None, True), ("", True), ("localhost", True), ("localhost:11434", True), ("LOCALHOST.:11434", True),
        ("app.localhost:11434", True), ("127.0.0.1:11434", True), ("127.0.0.2", True), ("[::1]:11434", True),
        ("0.0.0.0:11434", True), ("my-box:11434", True), ("My-Box", True),
        ("evil.example", False), ("evil.example:11434", False), ("localhost.evil.example", False),
        ("localhost-evil.example:11434", False), ("my-box.evil.example", False), ("example.local", False),
    ],
)  # fmt: skip
def test_host_names_a_loopback_listener_answers_to(host: str | None, allowed: bool) -> None:
    assert host_allowed(host, "my-box") is allowed


def test_the_key_is_accepted_as_bearer_or_x_api_key() -> None:
    key = "k3y"
    assert key_matches("Bearer k3y", None, key)
    assert key_matches(None, "k3y", key)
    assert key_matches("Bearer wrong", "k3y", key)
    for authorization, x_api_key in ((None, None), ("k3y", None), (None, "Bearer k3y"), (None, "k3"), ("Bearer k3y ", "")):
        assert not key_matches(authorization, x_api_key, key), (authorization, x_api_key)


def test_loopback_listen_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2") and not is_loopback("box.lan")
