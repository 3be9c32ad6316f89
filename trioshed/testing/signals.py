"""Stopping a real child for a test, and knowing that it is stopped.

``os.kill(pid, SIGSTOP)`` returns before every thread of a busy multi-threaded child has stopped:
llama-server was measured answering a quick request (``/tokenize``, ``/health``) just after it.
A test that means "the runner is frozen now" waits until the kernel says so for every thread.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import trio


def _all_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is in the stopped state (``T`` in ``/proc``); a process
    that is gone counts as stopped (nothing of it can answer)."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        states = [(task / "stat").read_text().rsplit(")", 1)[1].split()[0] for task in tasks]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return True
    return all(state in ("T", "t", "Z", "X") for state in states)


async def stop_process(pid: int, *, within: float = 10.0) -> None:
    """SIGSTOP ``pid``, then wait (at most ``within`` seconds) until all its threads are stopped."""
    os.kill(pid, signal.SIGSTOP)
    with trio.fail_after(within):
        while not _all_stopped(pid):  # noqa: ASYNC110 - the kernel's state, no event to await
            await trio.sleep(0.001)
