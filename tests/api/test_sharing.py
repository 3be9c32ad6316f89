"""Sharing a box: roles by route, model access, token budgets (trioshed.keys, trioshed.access,
trioshed.usage.ledger), the usage database's faults with real SQLite files and locks, and end to
end with real llama-server children: usage rows equal the answers' usage, a user key sees only
its models and cannot administer, a budget refuses once crossed."""

from __future__ import annotations

import json
import logging
import os
import signal
import sqlite3
import subprocess
from contextlib import closing
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
import trio

from trioshed import access
from trioshed.keys import ApiKey, keyring, load_keys_file
from trioshed.testing.server import open_test_server
from trioshed.usage.db import UsageDB
from trioshed.usage.ledger import DAY, Ledger, Spend
from trioshed.usage.recorder import UsageRecorder

KEYS = """
[[key]]
name = "boss"
key = "boss-secret-1"
role = "admin"

[[key]]
name = "ann"
key = "ann-secret-1"
models = ["tiny*"]
"""


def test_roles_models_and_budgets_are_read_from_the_keys_file(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS + 'tokens_per_day = 100\ncompletion_tokens_per_minute = 7\n')
    boss, ann = load_keys_file(path)
    assert boss.admin and boss.models == () and boss.may_use("anything")
    assert not ann.admin and ann.models == ("tiny*",)
    assert ann.may_use("tiny:latest") and ann.may_use("tiny") and not ann.may_use("secret:latest")
    assert [(f, limit) for f, _, _, limit in ann.budgets()] == [("tokens_per_day", 100), ("completion_tokens_per_minute", 7)]
    assert keyring("env-key-333", None).keys[0].admin  # TRIOSHED_API_KEY: an admin key


@pytest.mark.parametrize(
    ("entry", "line", "message"),
    [
        ('models = ["tiny["]', 5, "bad model pattern 'tiny\\['"),
        ('models = ["a]b"]', 5, "without '\\['"),
        ('models = []', 5, "models must be a list"),
        ("tokens_per_day = -5", 5, "tokens_per_day must be a whole number"),
        ('role = "root"', 5, 'role must be "user" or "admin"'),
        ("budget = 3", 5, "unknown field budget"),
    ],
)
def test_a_bad_keys_file_names_the_line(tmp_path: Path, entry: str, line: int, message: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'# team keys\n[[key]]\nname = "a"\nkey = "12345678"\n{entry}\n')
    with pytest.raises(ValueError, match=f"keys file {path} line {line}: key #1.*{message}"):
        keyring(None, path)


