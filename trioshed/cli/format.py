"""What the client commands print, as ``ollama`` prints it: tables, sizes, times, ``show``.

Pure (no I/O): each function takes the server's JSON answer (and ``now``) and returns text, so the
shapes are tested without a server.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

#: Ollama writes "Forever" for a keep-alive past this year (its sentinel is 2318).
FOREVER_YEAR = 2300


def human_bytes(n: int) -> str:
    """Ollama's ``format.HumanBytes``: decimal units, whole numbers from 10 up (``291 MB``); the
    sizes of ``list`` and ``ps`` and of a pull's progress bars."""
    value = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if value < 1000 or unit == "TB":
            if unit == "B":
                return f"{n} B"
            return f"{value:.0f} {unit}" if value >= 10 else f"{value:.1f} {unit}"
        value /= 1000
    return f"{n} B"  # pragma: no cover - the loop always returns


def parse_time(text: str) -> datetime | None:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00"))
    except (TypeError, ValueError):
        return None


def _span(seconds: float) -> str:
    seconds = abs(seconds)
    for size, unit in ((365 * 86400, "year"), (30 * 86400, "month"), (7 * 86400, "week"), (86400, "day"),
                       (3600, "hour"), (60, "minute"), (1, "second")):  # fmt: skip
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return ""


def ago(text: str, now: datetime) -> str:
    """``modified_at`` as ``ollama list`` shows it: "2 days ago", "Less than a second ago"."""
    when = parse_time(text)
    if when is None:
        return ""
    span = _span((now - when).total_seconds())
    return f"{span} ago" if span else "Less than a second ago"


def until(text: str, now: datetime) -> str:
    """``expires_at`` as ``ollama ps`` shows it: "4 minutes from now", "Forever", "Stopping..."."""
    when = parse_time(text)
    if when is None:
        return ""
    if when.year >= FOREVER_YEAR:
        return "Forever"
    seconds = (when - now).total_seconds()
    if seconds <= 0:
        return "Stopping..."
    return f"{_span(seconds) or 'Less than a second'} from now"


def processor(size: int, size_vram: int) -> str:
    """Where a loaded model lives, as ``ollama ps`` says it: "100% GPU", "100% CPU", "48%/52% CPU/GPU"."""
    if size <= 0 or size_vram <= 0:
        return "100% CPU"
    if size_vram >= size:
        return "100% GPU"
    gpu = round(size_vram * 100 / size)
    return f"{100 - gpu}%/{gpu}% CPU/GPU"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell plus three spaces, as Ollama's tables are."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["   ".join(str(cell).ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in [header, *rows]]
    return "\n".join(lines) + "\n"


def short_id(digest: str) -> str:
    return digest.removeprefix("sha256:")[:12]


def list_table(answer: dict[str, Any], now: datetime) -> str:
    """``GET /api/tags`` as ``ollama list`` prints it."""
    rows = [[str(m.get("name", "")), short_id(str(m.get("digest", ""))), human_bytes(int(m.get("size") or 0)),
             ago(str(m.get("modified_at", "")), now)] for m in answer.get("models") or []]  # fmt: skip
    return table(["NAME", "ID", "SIZE", "MODIFIED"], rows)


def ps_table(answer: dict[str, Any], now: datetime) -> str:
    """``GET /api/ps`` as ``ollama ps`` prints it."""
    rows = []
    for m in answer.get("models") or []:
        size, vram = int(m.get("size") or 0), int(m.get("size_vram") or 0)
        rows.append([str(m.get("name", "")), short_id(str(m.get("digest", ""))), human_bytes(size),
                     processor(size, vram), str(m.get("context_length", "")), until(str(m.get("expires_at", "")), now)])  # fmt: skip
    return table(["NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "UNTIL"], rows)


def parameter_count(n: int) -> str:
    """Ollama's ``format.HumanNumber``: 268098176 -> "268.10M"."""
    for size, unit in ((1_000_000_000, "B"), (1_000_000, "M"), (1_000, "K")):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _section(title: str, pairs: list[tuple[str, str]]) -> list[str]:
    if not pairs:
        return []
    width = max(len(k) for k, _ in pairs)
    return [f"  {title}", *(f"    {k.ljust(width)}    {v}".rstrip() for k, v in pairs), ""]


def _text_section(title: str, text: str, limit: int | None = None) -> list[str]:
    lines = [line for line in text.strip().splitlines()]
    if not lines:
        return []
    if limit is not None and len(lines) > limit:
        lines = [*lines[:limit], "..."]
    return [f"  {title}", *(f"    {line}" for line in lines), ""]


def show_text(answer: dict[str, Any], verbose: bool = False) -> str:
    """``POST /api/show`` as ``ollama show`` prints it: Model, Capabilities, Parameters, System,
    License; with ``verbose`` every metadata entry under Metadata."""
    info = answer.get("model_info") or {}
    details = answer.get("details") or {}
    arch = str(info.get("general.architecture") or details.get("family") or "")
    model: list[tuple[str, str]] = [("architecture", arch)] if arch else []
    count = info.get("general.parameter_count")
    if isinstance(count, int) and count > 0:
        model.append(("parameters", parameter_count(count)))
    elif details.get("parameter_size"):
        model.append(("parameters", str(details["parameter_size"])))
    for key, label in (("context_length", "context length"), ("embedding_length", "embedding length")):
        value = info.get(f"{arch}.{key}")
        if value is not None:
            model.append((label, str(value)))
    if details.get("quantization_level"):
        model.append(("quantization", str(details["quantization_level"])))
    out = _section("Model", model)
    out += _section("Capabilities", [(c, "") for c in answer.get("capabilities") or []])
    params = []
    for line in str(answer.get("parameters") or "").splitlines():
        key, _, value = line.strip().partition(" ")
        if key:
            params.append((key, value.strip()))
    out += _section("Parameters", params)
    out += _text_section("System", str(answer.get("system") or ""), limit=None if verbose else 2)
    out += _text_section("License", str(answer.get("license") or ""), limit=None if verbose else 2)
    if verbose:
        out += _section("Metadata", [(k, json.dumps(v) if isinstance(v, str) else str(v)) for k, v in sorted(info.items())])
    return "\n" + "\n".join(out)


def timings(chunk: dict[str, Any]) -> str:
    """The statistics ``ollama run --verbose`` prints after an answer (durations in ns)."""

    def seconds(key: str) -> float:
        return float(chunk.get(key) or 0) / 1e9

    def rate(count_key: str, duration_key: str) -> str:
        d = seconds(duration_key)
        return f"{(chunk.get(count_key) or 0) / d:.2f} tokens/s" if d > 0 else "n/a"

    rows = [
        ("total duration", f"{seconds('total_duration'):.6f}s"),
        ("load duration", f"{seconds('load_duration'):.6f}s"),
        ("prompt eval count", f"{chunk.get('prompt_eval_count') or 0} token(s)"),
        ("prompt eval duration", f"{seconds('prompt_eval_duration'):.6f}s"),
        ("prompt eval rate", rate("prompt_eval_count", "prompt_eval_duration")),
        ("eval count", f"{chunk.get('eval_count') or 0} token(s)"),
        ("eval duration", f"{seconds('eval_duration'):.6f}s"),
        ("eval rate", rate("eval_count", "eval_duration")),
    ]
    return "".join(f"{k + ':':<22}{v}\n" for k, v in rows)
