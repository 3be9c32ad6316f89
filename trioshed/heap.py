"""Give freed heap memory back to the system once the server goes quiet.

After a burst of requests trioshed's own resident memory stayed ~10 MB above where it started
(70.5 MB fresh, 81.3 MB after the benchmark's steady groups), although the objects it held had
not grown (``tracemalloc``: +0.8 MB): the rest was memory already freed that glibc's allocator
keeps in its arenas (large temporary buffers, such as a long vocabulary's scan, move its mmap
threshold up, so later ones come from the heap and stay). ``malloc_trim(0)`` returns those pages;
measured, it brought the process below its pre-burst size. It runs once the scheduler has seen
no change for :data:`QUIET` seconds with nothing leased or queued: never during a load.

Elsewhere than glibc (musl, macOS) there is no ``malloc_trim``, and this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

QUIET = 0.5  # seconds without a change before freed memory is given back (a trim takes ~1 ms)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim: Callable[[int], int] = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    return trim


def trim() -> bool:
    """Return the heap's free pages to the system now; whether the C library can."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


async def trim_when_quiet(
    wait_changed: Callable[[], Awaitable[Any]], idle: Callable[[], bool], *, quiet: float = QUIET
) -> None:
    """Until cancelled: after each spell of activity (``wait_changed`` returns on every change
    of the scheduler), once nothing changed for ``quiet`` seconds and ``idle()`` holds, trim."""
    if _malloc_trim() is None:
        return
    while True:
        await wait_changed()
        while True:
            with trio.move_on_after(quiet) as waited:
                await wait_changed()
            if waited.cancelled_caught:
                break
        if idle():
            trim()
