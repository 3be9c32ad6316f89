"""Where a server's resident memory lives: its memory map grouped by region, and glibc's own account.

Used by ``bench.soak --heap-probe`` to tell growth of live Python objects from memory that the C
allocator keeps. Two views, both read without changing what is measured:

- :func:`regions` reads ``/proc/<pid>/smaps`` from outside and sums the resident and dirty-anon
  memory of each kind of mapping: the main arena (``[heap]``), glibc's other arenas (the
  anonymous heaps of 64 MiB reservations, aligned to 64 MiB, that a worker thread's ``malloc``
  is served from), thread stacks (a guard page and then 8 MiB), other anonymous mappings
  (CPython's 1 MiB object arenas, large ``malloc`` blocks above the mmap threshold), and files.
- :func:`sitecustomize` writes a ``sitecustomize.py`` that the server imports at start (put its
  folder on ``PYTHONPATH``): on ``SIGUSR2`` it writes glibc's ``malloc_info`` (each arena's
  size, and how much of it is free) to a file, on the main thread, between two bytecodes; with
  ``trim`` it first calls ``malloc_trim(0)``, to see what a trim would give back; before that
  it writes CPython's own allocator's account (``sys._debugmallocstats``: its 1 MiB arenas, the
  bytes in live blocks) beside it (:func:`pymalloc`). With
  ``HEAP_PROBE_TRACE=<folder>,<seconds>`` it runs ``tracemalloc`` and dumps a snapshot into the
  folder every ``<seconds>`` (``snap-<seconds since start>.tracemalloc``), from a daemon thread:
  diff two with :func:`tracemalloc.Snapshot.compare_to` to see which Python allocations grew.
"""

from __future__ import annotations

import re
from pathlib import Path

ARENA = 64 * 2**20  # glibc's HEAP_MAX_SIZE on 64-bit: each non-main arena heap sits in one

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


def regions(pid: int) -> dict[str, float]:
    """Resident MB of each kind of mapping of ``pid`` (``*_rss``), and the number of arena heaps."""
    maps: list[dict[str, object]] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        m = _HEADER.match(line)
        if m:
            maps.append({"start": int(m[1], 16), "end": int(m[2], 16), "perms": m[3], "path": m[4].strip(), "rss": 0})
        elif line.startswith("Rss:") and maps:
            maps[-1]["rss"] = int(line.split()[1])
    out: dict[str, float] = {"heap": 0, "arenas": 0, "stacks": 0, "anon": 0, "files": 0, "arena_heaps": 0}
    for i, mp in enumerate(maps):
        start, end, perms, path, rss = mp["start"], mp["end"], mp["perms"], mp["path"], mp["rss"]
        assert isinstance(start, int) and isinstance(end, int) and isinstance(rss, int)
        if path == "[heap]":
            kind = "heap"
        elif path:
            kind = "other" if path.startswith("[") else "files"
        elif perms.startswith("rw") and start % ARENA == 0:
            kind = "arenas"
            out["arena_heaps"] += 1
        elif perms.startswith("rw") and i and maps[i - 1]["perms"] == "---p" and maps[i - 1]["end"] == start and end - start >= 2**20:
            kind = "stacks"
        else:
            kind = "anon"
        if kind in out:
            out[kind] += rss / 1024
    return {k: round(v, 2) for k, v in out.items()}


SITECUSTOMIZE = '''
import ctypes, ctypes.util, os, signal, sys, time

_trimmed = [0.0]

def _probe(signum, frame, _libc=ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")):
    if os.environ.get("HEAP_PROBE_TRIM") == "1" and time.monotonic() - _trimmed[0] >= 60:
        _trimmed[0] = time.monotonic()
        _libc.malloc_trim(0)
    # CPython's own allocator first (its arenas: in use against held); it prints to fd 2 only.
    fd = os.open(os.environ["HEAP_PROBE_OUT"] + ".pymalloc", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    saved = os.dup(2)
    os.dup2(fd, 2)
    try:
        sys._debugmallocstats()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(fd)
    path = os.environ["HEAP_PROBE_OUT"].encode()
    _libc.fopen.restype = ctypes.c_void_p
    f = _libc.fopen(path, b"w")
    _libc.malloc_info(0, ctypes.c_void_p(f))
    _libc.fclose(ctypes.c_void_p(f))

if os.environ.get("HEAP_PROBE_OUT"):
    signal.signal(signal.SIGUSR2, _probe)


def _snapshots(folder, every):
    import tracemalloc
    n = 0
    while True:
        time.sleep(every)
        n += 1
        tracemalloc.take_snapshot().dump(os.path.join(folder, f"snap-{n * every:06.0f}.tracemalloc"))


if os.environ.get("HEAP_PROBE_TRACE"):
    import threading, tracemalloc
    tracemalloc.start(int(os.environ.get("HEAP_PROBE_FRAMES", "8")))
    _folder, _, _every = os.environ["HEAP_PROBE_TRACE"].partition(",")
    threading.Thread(target=_snapshots, args=(_folder, float(_every or 60)), daemon=True).start()

if os.environ.get("HEAP_PROBE_EXTRA"):  # a probe of one's own, run at start (a path to a .py)
    import runpy
    runpy.run_path(os.environ["HEAP_PROBE_EXTRA"])
'''


def sitecustomize(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return folder


def pymalloc(text: str) -> dict[str, float]:
    """CPython's small-object allocator (``sys._debugmallocstats``): the 1 MiB arenas it holds, MB
    in live blocks, and the rest of those arenas (free blocks and pools, headers)."""

    def number(label: str) -> int:
        m = re.search(rf"^# {label}\s*=\s*([\d,]+)", text, re.M)
        return int(m[1].replace(",", "")) if m else -1

    arenas, used = number("arenas allocated current"), number("bytes in allocated blocks") / 2**20
    return {"arenas": arenas, "used_mb": round(used, 2), "free_mb": round(arenas - used, 2)}


_ARENA_XML = re.compile(r'<heap nr="(\d+)">.*?<system type="current" size="(\d+)"/>', re.S)


def malloc_info(text: str) -> dict[str, float]:
    """glibc's totals (MB): memory its arenas hold from the system, the part of it free (kept,
    not in use), in-use ``mmap`` blocks, and the number of arenas."""
    tail = text[text.rfind("</heap>") :]

    def total(kind: str) -> float:
        m = re.search(rf'<total type="{kind}" count="\d+" size="(\d+)"/>', tail)
        return int(m[1]) if m else 0

    system = re.search(r'<system type="current" size="(\d+)"/>', tail)
    return {
        "arenas": len(_ARENA_XML.findall(text)),
        "system_mb": round(int(system[1]) / 2**20, 2) if system else -1,
        "free_mb": round((total("fast") + total("rest")) / 2**20, 2),
        "mmap_mb": round(total("mmap") / 2**20, 2),
    }
