"""Log output: text (the default) or one JSON object per line (``TRIOSHED_LOG_FORMAT=json``).

In JSON mode every record is a line ``{"time", "level", "logger", "message", ...}``; a record
logged with ``extra={"fields": {...}}`` carries those fields at the top level (the per-request
line of :mod:`trioshed.api.observe.request_log` does).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def use_format(log_format: str) -> None:
    """Give the root logger's handlers the formatter for ``log_format``."""
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.setFormatter(formatter)
