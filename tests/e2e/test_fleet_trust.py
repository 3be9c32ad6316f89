"""Trust between real trioshed nodes on loopback: a captured forwarded request cannot be sent
again (at once, with another body, after the window), changed on its way, or read for a secret;
node-to-node headers grant nothing on routes never forwarded, and nothing without a key where keys
are required; an ``https://`` peer is reached over verified TLS (HAProxy terminating it in front
of the node); a client's ``Origin`` and headers that are not ASCII do not break a relay; a
transcription's form is relayed whole."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.fleet_nodes import Node, sees, wait_until
from tests.support.haproxy import HAPROXY, needs_haproxy
from tests.support.tcp_proxy import open_tcp_proxy
from trioshed.fleet.auth import FleetAuth, body_digest
from trioshed.testing.llama import free_port
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model
from trioshed.testing.vision import tiny_wav, write_tiny_audio_projector

pytestmark = pytest.mark.slow

SECRET = "fleet-trust-test-secret"
ALICE, BOSS = "alice-secret-0001", "boss-secret-0001"
GEN = {"model": "m1", "prompt": "hi", "stream": False, "options": {"num_predict": 2}}
FLEET = {"fleet_secret": SECRET, "fleet_interval": 0.1, "fleet_stale": 2.0}


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.toml"
    path.write_text(f'[[key]]\nname = "alice"\nkey = "{ALICE}"\n')
    return path


async def send_raw(port: int, data: bytes) -> tuple[int, bytes]:
    """``data`` (a whole HTTP/1.1 request) sent as it is; the answer's status and body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        while b"\r\n\r\n" not in got:
            got += await stream.receive_some(65536)
        head, _, body = got.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
        while len(body) < length:
            body += await stream.receive_some(65536)
    return int(head.split(b" ")[1]), body


@asynccontextmanager
async def two_nodes(tmp_path: Path, store: Path, *, a: dict[str, object], b: dict[str, object], via_proxy: bool = False) -> AsyncIterator[tuple[Node, Node, object]]:
    """Node B, then node A knowing B (through a recording TCP proxy when ``via_proxy``), m1 warm
    on B and seen so by A."""
    port_a, port_b = free_port(), free_port()
    record_a: list[tuple[str, str]] = []
    record_b: list[tuple[str, str]] = []
    async with open_test_server(store, record=record_b, port=port_b, node_name="B", peers=(f"http://127.0.0.1:{port_a}",), **{**FLEET, **b}) as server_b:
        async with open_tcp_proxy(port_b) as proxy:
            url_b = f"http://127.0.0.1:{proxy.port if via_proxy else port_b}"
            async with open_test_server(store, record=record_a, port=port_a, node_name="A", peers=(url_b,), **{**FLEET, **a}) as server_a:
                node_a, node_b = Node("A", server_a, record_a), Node("B", server_b, record_b)
                async with httpx.AsyncClient(timeout=60) as http:
                    warm = await http.post(server_b.base_url + "/api/generate", json=GEN, headers={"Authorization": f"Bearer {ALICE}"})
                    assert warm.status_code == 200, warm.text
                await wait_until(lambda: sees(node_a, node_b, "m1:latest"), node_a)
                yield node_a, node_b, proxy


async def test_a_captured_forwarded_request_is_refused_again_changed_or_after_the_window(tmp_path: Path) -> None:
    store = tmp_path / "models"
    add_tiny(store, "m1")
    keys = keys_file(tmp_path)
    alice = {"Authorization": f"Bearer {ALICE}"}
    with trio.fail_after(120):
        async with two_nodes(tmp_path, store, a={"keys_file": keys}, b={"keys_file": keys, "fleet_window": 1.0}, via_proxy=True) as (a, b, proxy):
            async with httpx.AsyncClient(base_url=a.url, timeout=60) as http:
                r = await http.post("/api/generate", json={**GEN, "prompt": "forward me"}, headers=alice)
                assert r.status_code == 200, r.text
                assert b.dispatches("m1") == 2 and a.loads() == 0
                (captured,) = [q for q in proxy.requests() if q.startswith(b"POST /api/generate")]  # type: ignore[attr-defined]
                # what travels names the key, never its secret, digest or rights, nor the fleet's secret
                for hidden in (ALICE.encode(), hashlib.sha256(ALICE.encode()).hexdigest().encode(), SECRET.encode(), b"role", b"admin"):
                    assert hidden not in captured
                assert b"X-Trioshed-Fleet-Key: alice\r\n" in captured
                status, body = await send_raw(int(b.url.rsplit(":", 1)[1]), captured)  # the same request again
                assert status == 401 and b"a replay" in body, body
                changed = captured.replace(b"forward me", b"FORWARD ME")
                status, body = await send_raw(int(b.url.rsplit(":", 1)[1]), changed)  # again, with another body
                assert status == 401, body
                await trio.sleep(1.1)  # B's window is 1 s
                status, body = await send_raw(int(b.url.rsplit(":", 1)[1]), captured)
                assert status == 401 and b"outside the 1 s window" in body, body
                # a request changed on its way (a man in the middle) is refused where it lands
                proxy.rewrite = lambda data: data.replace(b"tamper me", b"TAMPER ME")  # type: ignore[attr-defined]
                r = await http.post("/api/generate", json={**GEN, "prompt": "tamper me"}, headers=alice)
                assert r.status_code == 401 and "not the one it was signed with" in r.json()["error"], r.text
                assert b.dispatches("m1") == 2


