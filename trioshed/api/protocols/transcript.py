"""A conversation as a plain transcript, for models that bring no chat template.

A base model (like the demo's) continues "User: …" / "Assistant:" text; llama-server's fallback,
ChatML, makes such a model echo markup ("<|im_end|>"). Every protocol's chat on such a model goes
to llama-server's completion endpoint with :func:`transcript_prompt`, cut at :data:`TURN_STOP`.
Pure (no I/O).
"""

from __future__ import annotations

from typing import Any

#: Where a transcript's answer ends: the next turn (see :func:`transcript_prompt`).
TURN_STOP = "\nUser:"


def transcript_prompt(messages: list[dict[str, Any]]) -> str:
    """A conversation as a plain transcript a base model can continue ("User: …", then
    "Assistant:"); a message's content is its text (OpenAI's text parts joined)."""
    lines = []
    for message in messages:
        role, content = message.get("role"), message.get("content") or ""
        if isinstance(content, list):  # OpenAI's content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        if role == "system":
            lines.append(f"{content}\n")
        elif role in ("user", "tool"):
            lines.append(f"User: {content}")
        else:
            lines.append(f"Assistant: {content}")
    return "\n".join(lines) + "\nAssistant:"


def with_turn_stop(stop: object) -> list[Any]:
    """The client's stop strings (one or a list) and the transcript's next turn."""
    given = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
    return [*given, TURN_STOP]
