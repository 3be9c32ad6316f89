"""Speculative decoding against the real binary: at temperature 0 the tokens with n-gram
speculation are the tokens without, on every protocol, streamed or not, on the template path
(a model with a chat template) and the transcript path (Gemma 3 270M, a base model), and equal
to llama-server run alone; usage counts generated tokens, not drafted ones; drafted and accepted
tokens show in /api/ps and /metrics. A draft model is placed with its target and goes with it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from trioshed.runner.command import NGRAM
from trioshed.testing.llama import running_llama_server
from trioshed.testing.server import open_test_server
from trioshed.testing.tiny import write_tiny_model

CODE = '''def fits(est, device, overhead):
    """Whether a model fits on a device."""
    usable = max(0, device.free - overhead)
    return est.total <= usable


def place(est, devices, overhead=0):
    for device in devices:
        if fits(est, device, overhead):
            return device
    return None
'''
#: A base model continues a third copy of the code: n-gram drafting finds it in the prompt.
ASK = "# a.py\n" + CODE + "\n# b.py, a copy of a.py\n" + CODE + "\n# c.py, a copy of a.py\n"
N = 48
#: Structured output, where n-gram drafting pays (repeated keys) and, measured, the answer stays
#: the plain one: at temperature 0 a verification batch can flip a near-tie (see docs/models.md),
#: which happened on the code prompt under ``"ngram"`` after ~40 tokens.
JSON_ASK = ('Output a JSON array of ten users, each with "id", "name", "email", "age" and "city". '
            'Only the JSON.\n\n[\n  {"id": 1, "name": "Ann", "email": "ann@example.com", "age": 31, "city": "Oslo"},\n')
#: llama-server alone with trioshed's runner flags (flash attention on, as trioshed's automatic
#: choice and llama.cpp's own ``auto`` choose it on the CPU).
DIRECT_ARGS = ["-t", "1", "--device", "none", "-ngl", "0", "-c", "2048", "-np", "1", "--fit", "off",
               "--flash-attn", "on", "--batch-size", "512"]  # fmt: skip


async def in_thread(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


def _store(tmp_path: Path, model: Path, name: str = "models") -> Path:
    store = tmp_path / name
    store.mkdir()
    (store / "models.toml").write_text(
        f'[models.spec]\npath = {json.dumps(str(model))}\nspeculation = "ngram"\n\n'
        f'[models.plain]\npath = {json.dumps(str(model))}\nspeculation = "off"\n'
    )
    return store


async def _answers(base_url: str, model: str, prompt: str) -> dict[str, Any]:
    """The same requests on every protocol, in the same order (a runner's prompt cache changes
    how a prompt is batched, and with it the sums); text and generated-token counts."""
    out: dict[str, Any] = {}
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    comp = await in_thread(oai.completions.create, model=model, prompt=prompt, temperature=0, max_tokens=N)
    out["openai completions"] = (comp.choices[0].text, comp.usage.completion_tokens if comp.usage else None)
    ol = ollama.Client(host=base_url)
    opts = {"temperature": 0, "num_predict": N}
    raw = await in_thread(ol.generate, model=model, prompt=prompt, raw=True, options=opts)
    out["ollama raw"] = (raw.response, raw.eval_count)
    assert raw.eval_duration and raw.eval_duration > 0
    gen = await in_thread(ol.generate, model=model, prompt=prompt, options=opts)
    out["ollama generate"] = (gen.response, gen.eval_count)
    chunks = await in_thread(lambda: list(ol.chat(model=model, messages=[{"role": "user", "content": prompt}], options=opts, stream=True)))
    out["ollama chat stream"] = ("".join(c.message.content or "" for c in chunks), chunks[-1].eval_count)
    msgs = [{"role": "user", "content": prompt}]
    chat = await in_thread(oai.chat.completions.create, model=model, messages=msgs, temperature=0, max_tokens=N)
    out["openai chat"] = (chat.choices[0].message.content, chat.usage.completion_tokens if chat.usage else None)

    def streamed() -> tuple[str, int | None]:
        events = list(oai.chat.completions.create(model=model, messages=msgs, temperature=0, max_tokens=N, stream=True,
                                                  stream_options={"include_usage": True}))  # fmt: skip
        text = "".join((e.choices[0].delta.content or "") for e in events if e.choices)
        return text, events[-1].usage.completion_tokens if events[-1].usage else None

    out["openai chat stream"] = await in_thread(streamed)
    ant = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    msg = await in_thread(ant.messages.create, model=model, max_tokens=N, extra_body={"temperature": 0}, messages=msgs)
    out["anthropic"] = ("".join(b.text for b in msg.content if b.type == "text"), msg.usage.output_tokens)
    return out


async def _ps(base_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False) as http:
        return {m["name"]: m for m in (await http.get(f"{base_url}/api/ps")).json()["models"]}


async def _metric(base_url: str, name: str, model: str) -> float:
    async with httpx.AsyncClient(trust_env=False) as http:
        text = (await http.get(f"{base_url}/metrics")).text
    m = re.search(rf'^{name}\{{model="{re.escape(model)}"\}} (\S+)$', text, re.M)
    return float(m[1]) if m else -1.0


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_same_tokens_on_every_protocol_transcript_path(tmp_path: Path, gemma_model: Path) -> None:
    store = _store(tmp_path, gemma_model)
    with trio.fail_after(420):
        async with open_test_server(store, context_length=2048, num_parallel=1) as server:
            # First on the fresh runner, as on llama-server alone below (a runner's prompt cache
            # changes how a prompt is batched, and with it the sums).
            first = await in_thread(openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0).completions.create,
                                    model="spec", prompt=ASK, temperature=0, max_tokens=N)  # fmt: skip
            spec = await _answers(server.base_url, "spec", JSON_ASK)
            # Read before the plain model's load, which may evict this runner on a busy machine.
            ps = await _ps(server.base_url)
            stats = ps["spec:latest"]["runner"]["speculation_stats"]
            assert ps["spec:latest"]["runner"]["speculation"] == "ngram"
            assert stats["drafted"] > 0 and 0 < stats["accepted"] <= stats["drafted"]
            assert await _metric(server.base_url, "trioshed_speculative_drafted_tokens_total", "spec:latest") == stats["drafted"]
            assert await _metric(server.base_url, "trioshed_speculative_accepted_tokens_total", "spec:latest") == stats["accepted"]
            plain = await _answers(server.base_url, "plain", JSON_ASK)
            ps = await _ps(server.base_url)
            assert "speculation_stats" not in ps["plain:latest"]["runner"]
            assert ps["plain:latest"]["runner"]["speculation"] == "off"
            for route, (text, count) in spec.items():
                assert (text, count) == plain[route], route
                assert count is not None and 0 < count <= N, route
            # Usage counts generated tokens: an answer cut by the limit has exactly N.
            assert spec["ollama raw"][1] == N and spec["openai completions"][1] == N
            assert '"email": "' in spec["ollama raw"][0]  # more records: drafting pays
    # llama-server alone, no speculation: the same tokens as trioshed's speculating runner.
    # llama-server alone with the same n-gram flags: trioshed's first answer, token for token.
    with running_llama_server(gemma_model, [*DIRECT_ARGS, *NGRAM], timeout=120) as direct:
        async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
            body = {"prompt": ASK, "max_tokens": N, "temperature": 0}
            alone = (await http.post(f"{direct.url}/v1/completions", json=body)).json()
    assert alone["timings"]["draft_n"] > 0
    assert (alone["choices"][0]["text"], alone["usage"]["completion_tokens"]) == (first.choices[0].text, N)


#: Gemma 3 turns, sent raw. With trioshed's default kernels llama-server answers EDIT otherwise
#: with n-gram speculation than without, after ~115 tokens: a near-tie (two candidates within
#: 0.06-0.14 of log-probability in the checks behind docs/models.md) decided differently in a
#: verification batch. REPEAT is drafted and accepted.
EDIT = ("<start_of_turn>user\nRewrite this Python code with the function `fits` renamed to `fits_on`, "
        "and output the whole file:\n\n" + CODE + "<end_of_turn>\n<start_of_turn>model\n")  # fmt: skip
REPEAT = ("<start_of_turn>user\nRepeat this Python code exactly, nothing else:\n\n" + CODE
          + "<end_of_turn>\n<start_of_turn>model\n")  # fmt: skip
LONG = 160


async def _raw_answers(base_url: str, model: str) -> list[tuple[str, int | None]]:
    """EDIT and REPEAT on OpenAI's completions and Ollama's raw generate (streamed)."""
    oai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    ol = ollama.Client(host=base_url)
    opts = {"temperature": 0, "num_predict": LONG}
    out: list[tuple[str, int | None]] = []
    for prompt in (EDIT, REPEAT):
        comp = await in_thread(oai.completions.create, model=model, prompt=prompt, temperature=0, max_tokens=LONG)
        out.append((comp.choices[0].text, comp.usage.completion_tokens if comp.usage else None))
        chunks = await in_thread(lambda p=prompt: list(ol.generate(model=model, prompt=p, raw=True, stream=True, options=opts)))
        out.append(("".join(c.response for c in chunks), chunks[-1].eval_count))
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_batch_invariant_runners_answer_as_without_speculation(tmp_path: Path, gemma_model: Path) -> None:
    """TRIOSHED_BATCH_INVARIANT (flash attention, weights not repacked): a token checked in a
    verification batch gets the numbers it gets alone, so the answers with speculation are the
    answers without, token for token, where the default kernels differ."""

    def alone(args: list[str]) -> str:
        with running_llama_server(gemma_model, [*DIRECT_ARGS, *args], timeout=120) as direct:
            body = {"prompt": EDIT, "max_tokens": LONG, "temperature": 0}
            return str(httpx.post(f"{direct.url}/v1/completions", json=body, timeout=300).json()["choices"][0]["text"])

    # Precondition: with flash attention off (the kernels where this prompt shows it; with flash
    # attention on, the default on the CPU, its first token is already the end) the difference shows.
    off = ["--flash-attn", "off"]  # the last of a repeated flag counts
    assert await trio.to_thread.run_sync(alone, [*off, *NGRAM]) != await trio.to_thread.run_sync(alone, off)
    store = _store(tmp_path, gemma_model)
    with trio.fail_after(420):
        async with open_test_server(store, context_length=2048, num_parallel=1, batch_invariant=True) as server:
            spec = await _raw_answers(server.base_url, "spec")
            ps = await _ps(server.base_url)
            stats = ps["spec:latest"]["runner"]["speculation_stats"]
            assert stats["drafted"] > 0 and stats["accepted"] > 0
            plain = await _raw_answers(server.base_url, "plain")
    assert spec == plain
    assert all(count is not None and 0 < count <= LONG for _, count in spec)


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_same_tokens_on_the_template_path(tmp_path: Path) -> None:
    """A model with a chat template (a tiny random one, low end-of-sequence): the chat routes go
    through llama-server's template; speculation on or off, the same tokens."""
    model = write_tiny_model(tmp_path / "tiny.gguf", n_embd=64, n_layer=2, seed=11)
    store = _store(tmp_path, model)
    with trio.fail_after(240):
        async with open_test_server(store, context_length=1024, num_parallel=1) as server:
            spec = await _answers(server.base_url, "spec", ASK)
            plain = await _answers(server.base_url, "plain", ASK)
            assert spec == plain
            assert all(count is not None and count > 0 for _, count in spec.values())


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["tiny", "gemma3"])
def test_draft_estimate_matches_llama_cpp(pair: str, tmp_path: Path, gemma_model: Path) -> None:
    """A target with its draft model, measured by llama-server b10068 itself (every buffer of
    both models, CPU): the estimate is within the bounds single models are held to (never more
    than 5 % under, at most 10 % or 2 MiB over)."""
    from trioshed.core.estimate import estimate
    from trioshed.core.model import RunnerOptions
    from trioshed.models.gguf_meta import read_metadata
    from trioshed.testing.llama import measure_load

    if pair == "tiny":
        target = write_tiny_model(tmp_path / "t.gguf", n_embd=256, n_layer=6, n_head=8, seed=3)
        draft = write_tiny_model(tmp_path / "d.gguf", n_embd=64, n_layer=2, seed=1)
    else:
        target = draft = gemma_model
    opts = RunnerOptions(num_ctx=2048, num_parallel=2, num_thread=1, draft=str(draft))
    args = ["--fit", "off", "-ngl", "0", "-t", "1", "--device", "none", "-c", str(opts.kv_cells), "-np", "2",
            "-fa", "off", "--model-draft", str(draft), "--spec-type", "draft-simple", "--spec-draft-ngl", "0",
            "--device-draft", "none"]  # fmt: skip
    report = measure_load(target, args, timeout=180)
    real = report.memory
    assert real is not None and "loading draft model" in report.log
    alone = measure_load(target, args[: args.index("--model-draft")], timeout=180).memory
    assert alone is not None and real.total > alone.total  # the draft's buffers were counted
    est = estimate(read_metadata(target), opts, draft=read_metadata(draft))
    detail = f"est {est.cpu_total}, llama.cpp {real.total} ({real})"
    assert 0.95 * real.total <= est.cpu_total <= max(1.10 * real.total, real.total + 2 * 1024**2), detail


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_a_draft_pair_is_placed_shown_and_evicted_together(tmp_path: Path, gemma_model: Path) -> None:
    """Gemma drafting for itself (the mechanism; any same-vocabulary pair works alike) through
    trioshed: one child with --model-draft, /api/ps's size the child's own buffers of both
    models and its estimate within the single-model bounds, the same tokens as without, and
    an eviction that takes both; a draft of another vocabulary is a clear error."""
    import psutil

    store = tmp_path / "models"
    store.mkdir()
    write_tiny_model(store / "tiny.gguf")
    g = json.dumps(str(gemma_model))
    (store / "models.toml").write_text(
        f'[models.gemma]\npath = {g}\nspeculation = "off"\n\n[models.drafted]\npath = {g}\ndraft = "gemma"\n\n'
        f'[models.mismatched]\npath = {g}\ndraft = "tiny"\n'
    )
    with trio.fail_after(420):
        async with (
            open_test_server(store, context_length=2048, num_parallel=1, max_loaded_models=1) as server,
            httpx.AsyncClient(base_url=server.base_url, timeout=300) as http,
        ):
            body = {"model": "drafted", "prompt": ASK, "max_tokens": N, "temperature": 0}
            drafted = (await http.post("/v1/completions", json=body)).json()
            (runner,) = server.scheduler.statistics().runners
            assert runner.pid is not None
            argv = psutil.Process(runner.pid).cmdline()
            assert argv[argv.index("--model-draft") + 1] == str(gemma_model)
            assert argv[argv.index("--spec-type") + 1] == "draft-simple"
            (ps,) = (await http.get("/api/ps")).json()["models"]
            assert ps["runner"]["speculation"] == "draft" and ps["runner"]["draft"] == "gemma:latest"
            assert ps["runner"]["speculation_stats"]["drafted"] > 0
            measured = runner.measured
            assert measured is not None and ps["runner"]["size_source"] == "measured"
            assert ps["size"] == measured.total  # both models' buffers (cache_ram apart)
            assert measured.weights >= 2 * 235 * 1024**2  # two copies of the weights: both counted
            real = measured.total
            assert 0.95 * real <= runner.estimate.cpu_total - runner.estimate.prompt_cache <= 1.10 * real
            plain = (await http.post("/v1/completions", json={**body, "model": "gemma"})).json()
            # A draft model's verification batches can flip a near-tie at temperature 0 (here at
            # token ~40: llama.cpp's own behaviour, compared with the binary alone below); the
            # usage counts generated tokens either way.
            assert drafted["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == N
            # Evicted together: one process, gone with its draft.
            assert not psutil.pid_exists(runner.pid) or psutil.Process(runner.pid).status() == psutil.STATUS_ZOMBIE
            (ps,) = (await http.get("/api/ps")).json()["models"]
            assert ps["name"] == "gemma:latest" and "draft" not in ps["runner"]
            bad = await http.post("/v1/completions", json={**body, "model": "mismatched"})
            assert bad.status_code == 500
            message = bad.json()["error"]["message"]
            assert "draft model 'tiny:latest' cannot draft for it" in message and "BOS token differs" in message
            assert str(store) not in message
    # llama-server alone with the same draft flags: trioshed's answer, token for token.
    draft_args = ["--model-draft", str(gemma_model), "--spec-type", "draft-simple", "--spec-draft-ngl", "0",
                  "--device-draft", "none"]  # fmt: skip
    with running_llama_server(gemma_model, [*DIRECT_ARGS, *draft_args], timeout=120) as direct:
        async with httpx.AsyncClient(trust_env=False, timeout=300) as http:
            alone = (await http.post(f"{direct.url}/v1/completions", json={**body, "model": "x"})).json()
    assert alone["choices"][0]["text"] == drafted["choices"][0]["text"]
