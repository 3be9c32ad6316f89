"""``GET /api/usage``: tokens and requests per API key, model and day (or hour), from the usage
database (:mod:`trioshed.usage`).

Query parameters: ``key``, ``model`` (exact names), ``since`` and ``until`` (RFC 3339 times,
``YYYY-MM-DD`` dates in UTC, or Unix seconds; ``until`` excluded), ``node`` (one node's rows;
default: every node's, one row per node: with a shared store, the whole team), ``by`` (``day``, the default,
or ``hour``: kept for the last 14 days), ``format`` (``json``, the default, or ``csv``). A user
key reads its own usage only; an admin key everyone's, with each key's budgets left today.
"""

from __future__ import annotations

import csv
import io
import json
import math
import sqlite3
import time
from datetime import UTC, datetime
from typing import Any

from quart import Blueprint, Response, request

from trioshed.api.pipeline.preamble import state
from trioshed.errors import BadRequest, Forbidden, TrioshedError
from trioshed.keys import ApiKey, current_key
from trioshed.usage.recorder import describe

bp = Blueprint("usage", __name__)

FIELDS = ("key", "model", "start", "requests", "prompt_tokens", "cached_tokens", "completion_tokens", "errors", "seconds", "node")  # node last: a column added to the file's


class UsageUnavailable(TrioshedError):
    """The usage database cannot be read now (locked, unreadable, corrupt): 503, in the
    protocol's error shape."""

    status = 503


def parse_time(name: str, value: str | None) -> float | None:
    """RFC 3339, a date (UTC midnight) or Unix seconds; BadRequest naming the parameter."""
    if value is None or value == "":
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(seconds):
            raise BadRequest(f"{name}={value[:40]!r} is not a time: use RFC 3339, YYYY-MM-DD or Unix seconds")
        return seconds
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{name}={value[:40]!r} is not a time: use RFC 3339, YYYY-MM-DD or Unix seconds") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def budgets_of(key: ApiKey, now: float) -> dict[str, Any]:
    st = state()
    assert st.usage is not None
    prompt, completion = st.usage.ledger.today(key.name, now)
    out: dict[str, Any] = {"key": key.name, "role": key.role, "prompt_tokens_today": prompt,
                           "completion_tokens_today": completion}  # fmt: skip
    if key.budgets():
        out["budgets"] = {f: {"limit": getattr(key, f), "left": left} for f, left in st.usage.ledger.left(key, now).items()}
    return out


@bp.get("/api/usage")
async def usage() -> Response:
    st = state()
    args = request.args
    key = current_key.get()
    by = args.get("by", "day")
    if by not in ("day", "hour"):
        raise BadRequest('by must be "day" or "hour"')
    form = args.get("format", "json")
    if form not in ("json", "csv"):
        raise BadRequest('format must be "json" or "csv"')
    who = args.get("key")
    if not key.admin:
        if who is not None and who != key.name:
            raise Forbidden(f"API key '{key.name}' may read its own usage only: everyone's needs an admin key")
        who = key.name
    since, until = parse_time("since", args.get("since")), parse_time("until", args.get("until"))
    rows: list[dict[str, Any]] = []
    if st.usage is not None and st.usage.db is not None:
        try:
            rows = await st.usage.query(by=by, key=who, model=args.get("model"), node=args.get("node"), since=since, until=until)
        except OSError as exc:  # the database could not be opened (the recorder says why)
            raise UsageUnavailable(f"usage cannot be read now: {exc}") from None
        except sqlite3.Error as exc:  # it opened, then the read failed (locked, damaged since)
            raise UsageUnavailable(f"usage cannot be read now: the usage database {describe(exc)}") from None
    rows = [{**r, "start": _iso(r["start"]), "seconds": round(r["seconds"], 3)} for r in rows]
    if form == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, FIELDS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return Response(out.getvalue(), content_type="text/csv; charset=utf-8")
    body: dict[str, Any] = {"by": by, "usage": rows}
    if st.usage is not None:
        now = time.time()
        keys = [k for k in st.keys if key.admin or k.name == key.name]
        body["keys"] = [budgets_of(k, now) for k in keys]
        body["recording"] = st.usage.db is not None
        if key.admin:
            body["pending"] = st.usage.waiting()
            body["dropped"] = st.usage.dropped
            body["problem"] = st.usage.problem or None
            if (store := st.usage.statistics()) is not None:  # which store (a URL without its password), this node's name
                body["database"] = store.as_json()
    return Response(json.dumps(body), content_type="application/json")
