"""Long prompts on the demo model through the official clients, on default settings.

``python -m trioshed serve --demo-model`` as a user starts it (no ``TRIOSHED_*`` setting but the
store folder and the port, so the context is automatic and the thread count trioshed's default),
Gemma 3 270M (trained on 32,768 tokens), driven by the ``anthropic``, ``openai`` and ``ollama``
Python SDKs:

1. short requests load the model at its first bucket (4,096) and are timed warm;
2. a prompt of ``--over`` tokens (40,000: more than the model was trained on) through each SDK
   must get that protocol's own context error (OpenAI's 400 ``context_length_exceeded``,
   Anthropic's ``prompt is too long: N tokens > M maximum``, Ollama's 400) with no load:
   ``/metrics`` counts no new load and ``/api/ps`` still shows the 4,096 runner;
3. a long Ollama chat (``--ollama`` tokens), then an OpenAI chat (``--openai``), then an Anthropic
   agent turn (``--anthropic``: a coding agent's system prompt and its tools' JSON schemas) each
   grow the runner to the next bucket (8,192, 16,384, 32,768); each is streamed and timed to its
   first token, while short requests keep arriving every ``--gap`` seconds;
4. the usage each SDK reports must equal the prompt's real count (``/tokenize`` of the transcript
   the demo model is given: it has no chat template, so every protocol's chat is a plain
   "User: / Assistant:" transcript on llama-server's completion endpoint);
5. the resize's cost: each long request's time to first token less its own prompt reading
   (Ollama's ``prompt_eval_duration``; for the others the same prompt rate), the loads'
   duration from ``/metrics``, and a baseline: the Ollama chat again (another first word, no
   shared prompt cache) on the grown runner, the same work without a resize.

The demo model brings no chat template, so it does not take ``tools`` (Ollama's 400 ``does not
support tools``, before any load, as Ollama answers for such a model): the agent turn sends its
tool definitions as the JSON text an agent puts in its system prompt for such models, and the
``tools=[...]`` request is checked to get that 400 without a load.

Prompts are built from fixed text (no randomness) and sized with the model's own tokenizer.
Writes ``bench/results/<date>-context-clients.md`` (and ``.json``) with the command line, the
load average and the CPU seconds of the server tree.

Run: ``python -m bench.context_clients [--anthropic 20000 --openai 12000 --ollama 6000 --over 40000]``
(about 10-20 minutes on a busy 2-core machine: ~44,000 prompt tokens are read on CPU).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MODEL = "gemma3-270m"
SHORT = "Say hello."
RESULTS = Path(__file__).parent / "results"

# -- prompts (deterministic) -------------------------------------------------------------------

_RULES = [
    "Read the files you change before you change them, and keep each edit as small as the task allows.",
    "Run the project's own tests after an edit; when a test fails, read its output before you try again.",
    "Never commit secrets, keys or tokens; if you find one in the tree, stop and tell the user.",
    "Prefer the project's existing helpers over new ones, and follow the style of the surrounding code.",
    "When a command may take long, run it in the background and poll its output instead of waiting.",
    "Explain what you did in a few sentences at the end of a turn: the files changed and why.",
    "Ask before deleting files, rewriting history or changing anything outside the working tree.",
    "Quote file paths and line numbers exactly, so that the user can open them from your answer.",
]
_TOPICS = [
    "editing Python modules", "writing tests", "reading build logs", "reviewing a pull request",
    "working with git", "refactoring a package", "fixing a flaky test", "updating documentation",
    "profiling a slow path", "handling configuration", "working in a monorepo", "database migrations",
]
_TOOL_VERBS = ["read", "write", "list", "search", "run", "open", "close", "create", "delete", "move", "diff", "fetch"]
_TOOL_NOUNS = ["file", "directory", "symbol", "test", "process", "branch", "commit", "issue", "page", "note", "task", "log"]


def agent_system_prompt(sections: int) -> str:
    """A coding agent's system prompt: an introduction and ``sections`` numbered sections of rules."""
    out = [
        "You are a coding agent working in the user's repository through the tools listed below. "
        "You answer in plain text, you call tools to read and change files, and you keep going "
        "until the task is done or you need the user's decision."
    ]
    for i in range(sections):
        topic = _TOPICS[i % len(_TOPICS)]
        out.append(f"\n## {i + 1}. When {topic} (part {i // len(_TOPICS) + 1})")
        for j in range(len(_RULES)):
            out.append(f"- {i + 1}.{j + 1} {_RULES[(i + j) % len(_RULES)]}")
    return "\n".join(out)