async def test_node_headers_grant_nothing_beyond_a_forwarded_requests_own_key(tmp_path: Path) -> None:
    store = tmp_path / "models"
    add_tiny(store, "m1")
    settings = {"peers": ("http://127.0.0.1:9",), "api_key": BOSS, "keys_file": keys_file(tmp_path), **FLEET}
    with trio.fail_after(60):
        async with open_test_server(store, node_name="B", **settings) as b, httpx.AsyncClient(base_url=b.base_url, timeout=30) as http:
            a = FleetAuth(SECRET, "A")

            async def signed(method: str, path: str, body: dict[str, object] | None, *, key: str | None, to: str = "B", auth: FleetAuth = a) -> httpx.Response:
                content = json.dumps(body).encode() if body is not None else b""
                headers = auth.sign(method, path, body_digest(content), to=to, key=key)
                return await http.request(method, path, content=content, headers={**headers, "Content-Type": "application/json"})

            # the old bearer secret with a forged admin key: nothing
            forged = {"X-Trioshed-Fleet-Secret": SECRET, "X-Trioshed-Forwarded": "A", "X-Trioshed-Fleet-Key": '{"name": "m", "role": "admin"}'}
            r = await http.post("/api/keys", json={"name": "mallory"}, headers=forged)
            assert r.status_code == 401, r.text
            assert (await http.post("/api/generate", json=GEN, headers=forged)).status_code == 401
            # a signed request counts only on the routes requests are forwarded on
            assert (await signed("POST", "/api/keys", {"name": "mallory"}, key="alice")).status_code == 401
            assert (await signed("POST", "/api/keys", {"name": "mallory"}, key="default")).status_code == 401
            assert (await signed("GET", "/api/ps", None, key="default")).status_code == 401
            # on a forwarded route: the key it names, as this node knows it
            assert (await signed("POST", "/api/generate", {**GEN, "model": "nothing"}, key="alice")).status_code == 404
            assert (await signed("POST", "/api/generate", GEN, key=None)).status_code == 401  # keys required here
            assert (await signed("POST", "/api/generate", GEN, key="mallory")).status_code == 401  # unknown here
            r = await signed("POST", "/upstream/m1/completion", {"prompt": "x"}, key="alice")
            assert r.status_code == 403 and "needs an admin key" in r.text  # a user key stays one
            assert (await signed("POST", "/api/generate", GEN, key="alice", to="C")).status_code == 401  # signed for another node
            assert (await signed("POST", "/api/generate", GEN, key="alice", auth=FleetAuth("another-secret-0123", "A"))).status_code == 401
            assert b.scheduler.statistics().loads == 0


