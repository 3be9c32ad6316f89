"""The HTTP edge, the only package that imports Quart, in rooms by concern.

* :mod:`.routes`: the routes a client calls, one module per protocol or resource.
* :mod:`.pipeline`: the way a request travels: listener, fast path, wrapper and gate, preamble,
  the hop to a runner (upstream), the fleet's forwarding, the drain.
* :mod:`.protocols`: each protocol's request building, stream translation and error shape, with
  no I/O (no quart, no trio).
* :mod:`.openapi`: the API's description, ``GET /openapi.json``.
* :mod:`.observe`: metrics, the inference gateway's protocol, the request log, the status page.
* :mod:`.app` assembles them into one application; :mod:`.state` is what the routes share.
"""
