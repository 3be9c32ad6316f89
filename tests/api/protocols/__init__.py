"""Each protocol's translation (trioshed.api.protocols), without I/O, and its routes."""