def tls_certificate(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (openssl), and its PEM with the key (HAProxy's)."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    both = folder / "both.pem"
    both.write_bytes(cert.read_bytes() + key.read_bytes())
    return cert, both


@asynccontextmanager
async def tls_front(tmp_path: Path, pem: Path, port: int) -> AsyncIterator[int]:
    """HAProxy terminating TLS on a free port in front of ``port``: yields its port."""
    assert HAPROXY is not None
    front = free_port()
    cfg = tmp_path / "tls.cfg"
    cfg.write_text(
        f"defaults\n    mode http\n    timeout connect 5s\n    timeout client 1m\n    timeout server 1m\n"
        f"frontend tls\n    bind 127.0.0.1:{front} ssl crt {pem}\n    default_backend node\n"
        f"backend node\n    server b 127.0.0.1:{port}\n"
    )
    proc = await trio.lowlevel.open_process([HAPROXY, "-db", "-f", str(cfg)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                await (await trio.open_tcp_stream("127.0.0.1", front)).aclose()
                break
            except OSError:
                await trio.sleep(0.05)
        yield front
    finally:
        proc.kill()
        with trio.CancelScope(shield=True):
            await proc.wait()


@needs_haproxy
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
async def test_an_https_peer_is_reached_over_verified_tls(tmp_path: Path) -> None:
    store = tmp_path / "models"
    add_tiny(store, "m1")
    cert, pem = tls_certificate(tmp_path)
    port_a, port_b = free_port(), free_port()
    record_a: list[tuple[str, str]] = []
    record_b: list[tuple[str, str]] = []
    with trio.fail_after(120):
        async with open_test_server(store, record=record_b, port=port_b, node_name="B", peers=(f"http://127.0.0.1:{port_a}",), **FLEET) as server_b:
            async with tls_front(tmp_path, pem, port_b) as tls:
                peers = (f"https://127.0.0.1:{tls}",)
                async with open_test_server(store, record=record_a, port=port_a, node_name="A", peers=peers, fleet_ca=cert, **FLEET) as server_a:
                    a, b = Node("A", server_a, record_a), Node("B", server_b, record_b)
                    async with httpx.AsyncClient(timeout=60) as http:
                        assert (await http.post(b.url + "/api/generate", json=GEN)).status_code == 200
                        await wait_until(lambda: sees(a, b, "m1:latest"), a)  # its state read over TLS
                        for _ in range(2):
                            r = await http.post(a.url + "/api/generate", json=GEN)
                            assert r.status_code == 200, r.text
                    assert b.dispatches("m1") == 3 and a.loads() == 0  # relayed over TLS, served by B
                # a node that does not trust the certificate never reaches B: nothing goes in clear
                async with open_test_server(store, node_name="A2", peers=peers, **FLEET) as untrusting:
                    fleet = untrusting.state.fleet
                    assert fleet is not None
                    await fleet.source.rounds.wait()  # type: ignore[attr-defined]
                    await fleet.source.rounds.wait()  # type: ignore[attr-defined]
                    (peer,) = fleet.peers()
                    assert not peer.state.reachable and "CERTIFICATE_VERIFY_FAILED" in peer.error, peer.error


async def test_a_clients_origin_and_headers_outside_ascii_do_not_break_a_relay(tmp_path: Path) -> None:
    store = tmp_path / "models"
    add_tiny(store, "m1")
    with trio.fail_after(120):
        async with two_nodes(tmp_path, store, a={"origins": ("http://app.example",)}, b={}) as (a, b, _):
            async with httpx.AsyncClient(base_url=a.url, timeout=60) as http:
                r = await http.post("/api/generate", json=GEN, headers={"Origin": "http://app.example"})  # a page A allows
                assert r.status_code == 200, r.text
                assert r.headers["access-control-allow-origin"] == "http://app.example"
                r = await http.post("/api/generate", json=GEN, headers={"User-Agent": "café/1.0".encode("latin-1")})  # type: ignore[dict-item]
                assert r.status_code == 200, r.text
            assert b.dispatches("m1") == 3 and a.loads() == 0


async def test_a_forwarded_transcription_is_served_where_its_model_is_warm(tmp_path: Path) -> None:
    store = tmp_path / "models"
    write_tiny_model(store / "hear" / "hear.gguf")
    write_tiny_audio_projector(store / "hear" / "mmproj-hear.gguf")
    add_tiny(store, "m1")
    files = {"file": ("a.wav", tiny_wav(1.0), "audio/wav")}
    with trio.fail_after(180):
        async with two_nodes(tmp_path, store, a={}, b={}) as (a, b, _):
            async with httpx.AsyncClient(timeout=60) as http:
                direct = await http.post(b.url + "/v1/audio/transcriptions", data={"model": "hear"}, files=files)
                assert direct.status_code == 200, direct.text
                await wait_until(lambda: sees(a, b, "hear:latest"), a)
                relayed = await http.post(a.url + "/v1/audio/transcriptions", data={"model": "hear"}, files=files)
                assert relayed.status_code == 200, relayed.text
                assert relayed.json()["text"] == direct.json()["text"]
            assert b.dispatches("hear") == 2 and a.loads() == 0
