"""``GET /api/events``: the status page's one live stream (server-sent events).

Messages (each ``event: NAME`` and one ``data:`` line of JSON):

- ``hello`` on connect: ``{"instance", "version", "time", "models"}``; ``instance`` changes when
  trioshed restarts (a page then starts its lists afresh), ``models`` the store's names;
- ``state``: devices, runners, queue and totals (:func:`trioshed.api.observe.status.status`), whole,
  whenever it changed;
- ``events``: ``{"events": [...], "gap"}`` the scheduler's events after the last sent (load,
  ready, evict, unloaded, crashed, load failed, refused), ``gap`` when some were missed;
- ``log``: ``{"lines": [...], "gap"}`` new lines of the log tail (:mod:`trioshed.logtail`);
- ``history``: ``{"samples": [...]}`` seconds of the last hour not sent yet, or sent before and
  changed since (:class:`trioshed.scheduler.events.Timeline`: tokens generated, requests
  waiting, memory per device and runner); the whole hour on connect;
- ``activity``: ``{"requests": [...]}`` the recent requests not sent yet
  (:class:`trioshed.activity.RecentRequests`): waits, tokens, speed and why one was slow;
- ``models``: ``{"models": [...]}`` every model in the store, described
  (:func:`trioshed.api.observe.store_view.store_models`), on connect and then every 30 s;
- a comment line (``: keep-alive``) when nothing else was sent for :data:`REFRESH` seconds.

Bounded per client: a stream holds only the sequence numbers it sent last and the last state it
sent; what it sends is built when it is ready to send. A slow reader therefore gets fewer, newer
messages (changes coalesce; events or log lines pushed out of the bounded histories meanwhile
are reported as a ``gap``), never a growing buffer; at most :data:`MAX_STREAMS` streams at
once (503 beyond). A vanished reader ends its stream at the next send. A drain (shutdown) ends
every stream at once, so that an open page never delays a restart; the page reconnects.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import trio
from quart import Blueprint, Response

from trioshed import __version__
from trioshed.api.observe.status import status
from trioshed.api.observe.store_view import REFRESH as MODELS_REFRESH
from trioshed.api.observe.store_view import store_models
from trioshed.api.pipeline.drain import drain_started
from trioshed.api.pipeline.preamble import state
from trioshed.api.state import AppState
from trioshed.errors import EventStreamsBusy
from trioshed.fleet import view as fleet_view
from trioshed.keys import ApiKey, current_key

bp = Blueprint("events", __name__)

INSTANCE = secrets.token_hex(8)  # this process: a page seeing another one knows trioshed restarted
MAX_STREAMS = 64  # open pages at once; each costs one task and one socket
REFRESH = 5.0  # seconds: device memory is read again (and a keep-alive comment sent) at least this often
COALESCE = 0.1  # seconds between two sends to one client: a burst of changes is one message


def sse(event: str, data: Any) -> bytes:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def state_message(st: AppState) -> dict[str, Any]:
    scheduler = st.scheduler
    source = scheduler.devices
    message = status(
        scheduler.statistics(),
        source.poll(),
        source.system(),
        free_known=source.kind == "nvml",
        overhead=st.settings.gpu_overhead,
        now=time.time(),
    )
    if st.fleet is not None:  # every node of the fleet (an admin's view)
        message["fleet"] = fleet_view.nodes(st.fleet, trio.current_time(), ages=False)
    return message


def for_key(message: dict[str, Any], key: ApiKey) -> dict[str, Any]:
    """A state message as ``key`` may see it: an admin sees all (every key's usage, the usage
    store, the fleet), a user key only its own models' runners, memory and queue, its own usage,
    and no other key's name (its queue entries say whose only when they are its own)."""
    if key.admin:
        return message
    out = {k: v for k, v in message.items() if k not in ("database", "fleet")}  # where the store and the nodes are: admin only
    out["usage"] = [u for u in message.get("usage", []) if u.get("key") == key.name]
    out["queue"] = [
        {**q, "key": q.get("key") if q.get("key") == key.name else ""}
        for q in message.get("queue", []) if key.may_use(str(q.get("model", "")))
    ]  # fmt: skip
    if not key.models:
        return out
    out["runners"] = [r for r in message.get("runners", []) if key.may_use(str(r.get("model", "")))]
    out["devices"] = [
        {**d, "runners": [m for m in d.get("runners", []) if key.may_use(str(m.get("model", "")))]}
        if isinstance(d.get("runners"), list) else d
        for d in message.get("devices", [])
    ]  # fmt: skip
    return out


def sample_for_key(sample: dict[str, Any], key: ApiKey) -> dict[str, Any]:
    """A timeline sample with only the models ``key`` may see."""
    if not key.models:
        return sample
    keep = lambda d: {m: v for m, v in d.items() if key.may_use(m)}  # noqa: E731
    return {**sample, "tokens": keep(sample.get("tokens", {})), "waiting": keep(sample.get("waiting", {})),
            "memory": {dev: keep(labels) for dev, labels in sample.get("memory", {}).items()}}  # fmt: skip


def usage_message(st: AppState, now: float) -> list[dict[str, Any]]:
    """Per key: tokens spent today and each budget's tokens left (the status page, admin)."""
    if st.usage is None:
        return []
    out = []
    for k in st.keys:
        prompt, completion = st.usage.ledger.today(k.name, now)
        entry: dict[str, Any] = {"key": k.name, "role": k.role, "prompt_tokens_today": prompt, "completion_tokens_today": completion}
        if k.budgets():
            entry["budgets"] = {f: {"limit": getattr(k, f), "left": left} for f, left in st.usage.ledger.left(k, now).items()}
        out.append(entry)
    return out


