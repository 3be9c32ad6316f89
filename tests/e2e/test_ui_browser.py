"""The status page in a real browser: headless Chromium (Debian's ``chromium``) against a real
trioshed with tiny models, driven over the DevTools protocol (:mod:`tests.e2e.browser`).

One session of an operator, in order: the page asks for the API key; a load through the page's
own button (confirmed) appears live; a request for another model evicts the first (at most one
loaded), and the eviction with its reason arrives live; a pin; an unknown model is a visible
error that changes nothing; trioshed restarts and the page reconnects by itself. Screenshots
(laptop and phone width) are written under the test's temporary folder. The page must not poll:
after it opened, its only requests are the one event stream per server and the actions.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
import trio

from tests.conftest import add_tiny
from tests.e2e.browser import Browser, find_chromium, open_browser
from tests.support.serve_process import serve_process
from trioshed.testing.llama import free_port

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("no_leaked_runner")]

KEY = "ui-browser-key-0123456789"


@pytest.fixture
def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("chromium is not installed (Debian: apt-get install chromium; .ci/run installs it): the status page's browser test cannot run")
    return path


def runner_rows(model: str = "") -> str:
    """A JavaScript expression: the runner table's rows (of ``model``)."""
    where = f'[data-model="{model}"]' if model else ""
    return f"[...document.querySelectorAll('#runners tbody tr{where}')]"


async def click(browser: Browser, selector: str) -> None:
    await browser.evaluate(f"document.querySelector({selector!r}).click()")


async def confirm(browser: Browser, expected: str) -> None:
    """Answer the page's confirmation dialog with OK, after checking what it asks."""
    text = await browser.wait_for("document.getElementById('confirm').open && document.getElementById('confirm-text').textContent")
    assert expected in text
    await click(browser, "#confirm-ok")


async def load_through_the_page(browser: Browser, model: str) -> None:
    await browser.evaluate(f"document.getElementById('load-model').value = {model!r}")
    await click(browser, "#load-button")
    await confirm(browser, f"Load {model}?")


async def the_newer_parts(browser: Browser, http: httpx.AsyncClient) -> None:
    """The last hour, recent requests, models in reach and the playground, after the session
    above (tiny loaded then evicted by other, broken failed, other pinned and loaded)."""
    # the last hour: the load and the eviction it caused are marks on the pictures, and the
    # memory picture of system memory holds other's runner and its prompt cache, named apart
    await browser.wait_for("""document.querySelector('#chart-tokens line[data-kind="load"][data-model="tiny:latest"]')
                              && document.querySelector('#chart-tokens line[data-kind="evict"][data-model="tiny:latest"]')
                              && document.querySelector('#chart-waiting line[data-kind="crash"][data-model="broken:latest"]')""")
    labels = await browser.wait_for("""(() => { const l = [...document.querySelectorAll('#chart-memory figure[data-device="cpu"] polygon')].map(p => p.dataset.label);
                                       return l.includes('other:latest') && l; })()""")
    assert "other:latest · prompt cache" in labels
    # the runner's memory on the page is /api/ps's, its prompt cache apart and named
    ps = (await http.get("/api/ps")).json()["models"][0]
    cell = await browser.evaluate("(() => { const c = document.querySelector('#runners tr[data-model=\"other:latest\"] td.size'); return [c.dataset.size, c.dataset.promptCache, c.textContent]; })()")
    assert [int(cell[0]), int(cell[1])] == [ps["size"], ps["runner"]["cache_ram"]] and "prompt cache" in cell[2]
    # recent requests: the generates, with their waits; the filter by model keeps only its rows
    await browser.wait_for("document.querySelectorAll('#activity tbody tr[data-model=\"other:latest\"]').length >= 2")
    rows = await browser.evaluate("[...document.querySelectorAll('#activity tbody tr')].map(r => [r.dataset.model, r.dataset.status])")
    assert "500" in [status for _, status in rows]  # the failed load, listed though it never got a runner
    assert ["other:latest", "200"] in rows
    await browser.evaluate("document.getElementById('activity-model').value = 'other:latest'; document.getElementById('activity-model').dispatchEvent(new Event('change'))")
    models = await browser.evaluate("[...new Set([...document.querySelectorAll('#activity tbody tr')].map(r => r.dataset.model))]")
    assert models == ["other:latest"]
    slow = await browser.evaluate("[...document.querySelectorAll('#activity tbody tr td.slow')].map(td => td.textContent)")
    assert any("for a load" in words for words in slow)
    # every model in reach, with whether it fits; the loaded one says so
    store = await browser.wait_for("""(() => { const r = [...document.querySelectorAll('#models tbody tr')].map(r => [r.dataset.model, r.dataset.loaded, r.querySelector('td.fit').textContent]);
                                      return r.length === 3 && r; })()""")
    assert [m for m, _, _ in store] == ["broken:latest", "other:latest", "tiny:latest"]
    assert dict((m, loaded) for m, loaded, _ in store)["other:latest"] == "yes"
    assert dict((m, fit) for m, _, fit in store)["tiny:latest"].startswith("fits")
    # delete asks twice; the second "cancel" keeps the model
    await click(browser, "#models tr[data-model='broken:latest'] button.delete")
    await confirm(browser, "Delete broken:latest")
    await browser.wait_for("document.getElementById('confirm').open && document.getElementById('confirm-text').textContent.startsWith('Really')")
    await click(browser, "#confirm-cancel")
    assert "broken:latest" in [m["name"] for m in (await http.get("/api/tags")).json()["models"]]
    await click(browser, "#models tr[data-model='broken:latest'] button.delete")
    await confirm(browser, "Delete broken:latest")
    await confirm(browser, "Really delete broken:latest")
    await browser.wait_for("document.body.dataset.action === 'done' && !document.querySelector('#models tr[data-model=\"broken:latest\"]')")
    assert "broken:latest" not in [m["name"] for m in (await http.get("/api/tags")).json()["models"]]
    # the playground: a streamed answer with its timings, kept for the session; then a stop
    await browser.evaluate("document.getElementById('play-model').value = 'other:latest'; document.getElementById('play-model').dispatchEvent(new Event('change'))")
    await browser.evaluate("document.getElementById('play-input').value = 'Hello there'; document.getElementById('play-form').requestSubmit()")
    await browser.wait_for("document.body.dataset.play === 'done'")
    turns = await browser.evaluate("[...document.querySelectorAll('#play-chat .turn')].map(t => [t.dataset.role, t.textContent])")
    assert turns[0] == ["user", "Hello there"] and turns[1][0] == "assistant" and turns[1][1]
    assert "first token" in await browser.evaluate("document.getElementById('play-timings').textContent")
    kept = await browser.evaluate("JSON.parse(sessionStorage.getItem('trioshed.playground'))['other:latest'].length")
    assert kept == 2
    await browser.evaluate("document.getElementById('play-input').value = 'And again'; document.getElementById('play-form').requestSubmit(); document.getElementById('play-stop').click()")
    await browser.wait_for("document.body.dataset.play === 'stopped'")
    await browser.wait_for("!document.getElementById('play-send').disabled")
    # the stopped request left nothing behind: no slot held, nothing queued
    await browser.wait_for("trioshedUI.state.runners.every(r => r.leases === 0) && trioshedUI.state.queue.length === 0")


