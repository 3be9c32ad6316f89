"""The HTTP edge (trioshed.api): the request's path, the gate, limits, uploads."""
