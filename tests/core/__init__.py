"""The decisions without I/O (trioshed.core, trioshed.access): plain def tests."""