def problems(browser: Browser) -> list[str]:
    """Page errors, less the network ones the test causes on purpose (401 before the key, the 404
    of the unknown model, refused connections while trioshed restarts)."""
    return [p for p in browser.problems() if "Failed to load resource" not in p and "net::ERR_" not in p]


async def test_status_page_in_chromium_shows_loads_and_evictions_live_and_survives_a_restart(
    chromium: str, model_store: Path, unknown_arch_model: Path, tmp_path: Path
) -> None:
    add_tiny(model_store, "other")
    os.link(unknown_arch_model, model_store / "broken.gguf")  # llama-server refuses it: a load failure
    port = free_port()
    # a declared GPU (accounting only: the runners really run on the CPU) to draw a GPU's bar too
    env = {"TRIOSHED_API_KEY": KEY, "TRIOSHED_MAX_LOADED_MODELS": "1", "TRIOSHED_CONTEXT_LENGTH": "256",
           "TRIOSHED_DEVICES": "cuda:0=64MiB", "TRIOSHED_GPU_OVERHEAD": "8MiB"}  # fmt: skip
    auth = {"Authorization": f"Bearer {KEY}"}
    with trio.fail_after(240):
        async with open_browser(chromium, tmp_path / "chromium.log") as browser:
            async with serve_process(model_store, port=port, **env) as served, httpx.AsyncClient(base_url=served.url, headers=auth, timeout=60) as http:
                await browser.navigate(f"{served.url}/ui")
                # the key: asked once, kept in the tab's sessionStorage, sent as a header
                await browser.wait_for("document.body.dataset.stream === 'key' && !document.getElementById('key-form').hidden")
                await browser.evaluate(f"document.getElementById('key-input').value = {KEY!r}")
                await browser.evaluate("document.getElementById('key-form').requestSubmit()")
                await browser.wait_for("document.body.dataset.stream === 'live' && document.querySelector('[data-device=\"cpu\"]')")
                assert await browser.evaluate("sessionStorage.getItem('trioshed.apiKey')") == KEY
                assert await browser.evaluate("document.getElementById('key-form').offsetParent") is None
                assert await browser.evaluate("[...document.querySelectorAll('#model-names option')].map(o => o.value)") == ["broken:latest", "other:latest", "tiny:latest"]
                first_instance = await browser.evaluate("document.body.dataset.instance")
                await browser.evaluate("window.notReloaded = true")  # gone if the page reloaded
                opened = len(browser.requests())

                # a load through the page's own button, confirmed: live in the runners and events
                await load_through_the_page(browser, "tiny")
                await browser.wait_for(f"{runner_rows('tiny:latest')}.some(r => r.dataset.state === 'ready')")
                await browser.wait_for("document.body.dataset.action === 'done'")
                kinds = await browser.wait_for("""(() => { const k = [...document.querySelectorAll('#events li[data-model="tiny:latest"]')].map(li => li.dataset.kind);
                                                  return k.includes('load') && k.includes('ready') && k; })()""")
                assert kinds.index("ready") < kinds.index("load")  # newest first
                row = await browser.evaluate(f"{runner_rows('tiny:latest')}[0].innerText")
                assert "est." in row and "measured" in row and "1 / 1" not in row  # slots: 0 in use after the load
                gpu = await browser.evaluate("""[...document.querySelectorAll('[data-device="cuda:0"] .bar > span')].map(s => [s.className, s.title])""")
                assert [c for c, _ in gpu] == ["runner", "reserved"] and gpu[0][1].startswith("tiny:latest: ") and gpu[1][1] == "reserved 8.00 MiB"
                bar = await browser.evaluate("document.querySelector('[data-device=\"cuda:0\"] .bar').getAttribute('aria-label')")
                assert bar.startswith("declared cuda:0: ") and "used by runners" in bar and "of 64.0 MiB" in bar

                # another model evicts it (at most one loaded): the eviction and its reason arrive live
                r = await http.post("/api/generate", json={"model": "other", "prompt": "hi", "options": {"num_predict": 2}, "stream": False})
                assert r.status_code == 200, r.text
                await browser.wait_for(f"{runner_rows('other:latest')}.some(r => r.dataset.state === 'ready') && {runner_rows('tiny:latest')}.length === 0")
                evict = await browser.wait_for("document.querySelector('#events li[data-kind=\"evict\"][data-model=\"tiny:latest\"]')?.innerText")
                assert "make room" in evict
                await browser.wait_for("document.querySelector('#events li[data-kind=\"unload\"][data-model=\"tiny:latest\"]')")
                await browser.wait_for("[...document.querySelectorAll('#log span')].some(s => s.textContent.includes('other'))")

                # a load that fails, then the 503 of its back-off: both arrive with their cause
                assert (await http.post("/api/generate", json={"model": "broken", "prompt": "x"})).status_code == 500
                assert (await http.post("/api/generate", json={"model": "broken", "prompt": "x"})).status_code == 503
                failed = await browser.wait_for("document.querySelector('#events li[data-kind=\"load-failed\"][data-model=\"broken:latest\"]')?.innerText")
                assert "llama-server" in failed
                refused = await browser.wait_for("document.querySelector('#events li[data-kind=\"refused\"][data-model=\"broken:latest\"]')?.innerText")
                assert "HTTP 503" in refused and "load_cooldown" in refused
                r = await http.post("/api/generate", json={"model": "other", "prompt": "hi", "options": {"num_predict": 2}, "stream": False})
                assert r.status_code == 200, r.text
                await browser.wait_for(f"{runner_rows('other:latest')}.some(r => r.dataset.state === 'ready')")

                # pin for the session, through the page
                await click(browser, "#runners tbody tr[data-model='other:latest'] button.pin")
                await confirm(browser, "Pin other:latest")
                await browser.wait_for(f"{runner_rows('other:latest')}[0]?.querySelector('.pinned').textContent === 'pinned'")
                ps = (await http.get("/api/ps")).json()["models"]
                assert [m["name"] for m in ps] == ["other:latest"]

                # an unknown model: a visible error, nothing changes
                await load_through_the_page(browser, "no-such-model")
                error = await browser.wait_for("!document.getElementById('error').hidden && document.getElementById('error').textContent")
                assert "no-such-model" in error and "not found" in error
                assert await browser.evaluate(f"{runner_rows()}.map(r => r.dataset.model)") == ["other:latest"]
                assert [m["name"] for m in (await http.get("/api/ps")).json()["models"]] == ["other:latest"]

                # live, not polled: the page is the one it was, it got many messages over one
                # stream, and its only requests since it opened are the two actions that posted
                assert await browser.evaluate("window.notReloaded") is True
                assert int(await browser.evaluate("document.body.dataset.messages")) >= 6
                later = browser.requests()[opened:]
                assert [u.removeprefix(served.url) for u in later] == ["/api/generate", "/api/pin", "/api/generate"], later

                await the_newer_parts(browser, http)

                (tmp_path / "ui.png").write_bytes(await browser.screenshot())
                await browser.resize(390, 844, mobile=True)
                await browser.wait_for("document.documentElement.clientWidth === 390")
                # a phone: nothing wider than the screen (tables scroll inside their boxes)
                assert await browser.evaluate("document.documentElement.scrollWidth") <= 390
                (tmp_path / "ui-phone.png").write_bytes(await browser.screenshot())
                await browser.resize(1280, 900)

                # trioshed restarts: the page says so, then reconnects by itself
                served.process.send_signal(signal.SIGTERM)
                assert await served.wait_exit() == 0
                await browser.wait_for("document.body.dataset.stream === 'reconnecting'")
            async with serve_process(model_store, port=port, **env):
                await browser.wait_for(f"document.body.dataset.stream === 'live' && document.body.dataset.instance !== {first_instance!r}")
                await browser.wait_for(f"{runner_rows()}.length === 0")  # the new process has nothing loaded
                assert await browser.evaluate("document.getElementById('key-form').offsetParent") is None  # not asked again
                assert await browser.evaluate("window.notReloaded") is True

            # nothing was fetched from anywhere else, and the page raised nothing (CSP included)
            assert all(u.startswith(served.url) for u in browser.requests()), browser.requests()
            assert problems(browser) == []


