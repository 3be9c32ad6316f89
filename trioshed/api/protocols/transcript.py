"""A conversation as a plain transcript, for models that bring no chat template.

A base model (like the demo's) continues "User: …" / "Assistant:" text; llama-server's fallback,
ChatML, makes such a model echo markup ("<|im_end|>"). Every protocol's chat on such a model goes
to llama-server's completion endpoint with :func:`transcript_prompt`, cut at :data:`TURN_STOP`.

Images and sounds (OpenAI's ``image_url`` and ``input_audio`` parts, which every protocol's
messages are turned into) stay where they were in the conversation: :func:`transcript_media`
writes the runner's media marker (:data:`~trioshed.core.media.MEDIA_MARKER`) in their place and
returns their bytes in order, which llama-server's ``/completion`` takes as
``{"prompt_string": ..., "multimodal_data": [...]}`` (:func:`media_prompt`). llama-server's
``/v1/completions`` takes no media, so on OpenAI's routes such a request goes to ``/completion``,
whose answer is read in ``/v1/completions``' shape (:func:`completion_event`,
:func:`completion_lines`). Pure (no I/O).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from trioshed.core.media import MEDIA_MARKER
from trioshed.errors import BadRequest

#: Where a transcript's answer ends: the next turn (see :func:`transcript_prompt`).
TURN_STOP = "\nUser:"

#: The content part types that carry media.
MEDIA_PARTS = ("image_url", "input_audio")


def transcript_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation as a plain transcript a base model can continue ("User: …", then
    "Assistant:"); a message's content is its text (OpenAI's text parts joined)."""
    return transcript_media(messages, keep_media=False)[0]


def transcript_media(messages: Sequence[Mapping[str, Any]], *, keep_media: bool = True) -> tuple[str, list[str]]:
    """:func:`transcript_prompt` with each image or sound part written as the media marker where
    it stands, and the parts' base64 data in the same order (BadRequest for one that is not
    inline data: a base model's transcript cannot fetch a URL). ``keep_media=False``: text only."""
    lines = []
    media: list[str] = []
    for i, message in enumerate(messages):
        role, content = message.get("role"), message.get("content") or ""
        if isinstance(content, list):  # OpenAI's content parts
            pieces = []
            for j, part in enumerate(content):
                if not isinstance(part, Mapping):
                    continue
                if keep_media and part.get("type") in MEDIA_PARTS:
                    media.append(media_data(part, f"messages[{i}].content[{j}]"))
                    pieces.append(MEDIA_MARKER)
                else:
                    pieces.append(str(part.get("text", "")))
            content = "".join(pieces)
        if role == "system":
            lines.append(f"{content}\n")
        elif role in ("user", "tool"):
            lines.append(f"User: {content}")
        else:
            lines.append(f"Assistant: {content}")
    return "\n".join(lines) + "\nAssistant:", media


def media_data(part: Mapping[str, Any], where: str) -> str:
    """The base64 data of an ``image_url`` part (a ``data:`` URI) or an ``input_audio`` part."""
    if part.get("type") == "input_audio":
        audio = part.get("input_audio")
        data = audio.get("data") if isinstance(audio, Mapping) else None
        if not isinstance(data, str) or not data:
            raise BadRequest(f'{where}.input_audio.data must be base64-encoded audio')
        return "".join(data.split())
    image = part.get("image_url")
    url = image.get("url") if isinstance(image, Mapping) else image
    if not isinstance(url, str) or not url.startswith("data:") or ";base64," not in url[:200]:
        raise BadRequest(
            f"{where}.image_url must be a data: URI with base64 data (data:image/png;base64,...): a model "
            f"without a chat template is prompted as a transcript, and images from a URL are not fetched"
        )
    return "".join(url.split(",", 1)[1].split())


def has_media(messages: object) -> bool:
    """Whether any message's content holds an image or a sound part."""
    for message in messages if isinstance(messages, list) else []:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list) and any(isinstance(p, Mapping) and p.get("type") in MEDIA_PARTS for p in content):
            return True
    return False


def media_prompt(text: str, media: list[str]) -> str | dict[str, Any]:
    """``/completion``'s ``prompt``: the text, or with media the multimodal prompt object."""
    return {"prompt_string": text, "multimodal_data": media} if media else text


def with_turn_stop(stop: object) -> list[Any]:
    """The client's stop strings (one or a list) and the transcript's next turn."""
    given = [stop] if isinstance(stop, str) else list(stop) if isinstance(stop, list) else []
    return [*given, TURN_STOP]



def media_of_images(images: object) -> list[str]:
    """The base64 data of Ollama's ``images`` (plain base64, or ``data:`` URIs), in order."""
    out = []
    for image in images if isinstance(images, list) else []:
        if isinstance(image, str):
            out.append("".join((image.split(",", 1)[1] if image.startswith("data:") else image).split()))
    return out


def completion_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """One event (or the whole answer) of llama-server's ``/completion`` in ``/v1/completions``'
    shape, which the OpenAI routes' transcript path translates: a choice with the text and the
    finish reason (``length`` at the limit, else ``stop``), and at the end ``usage`` (the whole
    prompt, as ``/v1/completions`` counts it) and ``timings``. Errors pass unchanged."""
    if "error" in event:
        return dict(event)
    stop = event.get("stop") is True
    reason = ("length" if event.get("stop_type") == "limit" else "stop") if stop else None
    out: dict[str, Any] = {
        "object": "text_completion",
        "model": event.get("model", ""),
        "choices": [{"index": 0, "text": event.get("content") or "", "logprobs": None, "finish_reason": reason}],
    }
    if stop:
        prompt, completion = int(event.get("tokens_evaluated") or 0), int(event.get("tokens_predicted") or 0)
        out["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        if "timings" in event:
            out["timings"] = event["timings"]
    return out


def completion_lines(lines: list[bytes]) -> list[bytes]:
    """A batch of ``/completion`` stream lines as ``/v1/completions`` stream lines (each event
    through :func:`completion_event`; ``data: [DONE]`` after the last, as that stream ends)."""
    out = []
    for line in lines:
        if line.startswith(b"data: {"):
            event = json.loads(line[6:])
            out.append(b"data: " + json.dumps(completion_event(event), ensure_ascii=False).encode())
            if event.get("stop") is True:
                out += [b"", b"data: [DONE]"]
        else:
            out.append(line)
    return out
