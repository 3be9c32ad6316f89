"""Signed node-to-node requests (:mod:`trioshed.fleet.auth`), with the clock passed in: a request
holds once, for its receiver, with its body, within the window; any change of what was signed,
a replay, another secret or the old bearer header is refused; the peers' and database rows'
addresses and the fleet secret are checked at start."""

from __future__ import annotations

import contextvars
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trioshed.config import Settings
from trioshed.errors import Forbidden, Unauthorized
from trioshed.fleet.auth import FORWARDED, KEY, SIGNATURE, FleetAuth, body_digest, current_signed

SECRET = "a-fleet-secret-of-32-characters!"
NOW = 1_800_000_000.0
BODY = b'{"model": "m1", "prompt": "hi"}'


def signed_by(a: FleetAuth, *, key: str | None = "alice", to: str = "B", body: bytes = BODY, now: float = NOW) -> dict[str, str]:
    return a.sign("POST", "/api/generate", body_digest(body), to=to, key=key, now=now)


def verify(b: FleetAuth, headers: dict[str, str], *, path: str = "/api/generate", now: float = NOW, body: bytes = BODY) -> str | None:
    """``headers`` checked as a request of its own (its own context, as each request's task has)."""

    def request() -> str | None:
        signed = b.verify("POST", path, lambda name: next((v for k, v in headers.items() if k.lower() == name.lower()), None), now=now)
        b.check_body(signed, body)
        return signed.key

    return contextvars.copy_context().run(request)


def test_a_signed_request_holds_once_for_its_receiver_with_its_body_within_the_window() -> None:
    a, b = FleetAuth(SECRET, "A"), FleetAuth(SECRET, "B", window=30)
    headers = signed_by(a)
    assert headers[KEY] == "alice" and headers[FORWARDED] == "A" and SECRET not in str(headers)
    assert verify(b, headers, now=NOW + 29) == "alice"
    with pytest.raises(Unauthorized, match="a replay"):
        verify(b, headers, now=NOW + 29)
    for late in (NOW + 31, NOW - 31):  # outside the window either way (a replay later, or clocks apart)
        with pytest.raises(Unauthorized, match="outside the 30 s window"):
            verify(b, signed_by(a, now=NOW), now=late)
    with pytest.raises(Unauthorized, match="not the one it was signed with"):
        verify(b, signed_by(a), body=BODY.replace(b"hi", b"ho"))
    with pytest.raises(Unauthorized, match="signed for node 'C'"):
        verify(b, signed_by(a, to="C"))
    assert verify(b, signed_by(a, key=None)) is None  # no key: the receiver decides what that is worth


@pytest.mark.parametrize(
    "change",
    [
        lambda h: {**h, KEY: "boss"},  # another key's name
        lambda h: {**h, FORWARDED: "C"},  # another sender
        lambda h: {k: v for k, v in h.items() if k != KEY},  # the key dropped
        lambda h: {**h, SIGNATURE: h[SIGNATURE].replace(";t=", ";t=1")},  # another time
        lambda h: {**h, SIGNATURE: h[SIGNATURE][:-1] + ("0" if h[SIGNATURE][-1] != "0" else "1")},  # the MAC
        lambda h: {**h, SIGNATURE: h[SIGNATURE].replace("v1;", "v2;")},
        lambda h: {**h, SIGNATURE: "garbage"},
        lambda h: {k: v for k, v in h.items() if k != SIGNATURE},
        lambda h: {"X-Trioshed-Fleet-Secret": SECRET, KEY: '{"name": "m", "role": "admin"}', FORWARDED: "A"},  # the old bearer
    ],
)
def test_anything_changed_in_what_was_signed_is_refused(change) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(Unauthorized):
        verify(FleetAuth(SECRET, "B"), change(signed_by(FleetAuth(SECRET, "A"))))


def test_another_path_or_secret_and_a_node_in_no_fleet() -> None:
    headers = signed_by(FleetAuth(SECRET, "A"))
    with pytest.raises(Unauthorized):
        verify(FleetAuth(SECRET, "B"), headers, path="/api/chat")
    with pytest.raises(Unauthorized, match="signature does not match"):
        verify(FleetAuth("another-secret-0123456789", "B"), headers)
    with pytest.raises(Forbidden, match="in no fleet"):
        verify(FleetAuth(None, "B"), headers)


def test_the_same_request_checked_twice_on_its_way_is_not_its_own_replay() -> None:
    b = FleetAuth(SECRET, "B")
    headers = signed_by(FleetAuth(SECRET, "A"))
    get = lambda name: next((v for k, v in headers.items() if k.lower() == name.lower()), None)  # noqa: E731

    def request() -> None:
        first = b.verify("POST", "/api/generate", get, now=NOW)
        assert current_signed.get() is first
        assert b.verify("POST", "/api/generate", get, now=NOW) is first  # the fast path handing it to Quart

    contextvars.copy_context().run(request)
    with pytest.raises(Unauthorized, match="a replay"):  # another request (another task) with the same headers
        verify(b, headers)


def test_nonces_are_forgotten_once_their_time_is_outside_the_window() -> None:
    a, b = FleetAuth(SECRET, "A"), FleetAuth(SECRET, "B", window=5)
    for second in range(200):
        verify(b, signed_by(a, now=NOW + second), now=NOW + second)
    assert len(b._seen) <= 2 * 5 + 5


def test_the_secret_and_the_nodes_addresses_are_checked_at_start() -> None:
    for bad, words in (("short", "at least 16"), ("naïve-secret-with-accent", "ASCII"), ("spaced secret 0123456789", "ASCII")):
        with pytest.raises(ValueError, match=words) as exc:
            Settings.from_env({"TRIOSHED_FLEET_SECRET": bad, "TRIOSHED_PEERS": "http://10.0.0.2:11434"})
        assert bad not in str(exc.value) and "TRIOSHED_FLEET_SECRET" in str(exc.value)
    fleet = {"TRIOSHED_FLEET_SECRET": SECRET}
    ok = Settings.from_env({**fleet, "TRIOSHED_PEERS": "http://10.0.0.2:11434, https://node3.internal:8443/,https://[::1]"})
    assert ok.peers == ("http://10.0.0.2:11434", "https://node3.internal:8443", "https://[::1]")
    for bad in ("http://10.0.0.2:99999", "http://10.0.0.2:0", "ftp://10.0.0.2:1", "http://10.0.0.2:1/path", "10.0.0.2:11434"):
        with pytest.raises(ValueError, match="TRIOSHED_PEERS"):
            Settings.from_env({**fleet, "TRIOSHED_PEERS": bad})


def test_certificates_that_cannot_be_read_stop_the_node_at_start_naming_the_setting(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    bad = tmp_path / "not-a-ca.pem"
    bad.write_text("not a certificate\n")
    for path in (bad, tmp_path / "missing.pem"):
        env = {**os.environ, "TRIOSHED_MODELS": str(tmp_path / "models"), "TRIOSHED_FLEET_SECRET": SECRET, "TRIOSHED_FLEET_CA": str(path),
               "TRIOSHED_PEERS": "https://127.0.0.1:9", "TRIOSHED_HOST": "127.0.0.1:0", "TRIOSHED_USAGE": "0"}  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "trioshed", "serve"], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"TRIOSHED_FLEET_CA={path}: not a readable PEM file of certificates" in done.stdout + done.stderr
        assert "Traceback" not in done.stdout + done.stderr
