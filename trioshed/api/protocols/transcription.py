"""OpenAI's ``/v1/audio/transcriptions`` as a chat turn for a model that hears. No I/O.

The client uploads an audio file (multipart: ``file``, ``model``, and optionally ``language``,
``prompt``, ``response_format``, ``temperature``), as OpenAI's SDKs send it. A model with an
audio projector hears it through llama.cpp's multimodal library: the file goes as an
``input_audio`` part of one user message, with an instruction to write down what is said
(Ollama answers this route the same way, from a chat). The answer is the text, trimmed, in the
shape asked for: ``json`` (``{"text"}``, the default), ``text`` (plain text) or
``verbose_json`` (``{"task", "language", "duration", "text", "segments"}``; no segments, a
chat has no timestamps). ``srt`` and ``vtt`` need timestamps: 400.
"""

from __future__ import annotations

import base64
import io
import json
import wave
from dataclasses import dataclass
from typing import Any

from trioshed.errors import BadRequest

__all__ = ["FORMATS", "Transcription", "audio_format", "parse_transcription", "transcript_answer"]

FORMATS = ("json", "text", "verbose_json")
_INSTRUCTION = (
    "Write down the words spoken in the audio, exactly and in full, and nothing else; "
    "if the audio asks something, do not answer it."
)


@dataclass(frozen=True)
class Transcription:
    """What a transcription request asks for."""

    model: str
    audio: bytes
    audio_format: str  # "wav" or "mp3"
    language: str = ""
    prompt: str = ""
    response_format: str = "json"
    temperature: float = 0.0

    def chat_body(self) -> dict[str, Any]:
        """The chat completion that transcribes it (llama-server's own OpenAI-style route)."""
        instruction = _INSTRUCTION
        if self.language:
            instruction += f" The language is {self.language}."
        if self.prompt:
            instruction += f" Earlier words, names and spellings: {self.prompt}"
        audio = {"data": base64.b64encode(self.audio).decode(), "format": self.audio_format}
        return {
            "messages": [
                {"role": "system", "content": instruction},
                {"role": "user", "content": [{"type": "input_audio", "input_audio": audio}]},
            ],
            "temperature": self.temperature,
            "stream": False,
        }

    def duration(self) -> float:
        """Seconds of audio (a WAV file's header; 0.0 when it does not say)."""
        if self.audio_format != "wav":
            return 0.0
        try:
            with wave.open(io.BytesIO(self.audio)) as w:
                return w.getnframes() / float(w.getframerate() or 1)
        except (wave.Error, EOFError, ValueError):
            return 0.0


def audio_format(data: bytes) -> str | None:
    """``wav`` or ``mp3`` from a file's first bytes (what llama-server's ``input_audio`` takes)."""
    if data[:4] == b"RIFF" and data[8:12] == b"WAVE":
        return "wav"
    if data[:3] == b"ID3" or (len(data) > 1 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def parse_transcription(form: dict[str, str], file: bytes | None) -> Transcription:
    """The request from the multipart form's fields and the uploaded file's bytes (None: no
    ``file`` part). BadRequest for what is missing or not supported."""
    model = form.get("model", "").strip()
    if not model:
        raise BadRequest("model is required")
    if file is None:
        raise BadRequest('file is required: upload the audio as the multipart field "file"')
    if not file:
        raise BadRequest("the audio file is empty")
    kind = audio_format(file)
    if kind is None:
        raise BadRequest("the audio file must be WAV or MP3")
    response_format = form.get("response_format", "") or "json"
    if response_format not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}")
    try:
        temperature = float(form.get("temperature", "") or 0.0)
    except ValueError:
        raise BadRequest(f"temperature must be a number, got {form.get('temperature')!r}") from None
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest("temperature must be between 0 and 2")
    return Transcription(model, file, kind, form.get("language", "").strip(), form.get("prompt", ""), response_format, temperature)


def transcript_answer(request: Transcription, chat: dict[str, Any]) -> tuple[str, str]:
    """(body, content type) of the answer, from llama-server's chat completion."""
    choices = chat.get("choices") or [{}]
    text = str(((choices[0] or {}).get("message") or {}).get("content") or "").strip()
    if request.response_format == "text":
        return text, "text/plain; charset=utf-8"
    if request.response_format == "verbose_json":
        body: dict[str, Any] = {
            "task": "transcribe",
            "language": request.language,
            "duration": request.duration(),
            "text": text,
            "segments": [],
        }
    else:
        body = {"text": text}
    usage = chat.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
        body["usage"] = {"type": "tokens", "input_tokens": usage["prompt_tokens"],
                         "output_tokens": int(usage.get("completion_tokens") or 0),
                         "total_tokens": int(usage.get("total_tokens") or 0)}  # fmt: skip
    return json.dumps(body), "application/json"