def tool_schemas(n: int) -> list[dict[str, Any]]:
    """``n`` tools in Anthropic's shape (``name``, ``description``, ``input_schema``)."""
    tools = []
    for i in range(n):
        verb, noun = _TOOL_VERBS[i % len(_TOOL_VERBS)], _TOOL_NOUNS[(i // len(_TOOL_VERBS)) % len(_TOOL_NOUNS)]
        name = f"{verb}_{noun}" + (f"_{i // 144 + 1}" if i >= 144 else "")
        tools.append({
            "name": name,
            "description": f"{verb.capitalize()} a {noun} in the workspace. Returns the result as text, "
            f"or an error that says what went wrong and how to fix the call.",
            "input_schema": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "description": f"The {noun}'s path, relative to the repository root."},
                    "recursive": {"type": "boolean", "description": "Whether to descend into sub-folders.", "default": False},
                    "limit": {"type": "integer", "description": "At most this many results.", "minimum": 1, "maximum": 1000},
                    "pattern": {"type": "string", "description": "A glob or regular expression to filter by."},
                    "encoding": {"type": "string", "enum": ["utf-8", "latin-1", "binary"], "description": "How to read bytes."},
                },
                "required": ["path"],
            },
        })
    return tools


def tools_as_text(tools: list[dict[str, Any]]) -> str:
    """Tool definitions as an agent writes them into the system prompt of a model without tool support."""
    return "\n\n# Tools\nCall a tool by answering with one JSON object {\"tool\": NAME, \"input\": {...}}.\n" + "\n".join(
        json.dumps(t) for t in tools
    )


def chat_history(turns: int, first_word: str = "Question") -> list[dict[str, str]]:
    """A long user/assistant conversation about code, ``turns`` exchanges, ending with a user turn."""
    messages = []
    for i in range(turns):
        topic = _TOPICS[i % len(_TOPICS)]
        messages.append({"role": "user", "content": f"{first_word} {i + 1}: how should I go about {topic}? "
                         + " ".join(_RULES[(i + k) % len(_RULES)] for k in range(3))})
        messages.append({"role": "assistant", "content": f"For {topic}: " + " ".join(_RULES[(i + k + 3) % len(_RULES)] for k in range(3))})
    messages.append({"role": "user", "content": "Summarise the advice above in one sentence."})
    return messages


def filler(n_items: int) -> str:
    return " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog near file_{i}.py." for i in range(n_items))


