"""Headless Chromium driven over the DevTools protocol, for the status page's browser test.

Debian's ``chromium`` runs with ``--remote-debugging-pipe``: it reads protocol commands from fd 3
and writes answers and events to fd 4, each message one JSON text ending in a NUL byte. No
WebSocket, no port, no driver binary, nothing downloaded: ``chromium`` on PATH (``.ci/run``
installs it) or ``TRIOSHED_CHROMIUM``.

The browser runs in its own session (process group) with a temporary profile; leaving
:func:`open_browser` closes it and SIGKILLs the group, so no renderer or zygote outlives a test.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
from trio_util import RepeatedEvent

FLAGS = (
    "--headless",
    "--no-sandbox",  # root in CI; the page is our own
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--disable-extensions",
    "--remote-debugging-pipe",
)


def find_chromium() -> str | None:
    return os.environ.get("TRIOSHED_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


class ProtocolError(Exception):
    pass


class Browser:
    """One Chromium and one page (tab) in it, attached with a flat session."""

    def __init__(self, send: trio.abc.SendStream, receive: trio.abc.ReceiveStream) -> None:
        self._send_stream = send
        self._receive_stream = receive
        self._ids = 0
        self._answers: dict[int, Any] = {}
        self._answered = RepeatedEvent()
        self.events: list[dict[str, Any]] = []  # every protocol event, in order
        self.session: str | None = None
        self._closed = False

    async def run_reader(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        buffer = b""
        try:
            while True:
                chunk = await self._receive_stream.receive_some(1 << 16)
                if not chunk:
                    return
                buffer += chunk
                while (end := buffer.find(b"\0")) >= 0:
                    message = json.loads(buffer[:end])
                    buffer = buffer[end + 1 :]
                    if "id" in message:
                        self._answers[message["id"]] = message
                    else:
                        self.events.append(message)
                    self._answered.set()
        finally:
            self._closed = True
            self._answered.set()

    async def call(self, method: str, params: dict[str, Any] | None = None, *, browser_level: bool = False) -> dict[str, Any]:
        self._ids += 1
        message: dict[str, Any] = {"id": self._ids, "method": method, "params": params or {}}
        if self.session is not None and not browser_level:
            message["sessionId"] = self.session
        await self._send_stream.send_all(json.dumps(message).encode() + b"\0")
        while self._ids not in self._answers:
            if self._closed:
                raise ProtocolError(f"chromium closed its pipe before answering {method}")
            await self._answered.wait()
        answer = self._answers.pop(self._ids)
        if "error" in answer:
            raise ProtocolError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    async def wait_event(self, method: str, start: int = 0) -> dict[str, Any]:
        """The first event named ``method`` at or after index ``start`` of :attr:`events`."""
        while True:
            for event in self.events[start:]:
                if event.get("method") == method:
                    return event
            if self._closed:
                raise ProtocolError(f"chromium closed its pipe while waiting for {method}")
            await self._answered.wait()

    async def open_page(self, width: int = 1280, height: int = 900, mobile: bool = False) -> None:
        target = await self.call("Target.createTarget", {"url": "about:blank"}, browser_level=True)
        attached = await self.call("Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}, browser_level=True)
        self.session = attached["sessionId"]
        for domain in ("Page", "Runtime", "Network", "Log"):
            await self.call(f"{domain}.enable")
        await self.resize(width, height, mobile)

    async def resize(self, width: int, height: int, mobile: bool = False) -> None:
        await self.call("Emulation.setDeviceMetricsOverride", {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": mobile,
        })  # fmt: skip

    async def navigate(self, url: str) -> None:
        start = len(self.events)
        answer = await self.call("Page.navigate", {"url": url})
        if answer.get("errorText"):
            raise ProtocolError(f"navigation to {url} failed: {answer['errorText']}")
        await self.wait_event("Page.loadEventFired", start)

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        answer = await self.call("Runtime.evaluate", {"expression": expression, "returnByValue": True, "awaitPromise": True})
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise ProtocolError(f"{expression[:200]!r} raised: {text}")
        return answer["result"].get("value")

    async def wait_for(self, predicate: str, timeout_ms: int = 60000) -> Any:
        """Wait (in the page, on every DOM change: no polling from here) until the JavaScript
        expression ``predicate`` is truthy; its value. Raises with the predicate on timeout."""
        source = json.dumps(predicate)
        return await self.evaluate(f"""new Promise((resolve, reject) => {{
            let observer, timer;
            const check = () => {{
                let value;
                try {{ value = ({predicate}); }} catch (e) {{ value = undefined; }}
                if (value) {{ observer.disconnect(); clearTimeout(timer); resolve(value); }}
            }};
            observer = new MutationObserver(check);
            observer.observe(document, {{subtree: true, childList: true, attributes: true, characterData: true}});
            timer = setTimeout(() => {{ observer.disconnect(); reject(new Error("timed out waiting for " + {source})); }}, {timeout_ms});
            check();
        }})""")

    async def screenshot(self) -> bytes:
        answer = await self.call("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True})
        return base64.b64decode(answer["data"])

    def requests(self) -> list[str]:
        """The URLs of every request the page made, in order."""
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def problems(self) -> list[str]:
        """Exceptions thrown in the page, console errors, and browser log errors (CSP violations
        are among them)."""
        out = []
        for e in self.events:
            method, params = e.get("method"), e.get("params", {})
            if method == "Runtime.exceptionThrown":
                out.append(f"exception: {params['exceptionDetails'].get('exception', {}).get('description') or params['exceptionDetails'].get('text')}")
            elif method == "Runtime.consoleAPICalled" and params.get("type") == "error":
                out.append("console.error: " + " ".join(str(a.get("value", a.get("description"))) for a in params.get("args", [])))
            elif method == "Log.entryAdded" and params["entry"].get("level") == "error":
                out.append(f"log: {params['entry'].get('text')} ({params['entry'].get('url', '')})")
        return out


@asynccontextmanager
async def open_browser(chromium: str, log_path: str | os.PathLike[str]) -> AsyncIterator[Browser]:
    """Start Chromium headless with a temporary profile; yield a :class:`Browser` with one page."""
    commands_read, commands_write = os.pipe()
    answers_read, answers_write = os.pipe()
    profile = tempfile.mkdtemp(prefix="trioshed-chromium-")
    # bash puts the pipe ends on fds 3 and 4 (the numbers Chromium reads) and closes the originals
    script = f'exec "$0" "$@" 3<&{commands_read} 4>&{answers_write} {commands_read}<&- {answers_write}>&-'
    with open(log_path, "wb") as log:  # noqa: ASYNC230 (a local file, opened once)
        try:
            process = await trio.lowlevel.open_process(
                ["bash", "-c", script, chromium, *FLAGS, f"--user-data-dir={profile}", "about:blank"],
                pass_fds=(commands_read, answers_write),
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the zygote and renderers die with it
            )  # fmt: skip
        finally:
            os.close(commands_read)
            os.close(answers_write)
        send = trio.lowlevel.FdStream(commands_write)
        receive = trio.lowlevel.FdStream(answers_read)
        browser = Browser(send, receive)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(browser.run_reader)
                with trio.fail_after(30):
                    await browser.open_page()
                yield browser
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                await process.wait()
                await send.aclose()
                await receive.aclose()
                shutil.rmtree(profile, ignore_errors=True)
