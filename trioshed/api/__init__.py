"""The HTTP edge: Ollama and OpenAI routes, and the pure translation they share.

``translate`` has no I/O and does not import quart; the route modules are the only ones that do.
"""
