"""Usage and the shared store (trioshed.usage): SQLite and a real PostgreSQL."""