def database_message(st: AppState) -> dict[str, Any] | None:
    """The usage store as this node sees it (the status page, admin): reachable or its fault,
    rows waiting and dropped; None without a store."""
    store = st.usage.statistics() if st.usage is not None else None
    return store.as_json() if store is not None else None


def _event(e: Any) -> dict[str, Any]:
    kind = {"unloaded": "unload", "crashed": "crash", "load failed": "load-failed"}.get(e.kind, e.kind)
    out = {"seq": e.seq, "time": e.time, "kind": kind, "model": e.model, "reason": e.reason}
    if e.kind == "ready":
        out["detail"] = f"loaded in {e.seconds:.2f} s"
    if e.status:
        out["status"] = e.status
        out["detail"] = f"HTTP {e.status}" + (f" x{e.count}" if e.count > 1 else "")
    return out


async def _first(*waits: Callable[[], Awaitable[object]], seconds: float) -> None:
    """Return when any of ``waits`` returns, or after ``seconds``."""
    with trio.move_on_after(seconds):
        async with trio.open_nursery() as nursery:
            for wait in waits:
                async def one(wait: Callable[[], Awaitable[object]] = wait) -> None:
                    await wait()
                    nursery.cancel_scope.cancel()

                nursery.start_soon(one)


async def stream(st: AppState, stopping: trio.Event | None, key: ApiKey | None = None) -> AsyncIterator[bytes]:
    """The messages for one client, until it leaves or trioshed drains; a user ``key`` sees
    only its own models and no log."""
    key = key or current_key.get()
    st.event_streams += 1  # counted here, not in the route: a stream never started never ends
    try:
        history, tail = st.scheduler.events, st.log_tail
        models = sorted({spec.name for spec in await trio.to_thread.run_sync(st.store.list) if key.may_use(spec.name)})
        if not key.admin:
            tail = None  # the log tail names every model and key: admin only
        yield sse("hello", {"instance": INSTANCE, "version": __version__, "time": time.time(), "models": models})
        last_state: dict[str, Any] | None = None
        event_seq = 0
        log_seq = 0
        sample_seq = 0
        request_seq = 0
        models_at = -MODELS_REFRESH
        last_models: list[dict[str, Any]] | None = None
        while stopping is None or not stopping.is_set():
            sent = False
            current = for_key({**state_message(st), "usage": usage_message(st, time.time()), "database": database_message(st)}, key)
            if last_state is None or {**current, "time": 0} != {**last_state, "time": 0}:
                last_state = current
                sent = True
                yield sse("state", current)
            new = history.after(event_seq)
            events = [e for e in new if key.may_use(e.model or "")] if key.models else new
            if new:
                gap = event_seq > 0 and new[0].seq > event_seq + 1 and new[0].kind != "refused"
                event_seq = new[-1].seq
            if events:
                sent = True
                yield sse("events", {"events": [_event(e) for e in events], "gap": gap})
            if tail is not None:
                lines, gap = tail.since(log_seq)
                if lines:
                    log_seq = lines[-1].seq
                    sent = True
                    yield sse("log", {"lines": [asdict(line) for line in lines], "gap": gap and log_seq > len(lines)})
            samples = st.timeline.after(sample_seq)
            if samples:
                sample_seq = max(sample.seq for sample in samples)
                sent = True
                yield sse("history", {"samples": [sample_for_key(sample.as_json(), key) for sample in samples]})
            finished = st.recent.after(request_seq)
            if finished:
                request_seq = finished[-1].seq
            mine = finished if key.admin else [r for r in finished if r.key == key.name and key.may_use(r.model)]
            if mine:
                sent = True
                yield sse("activity", {"requests": [r.as_json() for r in mine]})
            if trio.current_time() - models_at >= MODELS_REFRESH:
                models_at = trio.current_time()
                current_models = [m for m in await store_models(st) if key.may_use(str(m.get("name", "")))]
                if current_models != last_models:
                    last_models = current_models
                    sent = True
                    yield sse("models", {"models": current_models})
            if not sent:
                yield b": keep-alive\n\n"
            waits: list[Callable[[], Awaitable[object]]] = [
                st.scheduler.wait_changed, partial(history.wait_after, event_seq),
                partial(st.timeline.wait_after, sample_seq), partial(st.recent.wait_after, request_seq),
            ]  # fmt: skip
            if tail is not None:
                waits.append(tail.wait_changed)
            if stopping is not None:
                waits.append(stopping.wait)
            await _first(*waits, seconds=REFRESH)
            await trio.sleep(COALESCE)
    finally:
        st.event_streams -= 1


@bp.get("/api/events")
async def events() -> Response:
    st = state()
    if st.event_streams >= MAX_STREAMS:
        raise EventStreamsBusy(MAX_STREAMS)
    response = Response(stream(st, drain_started(), current_key.get()), content_type="text/event-stream; charset=utf-8")
    response.headers["Cache-Control"] = "no-cache"
    response.headers["X-Accel-Buffering"] = "no"  # nginx and friends: pass each message on at once
    response.timeout = None  # type: ignore[assignment]  # runs for as long as the page is open
    return response
