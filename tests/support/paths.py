"""Where the repository is, for the tests that read its files (the manifests, the docs, bench/)."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
