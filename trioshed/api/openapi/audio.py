"""The OpenAPI description of ``/v1/audio/transcriptions`` (:mod:`trioshed.api.routes.transcriptions`),
merged into ``/openapi.json`` by :mod:`trioshed.api.openapi.document`. Errors in OpenAI's shape."""

from __future__ import annotations

from trioshed.api.openapi.parts import NUM, STR, Schema, obj, ref

_STATUSES = {
    "400": "Bad input: no model or file, audio that is not WAV or MP3, a response_format other than json, text or "
    "verbose_json, or a model without an audio projector (\"m\" does not support audio).",
    "401": "TRIOSHED_API_KEY is set and the bearer token is missing or wrong.",
    "404": "No such model in the store.",
    "413": "The request body is larger than TRIOSHED_MAX_BODY.",
    "415": "The body is not multipart/form-data.",
    "502": "llama-server answered with an error.",
    "503": "Queue full, the model is in its load back-off, or trioshed is shutting down (Retry-After).",
}


def audio_paths() -> dict[str, Schema]:
    form = obj(
        {
            "file": {"type": "string", "format": "binary", "description": "the audio, WAV or MP3"},
            "model": STR,
            "language": STR,
            "prompt": STR,
            "response_format": {"enum": ["json", "text", "verbose_json"]},
            "temperature": NUM,
        },
        ("file", "model"),
    )
    answer = obj({"text": STR, "task": STR, "language": STR, "duration": NUM, "segments": {"type": "array"}}, ("text",))
    error = {"application/json": {"schema": ref("OpenAIError")}}
    return {
        "/v1/audio/transcriptions": {
            "post": {
                "summary": "Transcription (OpenAI): the words spoken in an audio file, by a model with an audio projector",
                "requestBody": {"required": True, "content": {"multipart/form-data": {"schema": form}}},
                "responses": {
                    "200": {"description": "the text", "content": {"application/json": {"schema": answer}, "text/plain": {"schema": STR}}},
                    **{code: {"description": why, "content": error} for code, why in _STATUSES.items()},
                },
            }
        }
    }