async def test_status_page_shows_each_keys_tokens_today_and_budget_left_to_an_admin(chromium: str, model_store: Path, tmp_path: Path) -> None:
    keys = tmp_path / "keys.toml"
    keys.write_text('[[key]]\nname = "ops"\nkey = "ops-secret-1"\nrole = "admin"\n\n'
                    '[[key]]\nname = "ann"\nkey = "ann-secret-1"\ntokens_per_day = 100000\n')  # fmt: skip
    with trio.fail_after(180):
        async with open_browser(chromium, tmp_path / "chromium.log") as browser:
            async with serve_process(model_store, TRIOSHED_KEYS_FILE=str(keys), TRIOSHED_USAGE_DB=str(tmp_path / "u.db")) as served:
                async with httpx.AsyncClient(base_url=served.url, timeout=60) as http:
                    r = await http.post("/api/generate", headers={"Authorization": "Bearer ann-secret-1"},
                                        json={"model": "tiny", "prompt": "hi", "options": {"num_predict": 3}, "stream": False})  # fmt: skip
                    spent = r.json()["prompt_eval_count"] + r.json()["eval_count"]
                await browser.navigate(f"{served.url}/ui")
                await browser.wait_for("document.body.dataset.stream === 'key' && !document.getElementById('key-form').hidden")
                await browser.evaluate("document.getElementById('key-input').value = 'ops-secret-1'")
                await browser.evaluate("document.getElementById('key-form').requestSubmit()")
                rows = await browser.wait_for("""(() => { const r = [...document.querySelectorAll('#keys tbody tr')].map(tr => tr.innerText.split('\\t'));
                                                 return r.length === 2 && !document.getElementById('keys-section').hidden && r; })()""")
                assert rows[0][:2] == ["ops", "admin"] and rows[1][:2] == ["ann", "user"]
                assert rows[1][4] == f"tokens per day: {100000 - spent} of 100000" and rows[0][4] == "no budget"
                assert [p for p in browser.problems() if "status of 401" not in p] == []  # the first try, before the key
                assert await browser.evaluate("document.getElementById('database').hidden")  # its database works: no banner


async def test_status_page_says_when_the_database_cannot_be_reached(chromium: str, model_store: Path, tmp_path: Path) -> None:
    unreachable = "postgresql://trioshed:db-secret-9@127.0.0.1:1/team"  # nothing listens there
    with trio.fail_after(120):
        async with open_browser(chromium, tmp_path / "chromium.log") as browser:
            async with serve_process(model_store, TRIOSHED_API_KEY=KEY, TRIOSHED_DATABASE=unreachable, TRIOSHED_NODE_NAME="gpu-1") as served:
                await browser.navigate(f"{served.url}/ui")
                await browser.wait_for("document.body.dataset.stream === 'key' && !document.getElementById('key-form').hidden")
                await browser.evaluate(f"document.getElementById('key-input').value = {KEY!r}")
                await browser.evaluate("document.getElementById('key-form').requestSubmit()")
                said = await browser.wait_for("!document.getElementById('database').hidden && document.getElementById('database').textContent")
                assert said.startswith("usage database postgresql://trioshed:***@127.0.0.1:1/team is unreachable (node gpu-1): serving continues")
                assert "db-secret-9" not in said and "db-secret-9" not in served.log()
