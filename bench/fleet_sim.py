"""A fleet at a scale these machines cannot host: 100 nodes, 500 models, simulated time.

``python -m bench.fleet_sim [--seed 1] [--seconds 600] [--rate 60]`` drives three ways of
choosing a node with the same seeded workload and reports, for each, the loads, the wait of a
request (arrival to the start of its answer, loads included) at p50/p99, the memory the nodes'
runners hold, and how often a conversation's next turn found its prompt on its node:

* ``hash``: today's balancer: consistent hashing of the model name over the nodes (HAProxy's
  ``hash-type consistent``: 100 points per node on a ring), state ignored;
* ``least-queue``: the node with the fewest requests running and queued (least connections),
  whatever it has loaded;
* ``fleet``: trioshed's routing, :func:`trioshed.core.route.choose` itself (the function the
  server calls), each request arriving at a node chosen round-robin (a plain balancer), that
  node seeing its own state live and the others' as read every ``--interval`` seconds, plus the
  requests it sent since (as :class:`trioshed.fleet.node.Fleet` counts them).

The nodes are a simplified model of one trioshed each, built on the numbers the real scheduler
uses (explicitly not ``trioshed.core.sched.plan``: a plan per node per event would take hours
here): a node has ``MEMORY`` bytes and at most ``MAX_RUNNERS`` runners of ``SLOTS`` slots each; a
model needs its size (its estimate); a request for a model that is not loaded loads it when it
fits, evicting idle runners least recently used first, and otherwise waits for a runner to go
idle; a load takes ``LOAD_BASE + size / LOAD_RATE`` seconds; an answer takes a seeded
1-4 seconds; idle runners stay loaded (keep-alive longer than the run).

The workload: Poisson arrivals, model popularity Zipf (s = 1.1) over the 500 models, a burst
every 30 s (300 requests for one model in 5 s), and conversations (40 % of requests are a
conversation's next turn, a few seconds after its previous turn ended).
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from trioshed.core.route import ModelLoad, NodeState, choose

GiB = 1024**3
NODES, MODELS = 100, 500
MEMORY = 24 * GiB
MAX_RUNNERS = 6
SLOTS = 4
LOAD_BASE, LOAD_RATE = 2.0, 1.0 * GiB  # seconds, bytes per second
ZIPF_S = 1.1


@dataclass
class Request:
    id: int
    model: str
    arrived: float
    service: float
    conversation: int | None = None
    prefix: str | None = None
    started: float | None = None
    node: str = ""


@dataclass
class Runner:
    model: str
    size: int
    ready_at: float
    busy: int = 0
    queue: deque[Request] = field(default_factory=deque)
    last_used: float = 0.0


class Node:
    """One trioshed, simplified (see the module docstring)."""

    def __init__(self, name: str, sim: Sim) -> None:
        self.name = name
        self.sim = sim
        self.runners: dict[str, Runner] = {}
        self.waiting: deque[Request] = deque()  # for memory: no room even after evicting idle runners
        self.prefixes: dict[str, float] = {}  # conversations served here -> when

    @property
    def used(self) -> int:
        return sum(r.size for r in self.runners.values())

    def arrive(self, req: Request, now: float) -> None:
        req.node = self.name
        runner = self.runners.get(req.model)
        if runner is not None:
            runner.queue.append(req)
            self._dispatch(runner, now)
            return
        self.waiting.append(req)
        self._place(now)

    def _place(self, now: float) -> None:
        """Load what the waiting requests need, evicting idle runners (LRU) to make room; a
        request that cannot be placed yet does not hold up the others (as the real planner)."""
        still: deque[Request] = deque()
        for req in self.waiting:
            runner = self.runners.get(req.model)
            if runner is not None:
                runner.queue.append(req)
                self._dispatch(runner, now)
                continue
            size = self.sim.sizes[req.model]
            idle = sorted((r for r in self.runners.values() if not r.busy and not r.queue and r.ready_at <= now), key=lambda r: r.last_used)
            while (self.used + size > MEMORY or len(self.runners) >= MAX_RUNNERS) and idle:
                victim = idle.pop(0)
                del self.runners[victim.model]
                self.sim.evictions += 1
            if self.used + size > MEMORY or len(self.runners) >= MAX_RUNNERS:
                still.append(req)  # waits for a runner to go idle
                continue
            runner = Runner(req.model, size, now + LOAD_BASE + size / LOAD_RATE, last_used=now)
            runner.queue.append(req)
            self.runners[req.model] = runner
            self.sim.loads += 1
            self.sim.at(runner.ready_at, lambda t, r=runner: self._dispatch(r, t))
        self.waiting = still

    def _dispatch(self, runner: Runner, now: float) -> None:
        if runner.ready_at > now or self.runners.get(runner.model) is not runner:
            return
        while runner.queue and runner.busy < SLOTS:
            req = runner.queue.popleft()
            runner.busy += 1
            req.started = now
            if req.prefix is not None:
                self.sim.turn_served(req, self)
                self.prefixes[req.prefix] = now
            self.sim.at(now + req.service, lambda t, r=runner, q=req: self._finish(r, q, t))

    def _finish(self, runner: Runner, req: Request, now: float) -> None:
        runner.busy -= 1
        runner.last_used = now
        self.sim.finished(req, now)
        self._dispatch(runner, now)
        if self.waiting:
            self._place(now)

    def state(self, now: float) -> NodeState:
        """What this node publishes (:class:`trioshed.core.route.NodeState`)."""
        loaded = {
            m: ModelLoad(SLOTS, r.busy, len(r.queue), 4096, r.ready_at <= now) for m, r in self.runners.items()
        }
        recent = frozenset(p for p, t in self.prefixes.items() if now - t < 600)
        return NodeState(
            self.name, models=self.sim.sizes, loaded=loaded, room=MEMORY - self.used, runners=len(self.runners),
            max_runners=MAX_RUNNERS, queued=len(self.waiting) + sum(len(r.queue) for r in self.runners.values()),
            prefixes=recent, seen=now,
        )  # fmt: skip

    def load(self) -> int:
        return len(self.waiting) + sum(r.busy + len(r.queue) for r in self.runners.values())


class Sim:
    """The event loop: a heap of (time, seq, action) on a simulated clock."""

    def __init__(self, strategy: str, seed: int, interval: float) -> None:
        self.strategy = strategy
        self.rng = random.Random(seed)
        self.interval = interval
        sizes_rng = random.Random(seed)  # the same models for every strategy
        self.sizes = {f"m{i:03d}:latest": int(min(16.0, max(0.5, sizes_rng.lognormvariate(1.2, 0.7))) * GiB) for i in range(MODELS)}
        self.nodes = [Node(f"n{i:03d}", self) for i in range(NODES)]
        self.by_name = {n.name: n for n in self.nodes}
        self.events: list[tuple[float, int, Callable[[float], None]]] = []
        self.seq = itertools.count()
        self.loads = self.evictions = 0
        self.waits: list[float] = []
        self.turns = self.turn_hits = 0
        self.last_node: dict[int, str] = {}
        self.memory: list[float] = []
        self.conversations: list[tuple[int, str, str]] = []  # (id, model, prefix) open for a next turn
        self.snapshots: dict[str, NodeState] = {}
        self.pending: dict[str, dict[tuple[str, str], int]] = {}  # per entry node
        self.rr = itertools.cycle(self.nodes)
        self.ring = sorted((int(hashlib.md5(f"{n.name}-{k}".encode()).hexdigest()[:8], 16), n.name) for n in self.nodes for k in range(100))

    def at(self, when: float, action: Callable[[float], None]) -> None:
        heapq.heappush(self.events, (when, next(self.seq), action))

    def finished(self, req: Request, now: float) -> None:
        assert req.started is not None
        self.waits.append(req.started - req.arrived)
        if req.conversation is not None:
            self.last_node[req.conversation] = req.node

    def turn_served(self, req: Request, node: Node) -> None:
        if req.conversation is not None and req.conversation in self.last_node:
            self.turns += 1
            self.turn_hits += self.last_node[req.conversation] == node.name

    def pick(self, req: Request, now: float) -> Node:
        if self.strategy == "hash":
            h = int(hashlib.md5(req.model.encode()).hexdigest()[:8], 16)
            i = bisect.bisect(self.ring, (h, "")) % len(self.ring)
            return self.by_name[self.ring[i][1]]
        if self.strategy == "least-queue":
            return min(self.nodes, key=lambda n: (n.load(), n.name))
        entry = next(self.rr)
        pending = self.pending.setdefault(entry.name, {})
        states = [entry.state(now) if name == entry.name else s for name, s in self.snapshots.items()]
        choice = choose(req.model, states, local=entry.name, now=now, stale_after=5 * self.interval, prefix=req.prefix, pending=pending)
        if choice.node != entry.name:
            key = (choice.node, req.model)
            pending[key] = pending.get(key, 0) + 1
        return self.by_name[choice.node]

    def snapshot(self, now: float) -> None:
        self.snapshots = {n.name: n.state(now) for n in self.nodes}
        self.pending.clear()
        self.memory.append(sum(n.used for n in self.nodes) / (NODES * MEMORY))
        self.at(now + self.interval, self.snapshot)

    def run(self, seconds: float, rate: float) -> dict[str, Any]:
        weights = [1 / (k + 1) ** ZIPF_S for k in range(MODELS)]
        names = list(self.sizes)
        self.rng.shuffle(names)  # popularity is not size
        ids = itertools.count()
        t = 0.0
        arrivals: list[tuple[float, str, int | None, str | None]] = []
        while t < seconds:
            t += self.rng.expovariate(rate)
            if self.conversations and self.rng.random() < 0.4:
                conv, model, prefix = self.rng.choice(self.conversations)
                arrivals.append((t, model, conv, prefix))
            else:
                model = self.rng.choices(names, weights)[0]
                conv = next(ids)
                if self.rng.random() < 0.5:  # a new conversation
                    self.conversations.append((conv, model, f"c{conv}"))
                    self.conversations = self.conversations[-2000:]
                    arrivals.append((t, model, conv, f"c{conv}"))
                else:
                    arrivals.append((t, model, None, None))
        for start in range(30, int(seconds), 30):  # bursts
            model = self.rng.choice(names[:50])
            arrivals += [(start + self.rng.uniform(0, 5), model, None, None) for _ in range(300)]
        for i, (when, model, conv, prefix) in enumerate(sorted(arrivals)):
            req = Request(i, model, when, self.rng.uniform(1.0, 4.0), conv, prefix)
            self.at(when, lambda now, r=req: self.pick(r, now).arrive(r, now))
        self.at(0.0, self.snapshot)
        while self.events:
            when, _, action = heapq.heappop(self.events)
            if when > seconds * 3 and not any(n.load() for n in self.nodes):
                break
            action(when)
        waits = sorted(self.waits)
        return {
            "strategy": self.strategy,
            "requests": len(waits),
            "loads": self.loads,
            "evictions": self.evictions,
            "wait_p50_s": round(statistics.median(waits), 3),
            "wait_p99_s": round(waits[int(0.99 * (len(waits) - 1))], 3),
            "memory_mean": round(statistics.mean(self.memory[: int(seconds / self.interval)]), 3),
            "turns_on_their_node": round(self.turn_hits / max(1, self.turns), 3),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--rate", type=float, default=60.0, help="requests per second, bursts aside")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two readings of the nodes' states")
    parser.add_argument("--strategies", default="hash,least-queue,fleet", help="comma-separated, of hash, least-queue, fleet")
    args = parser.parse_args()
    print(f"{NODES} nodes of {MEMORY // GiB} GiB, {MODELS} models, seed {args.seed}, {args.seconds:g} s at {args.rate:g} req/s + bursts")
    print("| strategy | requests | loads | evictions | wait p50 | wait p99 | memory held (mean) | turns on their node |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for strategy in args.strategies.split(","):
        r = Sim(strategy, args.seed, args.interval).run(args.seconds, args.rate)
        print(f"| {r['strategy']} | {r['requests']} | {r['loads']} | {r['evictions']} | {r['wait_p50_s']:.2f} s | "
              f"{r['wait_p99_s']:.2f} s | {100 * r['memory_mean']:.0f} % | {100 * r['turns_on_their_node']:.0f} % |")  # fmt: skip


if __name__ == "__main__":
    main()
