"""How big each side-by-side scenario is, for ``--quick`` (``make bench``) and ``--full``."""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.procs import RunnerFlags

TARGETS = ("direct", "router", "trioshed")

#: The API each target is spoken to with, per request family. "generate" is each server's own
#: completion route for a raw prompt (trioshed: Ollama's /api/generate with "raw": true, which it
#: sends to llama-server's /completion, the same work direct does); "chat" is the OpenAI route
#: all three share (templated). A non-raw /api/generate is templated and goes upstream as chat.
API_BY_FAMILY = {
    "generate": {"direct": "native", "router": "native", "trioshed": "ollama-raw"},
    "chat": {"direct": "openai-chat", "router": "openai-chat", "trioshed": "openai-chat"},
}


@dataclass(frozen=True)
class Plan:
    mode: str
    flags: RunnerFlags = field(default_factory=RunnerFlags)  # -t 1, 4 slots, 1024 ctx per slot
    # (a) overhead: paired requests at c=1, per API family
    overhead_pairs: int = 300
    overhead_n_predict: int = 8
    # (b) throughput: (concurrency, requests) blocks, rounds interleaved
    throughput: tuple[tuple[int, int], ...] = ((4, 64), (16, 128))
    throughput_rounds: int = 3
    # (c) streaming: gemma3-270m, paired requests at c=1
    stream_pairs: int = 6
    stream_n_predict: int = 128
    # (c2) concurrent streams: gemma3-270m, this many chat streams at once on 4 slots
    concurrent_streams: int = 8
    concurrent_n_predict: int = 32
    concurrent_rounds: int = 3
    # (d) swap: max loaded 1, the three tiny models in turn
    swap_cycles: int = 5
    # (e) head-of-line: model A hot at c=4, alone then with B swapping every few seconds
    hol_seconds: float = 6.0
    hol_swap_every: float = 1.5
    # (f) overload: more simultaneous clients than trioshed's queue holds
    overload_clients: int = 48
    overload_queue: int = 8
    overload_n_predict: int = 32
    overload_rounds: int = 2
    # (g) contention: max loaded 1, clients round-robin over three models
    contention_clients: tuple[int, ...] = (3, 8)
    contention_requests: int = 30
    # bounds
    request_timeout: float = 60.0
    scenario_seconds: float = 120.0
    total_seconds: float = 540.0  # stop starting scenarios after this (quick: under 10 min)
    with_gemma: bool = True


QUICK = Plan(mode="quick")
FULL = Plan(
    mode="full",
    overhead_pairs=1000,
    throughput=((4, 200), (16, 400)),
    throughput_rounds=4,
    stream_pairs=8,
    concurrent_n_predict=128,
    concurrent_rounds=3,
    swap_cycles=10,
    hol_seconds=20.0,
    overload_clients=96,
    overload_rounds=4,
    contention_requests=90,
    scenario_seconds=600.0,
    total_seconds=3000.0,
)
#: For the harness's own test: a few requests, no Gemma.
SMOKE = Plan(
    mode="smoke",
    overhead_pairs=5,
    throughput=((4, 8),),
    throughput_rounds=1,
    stream_pairs=0,
    concurrent_streams=0,
    swap_cycles=1,
    hol_seconds=1.0,
    hol_swap_every=0.5,
    overload_clients=8,
    overload_queue=2,
    contention_clients=(3,),
    contention_requests=6,
    overload_rounds=1,
    scenario_seconds=30.0,
    total_seconds=60.0,
    with_gemma=False,
)
PLANS = {p.mode: p for p in (QUICK, FULL, SMOKE)}
