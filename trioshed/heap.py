"""Give freed heap memory back to the system once the server goes quiet.

After a burst of requests trioshed's own resident memory stayed ~10 MB above where it started
(70.5 MB fresh, 81.3 MB after the benchmark's steady groups), although the objects it held had
not grown (``tracemalloc``: +0.8 MB): the rest was memory already freed that glibc's allocator
keeps in its arenas (large temporary buffers, such as a long vocabulary's scan, move its mmap
threshold up, so later ones come from the heap and stay). ``malloc_trim(0)`` returns those pages;
measured, it brought the process below its pre-burst size. It runs once the scheduler has seen
no change for :data:`QUIET` seconds with nothing leased or queued.

A load that never goes quiet (the soak: ten clients and a fault every 20 s for 15 minutes) never
reached that trim, and the RSS crept up by about 0.3 MB a minute. Measured by region
(``bench.soak --heap-probe``): all of it was in the main arena (``[heap]``), and glibc's own
account (``malloc_info``) showed it free, not in use (in use stayed within 0.2 MB), while the
other arenas, thread stacks and CPython's object arenas stayed flat. So under a load it also trims
every :data:`BUSY_EVERY` seconds, in a worker thread: the event loop goes on serving while the
allocator walks its free lists (about a millisecond with ~20 MB free; a thread that allocates
meanwhile may wait that long for an arena's lock). Trimmed once a minute, the soak's RSS rose
about 2 MB again within the next 30 s (freed pages touched again) and fell back at the next trim:
a saw tooth; a shorter period keeps the tooth small. Bounding the number of arenas
(``M_ARENA_MAX``) would not have helped: the process uses two to four, and the growth was in the
main one.

What is left after trimming is free memory in pages that live blocks share, which no trim can
return: large temporary buffers (a request body, a JSON answer, an upload's batch) that come from
the heap among small blocks. glibc serves a block from ``mmap`` when it is larger than its mmap
threshold, but raises that threshold to the size of every mapped block freed (up to 32 MiB), so
after one large buffer the next ones are carved out of the heap. :func:`fix_mmap_threshold` pins
the threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops the raising): a block of
:data:`MMAP_THRESHOLD` bytes or more is mapped and unmapped on its own, and leaves no hole.

Elsewhere than glibc (musl, macOS) there is no ``malloc_trim`` nor ``mallopt``, and this does
nothing.

Above glibc, CPython's own 1 MiB object arenas: an arena goes back only once every object in it is
freed, so a few objects that live for minutes among short-lived ones pin it. Measured over a soak
(6 minutes, objects tracked by the collector), most of what lived for minutes was cyclic garbage:
each closed HTTP connection leaves a cycle (hypercorn's protocol, h11's state and receive buffer,
the socket stream, ~25 objects) that outlives the young generations whenever the connection
lasted a few collections, and then waits in the oldest generation for a full collection, which
CPython runs only once the objects promoted there reach a quarter of those already there: with
the ~89,000 objects start-up leaves, once every ~110 s under the soak's load (~45 ms each), each
freeing ~1,500-1,900 such objects. :func:`settle`, once the server is listening, collects and then
moves what start-up built out of the collector's reach (``gc.freeze``): a full collection then
walks only what was made since, and :func:`collect_regularly` runs one every
:data:`COLLECT_EVERY` seconds, so cyclic garbage lives seconds, not minutes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

QUIET = 0.5  # seconds without a change before freed memory is given back (a trim takes ~1 ms)
BUSY_EVERY = 15.0  # seconds: under a load that never goes quiet, freed memory is given back this often


COLLECT_EVERY = 10.0  # seconds between full garbage collections, once start-up is frozen

#: Bytes from which a block is mapped on its own (glibc's default before it starts raising it).
MMAP_THRESHOLD = 128 * 1024
_M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold at ``threshold`` bytes (see the module docstring); whether the
    C library took it."""
    mallopt = _libc("mallopt")
    return mallopt is not None and bool(mallopt(_M_MMAP_THRESHOLD, threshold))


@functools.cache
def _libc(name: str) -> Callable[..., int] | None:
    """The C library's function ``name``, or None where it has none (not glibc)."""
    try:
        fn: Callable[..., int] = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    return fn


def _malloc_trim() -> Callable[[int], int] | None:
    return _libc("malloc_trim")


def trim() -> bool:
    """Return the heap's free pages to the system now; whether the C library can."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


async def trim_when_quiet(
    wait_changed: Callable[[], Awaitable[Any]],
    idle: Callable[[], bool],
    last_change: Callable[[], float],
    *,
    quiet: float = QUIET,
    busy_every: float = BUSY_EVERY,
) -> None:
    """Until cancelled: after each spell of activity (``wait_changed`` returns on a change of the
    scheduler; ``last_change()`` is when it last changed, on Trio's clock), once nothing changed
    for ``quiet`` seconds and ``idle()`` holds, trim; and within a spell that goes on, trim in a
    worker thread once ``busy_every`` seconds have passed since the last trim.

    Within a spell it wakes once per ``quiet`` seconds at most, not on every change: a request
    changes the scheduler two or three times, and a wake-up of this task each time was part of
    every request's cost.

    Cancellation: a busy trim under way in its worker thread is waited for (about a millisecond).
    """
    if _malloc_trim() is None:
        return
    last = trio.current_time()
    while True:
        await wait_changed()
        first = last_change()
        while (due := last_change() + quiet) > (now := trio.current_time()):
            going_on = last_change() != first  # a spell, not a lone change
            if going_on and now - last >= busy_every:
                last = now
                await trio.to_thread.run_sync(trim)
                continue
            await trio.sleep_until(min(due, last + busy_every) if going_on else due)
        if idle():
            last = trio.current_time()
            trim()


def settle() -> None:
    """Once start-up is done: free its garbage, then freeze what is left (it lives as long as the
    process, and full collections no longer walk it); a second, now small, collection resets the
    collector's count of long-lived objects, so that its own full collections come as often as
    the objects made since warrant. For a process that serves until it exits (``trioshed
    serve``): frozen objects' cycles are never collected."""
    gc.collect()
    gc.freeze()
    gc.collect()


async def collect_regularly(every: float = COLLECT_EVERY) -> None:
    """Until cancelled: a full garbage collection every ``every`` seconds (after :func:`settle`,
    a few milliseconds: it walks only what was made since start-up)."""
    while True:
        await trio.sleep(every)
        gc.collect()
