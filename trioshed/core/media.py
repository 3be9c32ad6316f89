"""Where media go in a prompt that trioshed writes itself: the marker a runner reads as "an image
or a sound goes here".

A model with a projector but no chat template is prompted with a plain transcript
(``api/protocols/transcript.py``) on llama-server's ``/completion``, which takes media as
``{"prompt_string": text with one marker per item, "multimodal_data": [base64, ...]}``. llama.cpp
b10068 draws a random marker at each start (``/props`` ``media_marker``) so that no text can
name one by chance or on purpose; ``LLAMA_MEDIA_MARKER`` sets it instead. Every runner gets
:data:`MEDIA_MARKER` in its environment: drawn once per trioshed process, unguessable from outside,
and known before a request reaches its runner. Pure (no I/O).
"""

from __future__ import annotations

import secrets

__all__ = ["MEDIA_MARKER", "MEDIA_MARKER_VARIABLE"]

#: The environment variable llama-server reads its media marker from.
MEDIA_MARKER_VARIABLE = "LLAMA_MEDIA_MARKER"

#: This process's media marker (the shape of llama.cpp's own).
MEDIA_MARKER = f"<__media_{secrets.token_hex(16)}__>"