def test_the_role_table_makes_every_unlisted_route_admin() -> None:
    user = [("POST", "/api/chat"), ("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("POST", "/api/embed"),
            ("POST", "/v1/rerank"), ("POST", "/api/show"), ("GET", "/api/tags"), ("HEAD", "/api/tags"),
            ("GET", "/v1/models/user/m:tag"), ("GET", "/api/usage"), ("GET", "/api/ps"), ("POST", "/infill"),
            ("POST", "/tokenize"), ("POST", "/apply-template")]
    admin = [("POST", "/api/pull"), ("DELETE", "/api/delete"), ("POST", "/api/copy"), ("POST", "/api/create"),
             ("POST", "/api/push"), ("POST", "/api/blobs/sha256:00"), ("HEAD", "/api/blobs/sha256:00"),
             ("POST", "/api/pin"), ("GET", "/metrics"), ("GET", "/upstream/tiny/health"), ("POST", "/upstream/tiny/x"),
             ("POST", "/api/some-new-writer"), ("PUT", "/api/tags"), ("GET", "/v1/models/")]
    assert [access.route_role(m, p) for m, p in user] == ["user"] * len(user)
    assert [access.route_role(m, p) for m, p in admin] == ["admin"] * len(admin)


def test_a_budget_refuses_exactly_once_crossed() -> None:
    key = ApiKey("ann", "12345678", tokens_per_minute=100, completion_tokens_per_day=500)
    ledger, t0 = Ledger(), 10 * DAY + 100.0
    ledger.spend(Spend("ann", "m", t0, prompt=60, completion=39))
    assert ledger.refusal(key, t0 + 1) is None  # 99 < 100
    ledger.spend(Spend("ann", "m", t0 + 10, prompt=1))
    assert ledger.refusal(key, t0 + 11) == ("tokens per minute", 100, 49)  # the first spend leaves at t0+60
    assert ledger.refusal(key, t0 + 60) is None and ledger.left(key, t0 + 60)["tokens_per_minute"] == 99
    ledger.spend(Spend("ann", "m", t0 + 70, completion=461))
    assert ledger.refusal(key, t0 + 200) == ("completion tokens per day", 500, int(DAY - 300))
    assert ledger.refusal(key, 11 * DAY) is None  # a new day
    assert ledger.refusal(ApiKey("bob", "12345678"), t0) is None


def test_concurrent_requests_overspend_by_at_most_those_running() -> None:
    key = ApiKey("ann", "12345678", tokens_per_day=100)
    ledger, now = Ledger(), 5 * DAY
    admitted = [ledger.refusal(key, now) is None for _ in range(3)]  # three start together
    for _ in range(3):
        ledger.spend(Spend("ann", "m", now, prompt=40, completion=10))
    assert admitted == [True] * 3 and ledger.refusal(key, now) is not None  # 150: the next waits


# -- the usage database: real files, locks and faults ------------------------------------------------


def spends(n: int, key: str = "ann", when: float = 20 * DAY + 3600.5) -> list[Spend]:
    return [Spend(key, "tiny:latest", when + i, prompt=10, cached=4, completion=5, error=i == 0, seconds=0.25) for i in range(n)]


def test_the_database_sums_per_day_and_hour(tmp_path: Path) -> None:
    db = UsageDB(tmp_path / "usage.db")
    db.write(spends(3), 20 * DAY + 4000)
    db.write(spends(2, key="bob"), 20 * DAY + 4000)
    (row,) = db.query(by="day", key="ann")
    assert row == {"key": "ann", "model": "tiny:latest", "node": "", "start": 20 * DAY, "requests": 3, "prompt_tokens": 30,
                   "cached_tokens": 12, "completion_tokens": 15, "errors": 1, "seconds": 0.75}
    assert [r["start"] for r in db.query(by="hour")] == [20 * DAY + 3600] * 2
    assert db.query(since=21 * DAY) == [] and len(db.query(until=21 * DAY)) == 2
    assert sorted(db.today(20 * DAY + 5000)) == [("ann", 30, 15), ("bob", 20, 10)]
    db.close()
    with closing(sqlite3.connect(tmp_path / "usage.db")) as check:  # its own `with` only commits
        assert check.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def read_only(path: Path, on: bool) -> None:
    """Make a file or folder read-only for real, also for root (who ignores the mode bits: the
    immutable attribute instead)."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i" if on else "-i", str(path)], check=True)
    else:
        path.chmod((0o555 if path.is_dir() else 0o444) if on else 0o755)


def test_hourly_rows_older_than_two_weeks_go_and_daily_rows_stay(tmp_path: Path) -> None:
    db = UsageDB(tmp_path / "usage.db")
    db.write(spends(2, when=1 * DAY), 1 * DAY + 10)
    db.write(spends(1, when=20 * DAY), 20 * DAY + 10)  # 19 days later: the first hour goes
    assert [r["start"] for r in db.query(by="hour")] == [20 * DAY]
    assert [(r["start"], r["requests"]) for r in db.query(by="day")] == [(1 * DAY, 2), (20 * DAY, 1)]
    db.close()


async def _flush_fails(recorder: UsageRecorder, caplog: pytest.LogCaptureFixture, problem: str) -> None:
    await recorder.flush()
    assert recorder.problem == problem and len(recorder.pending) == 3, recorder.problem
    assert problem in caplog.text


@pytest.mark.parametrize("fault", ["read-only", "locked", "corrupt"])
async def test_a_broken_database_keeps_usage_in_memory_then_writes_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    caplog.set_level(logging.ERROR, "trioshed.usage.recorder")
    path = tmp_path / "usage.db"
    first = UsageDB(path)
    first.write(spends(1, key="old"), 0)  # a database with a row in it
    first.close()
    holder = None
    if fault == "read-only":
        read_only(path, True)
        problem = "cannot be written (read-only file or folder)"
    elif fault == "locked":
        holder = sqlite3.connect(path, isolation_level=None)
        holder.execute("BEGIN EXCLUSIVE")
        problem = "is locked by another program"
    else:
        path.write_bytes(b"this is not a database, just bytes " * 200)
        for suffix in ("-wal", "-shm"):
            Path(f"{path}{suffix}").unlink(missing_ok=True)  # noqa: ASYNC240
        problem = "is corrupt; move the file away and trioshed starts a new one"
    recorder = UsageRecorder(path, interval=3600)
    for s in spends(3):
        recorder.record(s)
    await _flush_fails(recorder, caplog, problem)
    assert recorder.ledger.today("ann", 20 * DAY + 10) == (30, 15)  # budgets still count
    if fault == "read-only":
        read_only(path, False)
    elif holder is not None:
        holder.execute("ROLLBACK")
        holder.close()
    else:
        path.unlink()
    await recorder.flush()
    assert recorder.problem == "" and recorder.pending == [] and recorder.written == 3
    rows = await recorder.query(by="day", key="ann")
    assert [(r["requests"], r["prompt_tokens"]) for r in rows] == [(3, 30)]
    assert recorder.db is not None
    recorder.db.close()  # run() would close it at its end; this test drives flush() alone


async def test_past_the_bound_rows_are_dropped_and_counted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "ro" / "usage.db"
    path.parent.mkdir()
    read_only(path.parent, True)  # the file cannot even be created
    try:
        recorder = UsageRecorder(path, bound=2, interval=3600)
        for s in spends(5):
            recorder.record(s)
        await recorder.flush()
        assert len(recorder.pending) == 2 and recorder.dropped == 3
        assert "dropping usage rows" in caplog.text
    finally:
        read_only(path.parent, False)


# -- end to end ----------------------------------------------------------------------------------------

FAST = {"num_predict": 6, "temperature": 0, "seed": 1}
BOSS = {"Authorization": "Bearer boss-secret-1"}
ANN = {"Authorization": "Bearer ann-secret-1"}


async def in_thread(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return await trio.to_thread.run_sync(lambda: fn(*args, **kwargs))


@pytest.fixture
def shared_store(model_store: Path, tiny_model: Path) -> Path:
    os.link(tiny_model, model_store / "secret.gguf")
    return model_store


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_a_user_key_sees_only_its_models_and_cannot_administer(shared_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    with trio.fail_after(120):
        async with open_test_server(shared_store, keys_file=keys) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                names = lambda r: sorted(m["name"] for m in r.json()["models"])  # noqa: E731
                assert names(await http.get("/api/tags", headers=BOSS)) == ["secret:latest", "tiny:latest"]
                assert names(await http.get("/api/tags", headers=ANN)) == ["tiny:latest"]
                assert [m["id"] for m in (await http.get("/v1/models", headers=ANN)).json()["data"]] == ["tiny"]
                # another key's model is the same 404 as no model at all, in every protocol
                for method, path, body in [
                    ("POST", "/api/generate", {"model": "{m}", "prompt": "hi", "stream": False}),
                    ("POST", "/api/show", {"model": "{m}"}),
                    ("POST", "/v1/chat/completions", {"model": "{m}", "messages": [{"role": "user", "content": "hi"}]}),
                    ("POST", "/v1/messages", {"model": "{m}", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
                    ("POST", "/api/embed", {"model": "{m}", "input": "hi"}),
                    ("GET", "/v1/models/{m}", None),
                ]:
                    answers = []
                    for model in ("secret", "nosuch"):
                        fill = {k: (v.format(m=model) if k == "model" else v) for k, v in (body or {}).items()}
                        r = await http.request(method, path.format(m=model), json=fill if body else None, headers=ANN)
                        answers.append((r.status_code, r.text.replace(model, "M")))
                    assert answers[0] == answers[1] and answers[0][0] == 404, (path, answers)
                # a user key cannot pull, delete, pin, unload, nor read /metrics: 403 in the route's shape
                r = await http.request("DELETE", "/api/delete", json={"model": "tiny"}, headers=ANN)
                assert r.status_code == 403 and "needs an admin key" in r.json()["error"]
                for path, body in [("/api/pull", {"model": "x"}), ("/api/pin", {"model": "tiny"})]:
                    r = await http.post(path, json=body, headers=ANN)
                    assert r.status_code == 403 and "needs an admin key" in r.json()["error"], path
                assert (await http.get("/metrics", headers=ANN)).status_code == 403
                r = await http.post("/api/generate", json={"model": "tiny", "keep_alive": 0}, headers=ANN)
                assert r.status_code == 403 and "may not unload a model" in r.json()["error"]
                r = await http.post("/v1/chat/completions", headers=ANN, json={"model": "tiny", "keep_alive": 0,
                                    "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
                assert r.status_code == 403 and "may not unload a model" in r.json()["error"]["message"]  # OpenAI's shape
                # the admin loads the other model: the user's /api/ps does not show it
                r = await http.post("/api/generate", json={"model": "secret", "prompt": "hi", "options": FAST, "stream": False}, headers=BOSS)
                assert r.status_code == 200
                assert [m["name"] for m in (await http.get("/api/ps", headers=BOSS)).json()["models"]] == ["secret:latest"]
                assert (await http.get("/api/ps", headers=ANN)).json()["models"] == []
                # the status page's stream: the user's own models, no log; the admin's: all, usage per key
                logging.getLogger("trioshed.test").warning("a line of the log tail")
                ann = await first_messages(http, ANN)
                assert ann["hello"]["models"] == ["tiny:latest"] and "log" not in ann
                assert ann["state"]["runners"] == [] and [m["name"] for m in ann["models"]["models"]] == ["tiny:latest"]
                assert [u["key"] for u in ann["state"]["usage"]] == ["ann"]
                boss = await first_messages(http, BOSS, "log")
                assert boss["hello"]["models"] == ["secret:latest", "tiny:latest"]
                assert [r["model"] for r in boss["state"]["runners"]] == ["secret:latest"]
                assert {u["key"] for u in boss["state"]["usage"]} == {"boss", "ann"}
                assert (await http.post("/api/generate", json={"model": "secret", "keep_alive": 0}, headers=BOSS)).status_code == 200
                assert (await http.request("DELETE", "/api/delete", json={"model": "secret"}, headers=BOSS)).status_code == 200
                assert names(await http.get("/api/tags", headers=BOSS)) == ["tiny:latest"]


async def first_messages(http: httpx.AsyncClient, headers: dict[str, str], *more: str) -> dict[str, Any]:
    """The status page stream's first message of each kind, until hello, state, models (and ``more``)."""
    wanted, seen = {"hello", "state", "models", *more}, {}
    with trio.fail_after(20):
        async with http.stream("GET", "/api/events", headers=headers) as response:
            buffer = ""
            async for text in response.aiter_text():
                buffer += text
                while "\n\n" in buffer:
                    block, buffer = buffer.split("\n\n", 1)
                    if not block.startswith(":"):
                        fields = dict(line.split(": ", 1) for line in block.split("\n"))
                        seen.setdefault(fields["event"], json.loads(fields["data"]))
                if wanted <= set(seen):
                    return seen
    raise AssertionError(f"the stream ended with {sorted(seen)}")


async def _use_every_protocol(base: str) -> tuple[int, int, int]:
    """One answer per protocol and mode as ann; (requests, prompt, completion) they reported."""
    client = ollama.Client(host=base, headers=ANN)
    oai = openai.OpenAI(base_url=f"{base}/v1", api_key="ann-secret-1")
    ant = anthropic.Anthropic(base_url=base, api_key="ann-secret-1")
    seen: list[tuple[int, int]] = []
    r = await in_thread(client.generate, model="tiny", prompt="hello", options=FAST, stream=False)
    seen.append((r.prompt_eval_count, r.eval_count))
    chunks = await in_thread(lambda: list(client.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options=FAST, stream=True)))
    seen.append((chunks[-1].prompt_eval_count, chunks[-1].eval_count))
    c = await in_thread(oai.chat.completions.create, model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    seen.append((c.usage.prompt_tokens, c.usage.completion_tokens))
    s = await in_thread(lambda: list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}], max_tokens=5,
                                                                 temperature=0, stream=True, stream_options={"include_usage": True})))
    seen.append((s[-1].usage.prompt_tokens, s[-1].usage.completion_tokens))
    # the same stream without include_usage: counted from llama-server's timings, the same tokens
    await in_thread(lambda: list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "yo"}], max_tokens=5,
                                                             temperature=0, stream=True)))
    seen.append(seen[-1])
    m = await in_thread(ant.messages.create, model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hey"}])
    seen.append((m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0), m.usage.output_tokens))

    def stream_anthropic() -> tuple[int, int]:
        with ant.messages.stream(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hey you"}]) as st:
            final = st.get_final_message()
        return final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0), final.usage.output_tokens

    seen.append(await in_thread(stream_anthropic))
    return len(seen), sum(p for p, _ in seen), sum(c for _, c in seen)


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_usage_rows_equal_the_answers_usage_and_survive_a_restart(shared_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    db = tmp_path / "usage.db"
    with trio.fail_after(180):
        async with open_test_server(shared_store, keys_file=keys, usage_db=db) as server:
            requests, prompt, completion = await _use_every_protocol(server.base_url)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                (row,) = (await http.get("/api/usage", headers=ANN)).json()["usage"]
                assert (row["key"], row["model"], row["requests"], row["prompt_tokens"], row["completion_tokens"], row["errors"]) == (
                    "ann", "tiny:latest", requests, prompt, completion, 0)
                assert row["seconds"] > 0 and prompt > 0 and completion > 0
                assert (await http.get("/api/usage", params={"key": "boss"}, headers=ANN)).status_code == 403
                admin = (await http.get("/api/usage", headers=BOSS)).json()
                assert {k["key"]: k["prompt_tokens_today"] for k in admin["keys"]} == {"boss": 0, "ann": prompt}
        async with open_test_server(shared_store, keys_file=keys, usage_db=db) as server:  # after a clean stop
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                csv = (await http.get("/api/usage", params={"format": "csv", "by": "hour"}, headers=BOSS)).text
                header, line = csv.strip().split("\n")
                assert header.startswith("key,model,start,requests,prompt_tokens")
                assert line.split(",")[:5] == ["ann", "tiny:latest", line.split(",")[2], str(requests), str(prompt)]


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_a_token_budget_refuses_once_crossed(model_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    body = {"model": "tiny", "prompt": "hello", "options": FAST, "stream": False}
    with trio.fail_after(120):
        keys.write_text(KEYS)
        async with open_test_server(model_store, keys_file=keys, usage=False) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                r = (await http.post("/api/generate", json=body, headers=BOSS)).json()
        spent = r["prompt_eval_count"] + r["eval_count"]  # what one such request costs (greedy, same prompt)
        keys.write_text(KEYS + f"tokens_per_day = {2 * spent + 1}\n")
        async with open_test_server(model_store, keys_file=keys, usage=False) as server:
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
                codes = [(await http.post("/api/generate", json=body, headers=ANN)).status_code for _ in range(3)]
                assert codes == [200, 200, 200]  # 2*spent < limit: the third may start
                r = await http.post("/api/generate", json=body, headers=ANN)
                assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
                assert r.json()["error"].startswith(f"API key 'ann' reached its limit of {2 * spent + 1} tokens per day")
                r = await http.post("/v1/chat/completions", headers=ANN, json={"model": "tiny", "messages": [{"role": "user", "content": "x"}]})
                assert r.status_code == 429 and "tokens per day" in r.json()["error"]["message"]
                assert (await http.get("/api/tags", headers=ANN)).status_code == 200  # listing spends nothing
                assert (await http.post("/api/generate", json=body, headers=BOSS)).status_code == 200


@pytest.mark.slow
@pytest.mark.usefixtures("no_leaked_runner")
async def test_usage_survives_sigkill_and_a_bad_keys_reload_keeps_the_old_keys(model_store: Path, tmp_path: Path) -> None:
    from tests.support.serve_process import serve_process

    keys = tmp_path / "keys.toml"
    keys.write_text(KEYS)
    db = tmp_path / "usage.db"
    body = {"model": "tiny", "prompt": "hello", "options": FAST, "stream": False}
    with trio.fail_after(120):
        async with serve_process(model_store, TRIOSHED_KEYS_FILE=str(keys), TRIOSHED_USAGE_DB=str(db)) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                r = (await http.post("/api/generate", json=body, headers=ANN)).json()
                keys.write_text(KEYS + "tokens_per_day = -1\n")
                served.process.send_signal(signal.SIGHUP)
                while "keys file not reloaded" not in served.log():  # noqa: ASYNC110  (a child's log file)
                    await trio.sleep(0.05)
                assert f"keys file {keys} line 11: key #2 (ann): tokens_per_day must be a whole number" in served.log()
                assert (await http.get("/api/tags", headers=ANN)).status_code == 200  # the old keys stay
                await trio.sleep(1.5)  # the writer's second has passed: the row is on disk
                served.process.send_signal(signal.SIGKILL)
                await served.wait_exit()
        keys.write_text(KEYS)
        async with serve_process(model_store, TRIOSHED_KEYS_FILE=str(keys), TRIOSHED_USAGE_DB=str(db)) as served:
            async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                (row,) = (await http.get("/api/usage", headers=ANN)).json()["usage"]
                assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (1, r["prompt_eval_count"], r["eval_count"])


def test_the_usage_database_lies_beside_the_first_models_folder_named_after_it(tmp_path: Path) -> None:
    from trioshed.config import Settings

    assert Settings(models=tmp_path / "models").usage_path == tmp_path / "models.usage.db"
    assert Settings(models=tmp_path / "other").usage_path == tmp_path / "other.usage.db"  # a sibling store: its own
    assert Settings(models=f"{tmp_path}/a/models:{tmp_path}/b/models").usage_path == tmp_path / "a" / "models.usage.db"  # type: ignore[arg-type]
    assert Settings(models=tmp_path / "models", usage_db=tmp_path / "u.db").usage_path == tmp_path / "u.db"
