"""The store's one writer: a client that leaves a streamed create, pull or push mid-line leaves no
lock or download behind (the same operation runs again at once), and a delete racing a pull or a
create of another model that shares a blob never leaves a manifest naming a missing blob.

The routes are called as Quart calls them (the view in a request context, then its streamed body
entered, read and left: ``IterableBody``'s exit closes the body as when a client disconnects),
inside a real in-process server, so the test holds the operation exactly between two lines.
"""

from __future__ import annotations

import gc
import hashlib
import json
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing
from quart import Response

from trioshed.api.routes import manage
from trioshed.api.routes import pull as pull_route
from trioshed.models.stores import manifest_blobs
from trioshed.server import Server
from trioshed.testing.registry import StandIn, open_stand_in
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

View = Callable[[], Awaitable[Response]]


async def call(server: Server, view: View, path: str, body: dict[str, Any], method: str = "POST") -> Response:
    app = server.drain.app
    async with app.test_request_context(path, method=method, json=body):  # type: ignore[attr-defined]
        return await view()


@asynccontextmanager
async def streamed(server: Server, view: View, path: str, body: dict[str, Any]) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
    """The route's streamed lines; leaving the block leaves the stream as a disconnecting client does."""
    response = await call(server, view, path, body)
    assert response.status_code == 200, await response.get_data()
    async with response.response as chunks:  # type: ignore[attr-defined]

        async def lines() -> AsyncGenerator[dict[str, Any], None]:
            async for chunk in chunks:
                yield json.loads(chunk)

        async with aclosing(lines()) as each:
            yield each


