"""A database URL as logs and errors may show it: without its password (pure)."""

from __future__ import annotations

import re

_PASSWORD = re.compile(r"(://[^:/@]*):[^@]*@")
_SECRET_PARAM = re.compile(r"(password|sslpassword)=[^&\s]*", re.IGNORECASE)


def redact(url: str) -> str:
    """``url`` without its password (``postgresql://user:***@host/db``, ``password=***``)."""
    return _SECRET_PARAM.sub(r"\1=***", _PASSWORD.sub(r"\1:***@", url))
