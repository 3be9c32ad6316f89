"""The protocols trioshed speaks, one module each, as plain code without I/O (no trio, no quart).

Each turns its client's request into the llama-server request to make
(:class:`~trioshed.api.protocols.llama.Upstream` or a body) and llama-server's answer back into its
client's shape. The routes (``trioshed.api.routes.ollama``, ``.openai``, ``.anthropic``, ``.embed``) do the I/O.

* :mod:`.options`: Ollama ``options`` -> llama-server sampling and runner overrides; validators.
* :mod:`.llama`: what llama-server speaks (``Upstream``, SSE lines, format/think/logprob params).
* :mod:`.ollama`, :mod:`.ollama_stream`: ``/api/generate`` and ``/api/chat``.
* :mod:`.embeddings`: ``/api/embed``, ``/api/embeddings``.
* :mod:`.openai_chat`: ``/v1/chat/completions``, ``/v1/completions``.
* :mod:`.anthropic`, :mod:`.anthropic_stream`: ``/v1/messages``, ``/v1/messages/count_tokens``.
* :mod:`.transcript`: chat for models without a chat template, shared by every protocol.
* :mod:`.errors`: each protocol's error body, chosen by path.
"""
