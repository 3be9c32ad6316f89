"""The repository's own rules: layout, documents, the lock."""