async def run_again(server: Server, view: View, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with trio.fail_after(30):  # a lock left held would make this wait for ever
        async with streamed(server, view, path, body) as lines:
            return [line async for line in lines]


def _gc() -> None:
    gc.collect()  # an abandoned generator is finalised now (in a system task), if one was left


def blobs_named(pulled: Path) -> dict[str, set[str]]:
    return {str(m.relative_to(pulled / "manifests")): manifest_blobs(m) for m in (pulled / "manifests").glob("*/*/*/*")}


def assert_every_manifest_whole(pulled: Path) -> None:
    present = {p.name for p in (pulled / "blobs").iterdir()}
    for name, blobs in blobs_named(pulled).items():
        assert blobs <= present, f"{name} names missing blobs {blobs - present}"


async def test_a_create_left_mid_line_leaves_no_lock(model_store: Path) -> None:
    body = {"model": "mine", "from": "tiny", "system": "be brief"}
    async with open_test_server(model_store) as server:
        async with streamed(server, manage.create, "/api/create", body) as lines:
            first = await anext(lines)
            assert first["status"].startswith("copying file")
        _gc()
        await trio.testing.wait_all_tasks_blocked()
        again = await run_again(server, manage.create, "/api/create", body)
        assert again[-1] == {"status": "success"}
        assert_every_manifest_whole(model_store / "pulled")


@pytest.fixture
def gguf(tiny_model: Path) -> bytes:
    return tiny_model.read_bytes()


@asynccontextmanager
async def registry(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[StandIn]:
    async with open_stand_in() as stand_in:
        monkeypatch.setenv("TRIOSHED_OLLAMA_REGISTRY", stand_in.base_url)
        yield stand_in


async def test_a_pull_left_mid_download_leaves_nothing_behind(model_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = write_tiny_model(tmp_path / "big.gguf", n_embd=512, n_layer=2).read_bytes()  # half of it > one progress step
    digest = "sha256:" + hashlib.sha256(big).hexdigest()
    async with registry(monkeypatch) as stand_in:
        stand_in.add_ollama_model("m", big)
        stand_in.gate[digest] = trio.Event()  # half the blob, then held
        async with open_test_server(model_store) as server:
            async with streamed(server, pull_route.pull, "/api/pull", {"model": "m"}) as lines:
                async for line in lines:
                    if line.get("digest") == digest and 0 < line["completed"] < line["total"]:
                        break  # mid-download
            _gc()
            del stand_in.gate[digest]  # the next pull is not held (the first one's answer stays held)
            # the download ends with its pull: its cancellation may wait on a worker thread (a
            # file write), which wait_all_tasks_blocked does not see, so wait for the state itself
            with trio.fail_after(10):
                while server.state.puller().statistics():  # noqa: ASYNC110 - a public snapshot, no event to await
                    await trio.sleep(0.01)
            again = await run_again(server, pull_route.pull, "/api/pull", {"model": "m"})
            assert again[-1] == {"status": "success"}
            assert_every_manifest_whole(model_store / "pulled")


async def test_a_push_left_mid_line_leaves_nothing_behind(model_store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    async with registry(monkeypatch) as stand_in, open_test_server(model_store) as server:
        made = await run_again(server, manage.create, "/api/create", {"model": "me/mine", "from": "tiny", "system": "hi"})
        assert made[-1] == {"status": "success"}
        async with streamed(server, manage.push, "/api/push", {"model": "me/mine"}) as lines:
            first = await anext(lines)
            assert first["status"] == "retrieving manifest"
        _gc()
        await trio.testing.wait_all_tasks_blocked()
        again = await run_again(server, manage.push, "/api/push", {"model": "me/mine"})
        assert again[-1] == {"status": "success"}
        assert ("me", "mine", "latest") in stand_in.manifests


async def _delete(server: Server, name: str, done: trio.Event) -> None:
    answer = await call(server, manage.delete, "/api/delete", {"model": name}, method="DELETE")
    assert answer.status_code == 200
    done.set()


async def _blocked_or_done(server: Server, done: trio.Event) -> None:
    """Until the delete finished or waits for the store writer's lock (a hold point, not a sleep)."""
    while not done.is_set() and server.state.writer.lock.statistics().tasks_waiting == 0:
        await trio.testing.wait_all_tasks_blocked(cushion=0.01)


async def test_a_delete_racing_a_pull_that_shares_a_blob_leaves_every_manifest_whole(
    model_store: Path, gguf: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    digest = "sha256:" + hashlib.sha256(gguf).hexdigest()
    pulled = model_store / "pulled"
    async with registry(monkeypatch) as stand_in, open_test_server(model_store) as server:
        stand_in.add_ollama_model("a", gguf)
        stand_in.add_ollama_model("b", gguf, template="{{ .Prompt }}")  # the same weights blob
        assert (await run_again(server, pull_route.pull, "/api/pull", {"model": "a"}))[-1] == {"status": "success"}
        with trio.fail_after(30):
            async with streamed(server, pull_route.pull, "/api/pull", {"model": "b"}) as lines:
                async for line in lines:
                    if line.get("digest") == digest and line["completed"] == line["total"]:
                        break  # b found the shared blob in place and goes on
                deleted = trio.Event()
                await _delete(server, "a", deleted)  # a was the only manifest naming it
                rest = [line async for line in lines]
            assert rest[-1] == {"status": "success"}
        assert [n for n in blobs_named(pulled)] == ["registry.ollama.ai/library/b/latest"]
        assert_every_manifest_whole(pulled)


async def test_a_delete_racing_a_create_that_shares_a_blob_leaves_every_manifest_whole(model_store: Path, gguf: bytes) -> None:
    digest = "sha256:" + hashlib.sha256(gguf).hexdigest()
    pulled = model_store / "pulled"
    async with open_test_server(model_store) as server:
        assert (await run_again(server, manage.create, "/api/create", {"model": "a", "from": "tiny"}))[-1] == {"status": "success"}
        body = {"model": "c", "files": {"m.gguf": digest}, "system": "be brief"}
        with trio.fail_after(30):
            async with streamed(server, manage.create, "/api/create", body) as lines, trio.open_nursery() as nursery:
                async for line in lines:
                    if line["status"] == f"using existing layer {digest}":
                        break
                deleted = trio.Event()
                nursery.start_soon(_delete, server, "a", deleted)  # a is the only manifest naming it
                await _blocked_or_done(server, deleted)
                rest = [line async for line in lines]
            assert rest[-1] == {"status": "success"}
        assert [n for n in blobs_named(pulled)] == ["registry.ollama.ai/library/c/latest"]
        assert_every_manifest_whole(pulled)
