"""The routes a client calls: one module per protocol or resource (Ollama, OpenAI, Anthropic,
llama-server's own, embeddings, rerank, models, keys, usage), each a thin Quart blueprint over
:mod:`trioshed.api.pipeline` and :mod:`trioshed.api.protocols`."""