# -- the server -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and its live children (llama-server), from /proc."""
    total = 0.0
    tick = os.sysconf("SC_CLK_TCK")
    pids = [pid]
    try:
        pids += [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        pass
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


class Server:
    """``python -m trioshed serve --demo-model`` on a free port with a fresh store; log to a file."""

    def __init__(self, store: Path, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRIOSHED_")}
        env |= {"TRIOSHED_MODELS": str(store), "TRIOSHED_HOST": f"127.0.0.1:{self.port}"}
        self._out = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trioshed", "serve", "--demo-model"], env=env, stdout=self._out, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"trioshed exited: {log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/api/version", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("trioshed did not answer in 120 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()

    def loads(self) -> tuple[float, float]:
        """Loads started and their summed seconds to ready, from /metrics."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        n = re.search(r"^trioshed_loads_total (\S+)", text, re.M)
        s = re.findall(r"^trioshed_load_duration_seconds_sum\{[^}]*\} (\S+)", text, re.M)
        return (float(n.group(1)) if n else 0.0, sum(map(float, s)))

    def ps(self) -> list[int]:
        return [m["context_length"] for m in httpx.get(self.url + "/api/ps", timeout=10).json()["models"]]

    def log_loads(self) -> list[str]:
        """The scheduler's load, evict, unload and ready lines of trioshed's log."""
        return [line.strip() for line in self.log.read_text(errors="replace").splitlines() if _LIFECYCLE.search(line)]

    def tokens(self, text: str) -> int:
        r = httpx.post(self.url + "/tokenize", json={"model": MODEL, "content": text, "add_special": True, "parse_special": True}, timeout=120)
        r.raise_for_status()
        return len(r.json()["tokens"])


_LIFECYCLE = re.compile(r"trioshed\.scheduler\.scheduler: (loading|ready|evict|unloaded) ")


def swaps(lines: list[str]) -> list[dict[str, Any]]:
    """Each load in the log's lifecycle lines: its context, seconds from ``loading`` to ``ready``,
    and from the eviction that made room for it (the swap, unload included) to ``ready``."""
    out: list[dict[str, Any]] = []
    evicted = loading = None
    context = 0
    for line in lines:
        at = dt.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        what = _LIFECYCLE.search(line)
        kind = what.group(1) if what else ""
        if kind == "evict":
            evicted = at
        elif kind == "loading":
            loading, context = at, int(re.search(r"context (\d+)", line).group(1))  # type: ignore[union-attr]
        elif kind == "ready" and loading is not None:
            out.append({"context": context, "load_s": round(at - loading, 3), "swap_s": round(at - (evicted or loading), 3)})
            evicted = loading = None
    return out


# -- the clients ------------------------------------------------------------------------------


def short_ttft(url: str) -> float:
    """Seconds to the first streamed /api/generate line of a short request (8 tokens out)."""
    body = {"model": MODEL, "prompt": SHORT, "options": {"num_predict": 8, "temperature": 0, "seed": 1}}
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/api/generate", json=body, timeout=1800) as resp:
        resp.raise_for_status()
        first = None
        for line in resp.iter_lines():
            if line and first is None:
                first = time.perf_counter() - t0
    assert first is not None
    return round(first, 3)


def with_shorts(url: str, gap: float, long: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``long`` while a short request is asked every ``gap`` seconds (one at a time) until it returns."""
    during: list[tuple[float, float]] = []
    done = threading.Event()
    t0 = time.perf_counter()

    def shorts() -> None:
        while not done.wait(gap):
            asked = time.perf_counter() - t0
            during.append((round(asked, 1), short_ttft(url)))

    th = threading.Thread(target=shorts)
    th.start()
    try:
        out = long()
    finally:
        done.set()
        th.join()
    out["short_during"] = during
    return out


def run_ollama(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    import ollama

    client = ollama.Client(host=url, timeout=1800)
    t0 = time.perf_counter()
    first = None
    last: Any = None
    text = ""
    for part in client.chat(model=MODEL, messages=messages, stream=True, options={"num_predict": 8, "temperature": 0, "seed": 1}):
        if first is None:
            first = time.perf_counter() - t0
        text += part.message.content or ""
        last = part
    total = time.perf_counter() - t0
    return {
        "ttft_s": round(first or 0.0, 3), "total_s": round(total, 3), "answer": text,
        "usage_prompt_tokens": last.prompt_eval_count, "load_s": round((last.load_duration or 0) / 1e9, 3),
        "prompt_eval_s": round((last.prompt_eval_duration or 0) / 1e9, 3),
    }


def run_openai(url: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=1800, max_retries=0)
    t0 = time.perf_counter()
    first = None
    usage = None
    prompt_ms = None
    text = ""
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, seed=1, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    )
    for chunk in stream:
        if first is None:
            first = time.perf_counter() - t0
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
        if isinstance(extra := (chunk.model_extra or {}).get("timings"), dict) and "prompt_ms" in extra:
            prompt_ms = extra["prompt_ms"]  # llama-server's own, passed through on the last chunk
    assert usage is not None
    return {"ttft_s": round(first or 0.0, 3), "total_s": round(time.perf_counter() - t0, 3), "answer": text,
            "usage_prompt_tokens": usage.prompt_tokens, **({"prompt_eval_s": round(prompt_ms / 1000, 3)} if prompt_ms else {})}


def run_anthropic(url: str, system: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    import anthropic

    client = anthropic.Anthropic(base_url=url, api_key="unused", timeout=1800, max_retries=0)
    t0 = time.perf_counter()
    first = first_event = None
    text = ""
    start: Any = None
    end: Any = None
    stream = client.messages.create(model=MODEL, system=system, messages=messages, max_tokens=8, stream=True,  # type: ignore[arg-type]
                                    extra_body={"temperature": 0})
    for event in stream:
        if event.type == "message_start":  # sent before the prompt is read: not the first token
            first_event = time.perf_counter() - t0
            start = event.message.usage
        elif event.type == "content_block_delta" and event.delta.type == "text_delta":
            if first is None:
                first = time.perf_counter() - t0
            text += event.delta.text
        elif event.type == "message_delta":
            end = event.usage
    u = end if end is not None and end.input_tokens is not None else start
    cached = u.cache_read_input_tokens or 0
    return {"ttft_s": round(first or 0.0, 3), "total_s": round(time.perf_counter() - t0, 3), "answer": text,
            "first_event_s": round(first_event or 0.0, 3),
            "usage_prompt_tokens": u.input_tokens + cached, "usage_input_tokens": u.input_tokens,
            "usage_cache_read_input_tokens": cached}


def over_limit(url: str, text: str) -> dict[str, Any]:
    """The same over-long prompt through each SDK: each must raise its protocol's 400."""
    import anthropic
    import ollama
    import openai

    out: dict[str, Any] = {}
    messages = [{"role": "user", "content": text}]
    t0 = time.perf_counter()
    try:
        openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=600, max_retries=0).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        out["openai"] = {"error": None}
    except openai.BadRequestError as exc:
        err = (exc.body or {}) if isinstance(exc.body, dict) else {}
        out["openai"] = {"status": exc.status_code, "code": err.get("code"), "message": err.get("message")}
    out["openai"]["seconds"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    try:
        anthropic.Anthropic(base_url=url, api_key="unused", timeout=600, max_retries=0).messages.create(
            model=MODEL, messages=messages, max_tokens=8)  # type: ignore[arg-type]
        out["anthropic"] = {"error": None}
    except anthropic.BadRequestError as exc:
        body = exc.body if isinstance(exc.body, dict) else {}
        e = body.get("error") or {}
        out["anthropic"] = {"status": exc.status_code, "type": e.get("type"), "message": e.get("message")}
    out["anthropic"]["seconds"] = round(time.perf_counter() - t0, 3)
    t0 = time.perf_counter()
    try:
        ollama.Client(host=url, timeout=600).chat(model=MODEL, messages=messages, options={"num_predict": 8})
        out["ollama"] = {"error": None}
    except ollama.ResponseError as exc:
        out["ollama"] = {"status": exc.status_code, "message": exc.error}
    out["ollama"]["seconds"] = round(time.perf_counter() - t0, 3)
    return out


def tools_refused(url: str, system: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    import anthropic

    t0 = time.perf_counter()
    try:
        anthropic.Anthropic(base_url=url, api_key="unused", timeout=600, max_retries=0).messages.create(
            model=MODEL, system=system, tools=tools, max_tokens=8,  # type: ignore[arg-type]
            messages=[{"role": "user", "content": "List the files in src/."}])
        return {"error": None}
    except anthropic.BadRequestError as exc:
        e = (exc.body or {}).get("error", {}) if isinstance(exc.body, dict) else {}
        return {"status": exc.status_code, "message": e.get("message"), "seconds": round(time.perf_counter() - t0, 3)}


# -- sizing -----------------------------------------------------------------------------------


def grow_to(target: int, build: Callable[[int], str], count: Callable[[str], int], start: int = 1) -> tuple[int, int]:
    """The smallest ``n`` (doubling, then bisecting) whose ``build(n)`` has at least ``target`` tokens."""
    lo, hi = start, start
    while count(build(hi)) < target:
        lo, hi = hi, hi * 2
    while lo < hi:
        mid = (lo + hi) // 2
        if count(build(mid)) < target:
            lo = mid + 1
        else:
            hi = mid
    return hi, count(build(hi))


def transcript(messages: list[dict[str, str]]) -> str:
    from trioshed.api.protocols.transcript import transcript_prompt

    return transcript_prompt(messages)  # type: ignore[arg-type]


# -- the run ----------------------------------------------------------------------------------


def one_run(server: Server, args: argparse.Namespace) -> dict[str, Any]:
    url = server.url
    r: dict[str, Any] = {}
    r["short_cold_load"] = short_ttft(url)
    r["short_before"] = [short_ttft(url) for _ in range(args.rounds)]
    r["context_start"] = server.ps()

    # prompts, sized with the model's tokenizer (on the 4,096 runner: /tokenize is no chat)
    n_tools = args.tools
    tools = tool_schemas(n_tools)
    tools_text = tools_as_text(tools)
    task = [{"role": "user", "content": "The test tests/test_cli.py::test_serve fails with a timeout. Find out why."}]

    def agent_prompt(sections: int) -> str:
        return agent_system_prompt(sections) + tools_text

    sections, _ = grow_to(args.anthropic, lambda n: transcript([{"role": "system", "content": agent_prompt(n)}, *task]), server.tokens)
    system = agent_prompt(sections)
    openai_turns, _ = grow_to(args.openai, lambda n: transcript(chat_history(n)), server.tokens)
    ollama_turns, _ = grow_to(args.ollama, lambda n: transcript(chat_history(n, "Topic")), server.tokens)
    over_items, _ = grow_to(args.over, lambda n: transcript([{"role": "user", "content": filler(n)}]), server.tokens, start=512)
    anthropic_messages = [{"role": "system", "content": system}, *task]
    prompts = {
        "anthropic": (anthropic_messages, server.tokens(transcript(anthropic_messages))),
        "openai": (chat_history(openai_turns), server.tokens(transcript(chat_history(openai_turns)))),
        "ollama": (chat_history(ollama_turns, "Topic"), server.tokens(transcript(chat_history(ollama_turns, "Topic")))),
    }
    over_text = filler(over_items)
    r["prompt_tokens"] = {k: v[1] for k, v in prompts.items()}
    r["prompt_bytes"] = {k: len(transcript(v[0]).encode()) for k, v in prompts.items()}
    r["tools"] = {"count": n_tools, "tokens": server.tokens(tools_text), "system_tokens": server.tokens(system)}
    r["over_tokens"] = server.tokens(transcript([{"role": "user", "content": over_text}]))
    r["over_bytes"] = len(over_text.encode())
    print(json.dumps({"sized": r}), file=sys.stderr, flush=True)

    # 40,000 tokens: each protocol's 400, no load
    loads0, log0 = server.loads(), len(server.log_loads())
    r["over"] = over_limit(url, over_text)
    r["over_tools"] = tools_refused(url, system, tools)
    r["over_loads_added"] = server.loads()[0] - loads0[0]
    r["over_log_loads_added"] = len(server.log_loads()) - log0
    r["context_after_over"] = server.ps()
    print(json.dumps({"over": r["over"], "tools": r["over_tools"]}), file=sys.stderr, flush=True)

    # the long requests, each growing the runner one bucket, short requests around them
    runs: dict[str, Any] = {}
    for name, call in (
        ("ollama", lambda: run_ollama(url, prompts["ollama"][0])),
        ("openai", lambda: run_openai(url, prompts["openai"][0])),
        ("anthropic", lambda: run_anthropic(url, system, task)),
    ):
        before = server.loads()
        out = with_shorts(url, args.gap, call)
        after = server.loads()
        out["loads"] = after[0] - before[0]
        out["load_s"] = round(after[1] - before[1], 3) if "load_s" not in out else out["load_s"]
        out["context_after"] = server.ps()
        out["prompt_tokens"] = prompts[name][1]
        out["usage_matches"] = out["usage_prompt_tokens"] == prompts[name][1]
        runs[name] = out
        print(json.dumps({name: out}), file=sys.stderr, flush=True)
    r["long"] = runs
    r["short_after"] = [short_ttft(url) for _ in range(args.rounds)]
    if args.baseline:  # the Ollama chat again on the grown runner: the same work, no resize
        loads0 = server.loads()
        base = run_ollama(url, chat_history(ollama_turns, "Subject"))
        base["loads"] = server.loads()[0] - loads0[0]
        base["prompt_tokens"] = server.tokens(transcript(chat_history(ollama_turns, "Subject")))
        r["baseline_ollama_on_grown"] = base
        print(json.dumps({"baseline": base}), file=sys.stderr, flush=True)
    r["context_end"] = server.ps()
    r["log_loads"] = server.log_loads()
    return r


def write_results(r: dict[str, Any], args: argparse.Namespace, argv: list[str]) -> Path:
    day = dt.date.today().isoformat()
    md = RESULTS / f"{day}-context-clients.md"
    (RESULTS / f"{day}-context-clients.json").write_text(json.dumps(r, indent=1) + "\n")
    lines = [
        "# Long prompts through the official clients on default settings (Gemma 3 270M)",
        "",
        f"`{' '.join(['python -m bench.context_clients', *map(shlex.quote, argv)])}`, {day}, {os.cpu_count()} cores, "
        f"load average {r['loadavg_1m_before_after'][0]} before, {r['loadavg_1m_before_after'][1]} after; "
        f"trioshed and its llama-server children used {r['server_tree_cpu_s']} CPU seconds; {r['seconds']} s in all.",
        "",
        "| request | prompt tokens (/tokenize) | usage the SDK reported | equal | context before → after | TTFT s "
        "| prompt read s (llama-server) | resize cost s (TTFT - read) | swap s (log: evict → ready) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    loads = swaps(r["log_loads"])
    rate, ctx = None, r["context_after_over"]
    for name, label in (("ollama", "Ollama chat"), ("openai", "OpenAI chat"), ("anthropic", "Anthropic agent turn")):
        x = r["long"][name]
        read, est = x.get("prompt_eval_s"), ""
        if read:
            rate = x["prompt_tokens"] / read
        elif rate:
            read, est = round(x["prompt_tokens"] / rate, 1), " (est.)"
        ttft = x["ttft_s"] if x.get("ttft_s") is not None else f"≤ {x['total_s']} (answer done)"
        if x.get("ttft_s") is None:
            read, est = "-", ""
        cost = round(x["ttft_s"] - read, 1) if read and x.get("ttft_s") is not None else None
        swap = [w["swap_s"] for w in loads if x["context_after"] and w["context"] == x["context_after"][0] and ctx != x["context_after"]]
        lines.append(
            f"| {label} (`{name}` SDK) | {x['prompt_tokens']:,} | {x['usage_prompt_tokens']:,} | {'yes' if x['usage_matches'] else '**no**'} "
            f"| {ctx} → {x['context_after']} | {ttft} | {read}{est} | {'-' if cost is None else cost}{est} | {', '.join(map(str, swap)) or '-'} |"
        )
        ctx = x["context_after"]
    if b := r.get("baseline_ollama_on_grown"):
        lines.append(
            f"| the Ollama chat again on the grown runner | {b['prompt_tokens']:,} | {b['usage_prompt_tokens']:,} | "
            f"{'yes' if b['usage_prompt_tokens'] == b['prompt_tokens'] else '**no**'} | {r['context_end']} | {b['ttft_s']} "
            f"| {b['prompt_eval_s']} | {round(b['ttft_s'] - b['prompt_eval_s'], 1)} | - |"
        )
    lines += ["", "(est.): read at the previous request's rate; the Anthropic stream does not carry llama-server's timings."]
    if r.get("note"):
        lines += ["", f"Note: {r['note']}"]
    lines += [
        "",
        f"The agent turn: a system prompt of {r['tools']['system_tokens']:,} tokens, {r['tools']['tokens']:,} of them "
        f"{r['tools']['count']} tools' JSON schemas.",
        "",
        f"## {r['over_tokens']:,}-token prompt ({r['over_bytes']:,} bytes), the runner at {r['context_start']}",
        "",
        "| client | status | error | seconds |",
        "|---|---|---|---|",
    ]
    for name, e in r["over"].items():
        lines.append(f"| `{name}` | {e.get('status')} | {e.get('code') or e.get('type') or ''} `{e.get('message')}` | {e.get('seconds')} |")
    t = r["over_tools"]
    lines += [
        f"| `anthropic`, `tools=[...]` (agent turn) | {t.get('status')} | `{t.get('message')}` | {t.get('seconds')} |",
        "",
        f"Loads they caused: {r['over_loads_added']:.0f} (`/metrics`), {r['over_log_loads_added']} lifecycle lines in the log; "
        f"`/api/ps` after them: {r['context_after_over']}.",
        "",
        "## Short requests (seconds to first token, streamed `/api/generate`)",
        "",
        f"- cold load at the first bucket: {r['short_cold_load']}",
        f"- before: {', '.join(map(str, r['short_before']))}",
    ]
    for name in ("ollama", "openai", "anthropic"):
        d = r["long"][name]["short_during"]
        lines.append(f"- during the {name} request (asked at s → TTFT s): " + (", ".join(f"{a} → {b}" for a, b in d) or "none"))
    lines += [f"- after: {', '.join(map(str, r['short_after']))}", "", "## Loads (trioshed's log)", ""]
    lines += [f"    {line[:160]}" for line in r["log_loads"]]
    md.write_text("\n".join(lines) + "\n")
    return md


def main(argv: list[str] | None = None) -> int:
    from bench.models import write_gemma

    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python -m bench.context_clients", description=__doc__.splitlines()[0])
    p.add_argument("--anthropic", type=int, default=20000, help="tokens of the Anthropic agent turn")
    p.add_argument("--openai", type=int, default=12000, help="tokens of the OpenAI chat")
    p.add_argument("--ollama", type=int, default=6000, help="tokens of the Ollama chat")
    p.add_argument("--over", type=int, default=40000, help="tokens of the prompt that must be refused")
    p.add_argument("--tools", type=int, default=40, help="tools whose JSON schemas the agent's system prompt holds")
    p.add_argument("--rounds", type=int, default=3, help="short requests before and after")
    p.add_argument("--gap", type=float, default=2.0, help="seconds between short requests during a long one")
    p.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the Ollama chat on the grown runner")
    p.add_argument("--no-write", dest="write", action="store_false", help="print the JSON only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="trioshed-context-clients-") as tmp:
        store = Path(tmp) / "models"
        write_gemma(store / f"{MODEL}.gguf")
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        server = Server(store, Path(tmp) / "trioshed.log")
        try:
            r = one_run(server, args)
            r["server_tree_cpu_s"] = round(tree_cpu(server.proc.pid), 1)
        finally:
            server.close()
        r["seconds"] = round(time.perf_counter() - t0, 1)
        r["loadavg_1m_before_after"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(json.dumps(r, indent=1))
    if args.write:
        print(f"wrote {write_results(r, args, argv)}", file=sys.stderr)
    failed = [k for k, v in r["long"].items() if not v["usage_matches"]]
    failed += [k for k, v in r["over"].items() if v.get("status") != 400]
    return 1 if failed or r["over_loads_added"] else 0


if __name__ == "__main__":
    sys.exit(main())
