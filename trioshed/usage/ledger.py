"""What each key spent, and whether it may start another request (pure: no I/O, ``now`` passed in).

A finished request is a :class:`Spend`. The ledger keeps, per key name, the last minute's spends
and today's totals (UTC days), enough to answer every budget of :data:`trioshed.keys.BUDGETS`.
Budgets are checked when a request starts, from what was spent so far: requests already running
may take a key past its budget (a stream is never cut for it), the next one is refused.

In a team of nodes the ledger also holds what the *other* nodes spent (:meth:`Ledger.set_others`,
refreshed from the shared store by the recorder), and every budget counts both.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from trioshed.keys import ApiKey

DAY = 86400.0
_PICK = {"total": lambda p, c: p + c, "prompt": lambda p, c: p, "completion": lambda p, c: c}
MINUTE = 60.0


@dataclass(frozen=True, slots=True)
class Spend:
    """One finished request of ``key`` on ``model`` at wall-clock ``time``."""

    key: str
    model: str
    time: float
    prompt: int = 0
    cached: int = 0  # of ``prompt``, the tokens llama-server took from its cache
    completion: int = 0
    error: bool = False
    seconds: float = 0.0  # generation time (prompt processing and decoding) llama-server reported


class Ledger:
    """Spends of the last minute and of today, per key name."""

    def __init__(self) -> None:
        self._minute: dict[str, deque[tuple[float, int, int]]] = {}
        self._minute_sums: dict[str, list[int]] = {}  # name -> [prompt, completion] in the window (kept, not summed per ask)
        self._day: dict[str, tuple[int, int, int]] = {}  # name -> (day number, prompt, completion)
        #: name -> (day number, prompt, completion today, prompt, completion in the last minute)
        #: spent by the other nodes, as last read from the shared store
        self._others: dict[str, tuple[int, int, int, int, int]] = {}

    def set_others(self, spends: dict[str, tuple[int, int, int, int]], now: float) -> None:
        """What the other nodes spent per key name, read at ``now``: (prompt, completion) today
        and in the last minute. Replaces what was known."""
        day = int(now // DAY)
        self._others = {name: (day, *v) for name, v in spends.items()}

    def spend(self, s: Spend) -> None:
        if not (s.prompt or s.completion):
            return
        window = self._minute.setdefault(s.key, deque())
        sums = self._minute_sums.setdefault(s.key, [0, 0])
        window.append((s.time, s.prompt, s.completion))
        sums[0] += s.prompt
        sums[1] += s.completion
        self._trim(s.key, s.time)
        self.seed(s.key, s.time, s.prompt, s.completion)

    def seed(self, name: str, when: float, prompt: int, completion: int) -> None:
        """Add tokens spent on the day of ``when`` (also: today's totals read back at start-up)."""
        day = int(when // DAY)
        known = self._day.get(name)
        if known is None or known[0] < day:
            known = (day, 0, 0)
        elif known[0] > day:
            return  # an earlier day's spend: not today's
        self._day[name] = (day, known[1] + prompt, known[2] + completion)

    def today(self, name: str, now: float) -> tuple[int, int]:
        """(prompt, completion) tokens ``name`` spent today (UTC)."""
        day = int(now // DAY)
        known = self._day.get(name)
        prompt, completion = (known[1], known[2]) if known is not None and known[0] == day else (0, 0)
        other = self._others.get(name)
        if other is not None and other[0] == day:
            return prompt + other[1], completion + other[2]
        return prompt, completion

    def minute(self, name: str, now: float) -> tuple[int, int]:
        other = self._others.get(name)
        extra = (other[3], other[4]) if other is not None else (0, 0)
        if name not in self._minute:
            return extra
        self._trim(name, now)
        prompt, completion = self._minute_sums[name]
        return prompt + extra[0], completion + extra[1]

    def left(self, key: ApiKey, now: float) -> dict[str, int]:
        """Each budget of ``key`` -> the tokens left in it now (0 when spent)."""
        out = {}
        for field, kind, window, limit in key.budgets():
            prompt, completion = self.minute(key.name, now) if window == "minute" else self.today(key.name, now)
            used = {"total": prompt + completion, "prompt": prompt, "completion": completion}[kind]
            out[field] = max(0, limit - used)
        return out

    def refusal(self, key: ApiKey, now: float) -> tuple[str, int, int] | None:
        """None when ``key`` may start a request now; else (the budget in words, its limit, the
        seconds until it has room again)."""
        for _field, kind, window, limit in key.budgets():
            prompt, completion = self.minute(key.name, now) if window == "minute" else self.today(key.name, now)
            if {"total": prompt + completion, "prompt": prompt, "completion": completion}[kind] < limit:
                continue
            pick = _PICK[kind]
            words = ("" if kind == "total" else f"{kind} ") + f"tokens per {window}"
            if window == "day":
                retry = math.ceil((int(now // DAY) + 1) * DAY - now)
            else:
                retry = self._minute_retry(key.name, now, limit, pick)
            return words, limit, max(1, retry)
        return None

    def _minute_retry(self, name: str, now: float, limit: int, pick: object) -> int:
        window = self._minute.get(name) or deque()
        used = sum(pick(p, c) for _, p, c in window)  # type: ignore[operator]
        for when, p, c in window:  # the oldest spends leave the window first
            used -= pick(p, c)  # type: ignore[operator]
            if used < limit:
                return math.ceil(when + MINUTE - now)
        return math.ceil(MINUTE)

    def _trim(self, name: str, now: float) -> None:
        window, sums = self._minute[name], self._minute_sums[name]
        while window and window[0][0] <= now - MINUTE:
            _, prompt, completion = window.popleft()
            sums[0] -= prompt
            sums[1] -= completion
