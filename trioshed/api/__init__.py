"""The HTTP edge: one route module per protocol over one request preamble.

* :mod:`.protocols`: each protocol's request building, stream translation and error shape, with
  no I/O (no quart, no trio).
* :mod:`.preamble`: what every generating route does first (body, model, keep_alive, options).
* Routes: :mod:`.ollama` (generate, chat), :mod:`.ollama_models` (tags, ps, show, version),
  :mod:`.openai`, :mod:`.embed`, :mod:`.manage`, :mod:`.metrics`, :mod:`.openapi`;
  :mod:`.app` assembles them; :mod:`.upstream` reaches a runner through its lease.
"""
