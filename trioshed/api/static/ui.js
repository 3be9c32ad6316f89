// trioshed status page. One server-sent-events stream (GET /api/events), read with fetch so that
// the API key can travel as a header (EventSource cannot send one). Everything shown is built
// with textContent: nothing from the server is parsed as HTML.
"use strict";

const KEY_STORAGE = "trioshed.apiKey";
const HEARTBEAT_GRACE_MS = 40000; // the server sends something at least every 15 s
const RETRY_MIN_MS = 250, RETRY_MAX_MS = 5000;
const MAX_EVENTS = 200, MAX_LOG = 500;

const $ = (id) => document.getElementById(id);
const ui = {
  instance: null,       // the server process the lists below came from
  state: null,          // the last "state" message
  events: [],           // newest last
  log: [],
  clockOffset: 0,       // server time - local time, seconds
  messages: 0,
  pending: false,       // an action is in flight
};
window.trioshedUI = ui; // for the browser test and for curious operators

// ---------- formatting ----------

function bytes(n) {
  if (n === null || n === undefined) return "–";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i === 0 ? n.toFixed(0) : n.toFixed(n < 10 ? 2 : 1)) + " " + units[i];
}

function duration(s) {
  if (s === null || s === undefined) return "forever";
  s = Math.max(0, Math.round(s));
  if (s < 60) return s + " s";
  if (s < 3600) return Math.floor(s / 60) + " m " + String(s % 60).padStart(2, "0") + " s";
  return Math.floor(s / 3600) + " h " + String(Math.floor(s % 3600 / 60)).padStart(2, "0") + " m";
}

function serverNow() { return Date.now() / 1000 + ui.clockOffset; }

function clock(t) {
  const d = new Date(t * 1000);
  return d.toLocaleTimeString([], { hour12: false }) + "." + String(d.getMilliseconds()).padStart(3, "0").slice(0, 1);
}

function hue(name) {
  let h = 0;
  for (const c of name) h = (h * 31 + c.codePointAt(0)) >>> 0;
  return h % 360;
}

function colour(name) { return `hsl(${hue(name)} 55% 55%)`; }

function el(tag, props, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "class") node.className = v;
    else if (k === "dataset") Object.assign(node.dataset, v);
    else if (k === "style") Object.assign(node.style, v);
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) if (c !== null && c !== undefined) node.append(c);
  return node;
}

// ---------- rendering ----------

function renderDevices(devices) {
  const box = el("div", { class: "devices" });
  for (const d of devices) {
    const bar = el("div", { class: "bar", role: "img" });
    const legend = el("div", { class: "legend" });
    const pct = (n) => (d.total > 0 ? (100 * n / d.total) : 0) + "%";
    let ours = 0;
    for (const r of d.runners) {
      ours += r.bytes;
      bar.append(el("span", { class: "runner", title: `${r.model}: ${bytes(r.bytes)}`, style: { width: pct(r.bytes), background: colour(r.model) } }));
      legend.append(el("span", {}, el("span", { class: "swatch", style: { background: colour(r.model) } }), `${r.model} ${bytes(r.bytes)}`));
    }
    if (d.reserved > 0) {
      bar.append(el("span", { class: "reserved", title: `reserved ${bytes(d.reserved)}`, style: { width: pct(d.reserved) } }));
      legend.append(el("span", {}, el("span", { class: "swatch reserved" }), `reserved ${bytes(d.reserved)}`));
    }
    let free = d.free;
    if (free !== null && free !== undefined) {
      const other = Math.max(0, d.total - free - ours - d.reserved);
      if (other > 0) {
        bar.append(el("span", { class: "other", title: `used by others ${bytes(other)}`, style: { width: pct(other) } }));
        legend.append(el("span", {}, el("span", { class: "swatch other" }), `other processes ${bytes(other)}`));
      }
    } else {
      free = Math.max(0, d.total - ours - d.reserved); // by trioshed's accounting
    }
    legend.append(el("span", {}, `free ${bytes(free)}`));
    bar.setAttribute("aria-label", `${d.name}: ${bytes(ours)} used by runners, ${bytes(free)} free of ${bytes(d.total)}`);
    const status = d.up === false ? `down: ${d.reason}` : `${bytes(d.total)}`;
    box.append(el("div", { class: "device" + (d.up === false ? " down" : ""), dataset: { device: d.id } },
      el("div", { class: "title" }, el("strong", {}, `${d.name}`), el("span", { class: "muted" }, `${d.id} · ${status}`)),
      bar, legend));
  }
  $("devices").replaceChildren(box);
}

function runnerRow(r) {
  const size = r.measured !== null && r.measured !== undefined
    ? `${bytes(r.measured)} measured / ${bytes(r.estimated)} est.`
    : `${bytes(r.estimated)} est.`;
  const state = r.evicting && r.state === "ready" ? "ready, leaving" : r.state;
  const phase = r.state !== "ready" ? "–" : r.leases > 0 ? "in use" : ""; // counts down only while idle
  const keep = el("td", { class: "keep-alive num", dataset: { expires: r.expires_at === null ? "" : String(r.expires_at), phase } });
  const row = el("tr", { dataset: { model: r.model, state: r.state } },
    el("td", {}, el("span", { class: "swatch", style: { background: colour(r.model) } }), r.model),
    el("td", { class: "state state-" + r.state }, state),
    el("td", { class: "num" }, `${r.leases} / ${r.slots}` + (r.waiting ? ` (+${r.waiting} waiting)` : "")),
    keep,
    el("td", { class: "num" }, size),
    el("td", {}, r.devices.length ? r.devices.join(", ") : "cpu"),
    el("td", { class: "pinned" }, r.pinned ? "pinned" : "no"),
    el("td", {},
      el("button", { type: "button", class: "unload", onclick: () => act("unload", r.model) }, "Unload"), " ",
      el("button", { type: "button", class: "pin", onclick: () => act(r.pinned ? "unpin" : "pin", r.model) }, r.pinned ? "Unpin" : "Pin")));
  return row;
}

function renderRunners(runners) {
  $("runners").tBodies[0].replaceChildren(...runners.map(runnerRow));
  $("no-runners").hidden = runners.length > 0;
  $("runners").hidden = runners.length === 0;
  tick();
}

function renderQueue(queue) {
  const rows = queue.map((q) => el("tr", { dataset: { model: q.model } },
    el("td", {}, q.model), el("td", { class: "key" }, q.key || "–"), el("td", { class: "num" }, String(q.waiting)),
    el("td", { class: "num oldest", dataset: { since: String(q.since) } }, "")));
  $("queue").tBodies[0].replaceChildren(...rows);
  $("queue").classList.toggle("no-keys", !queue.some((q) => q.key)); // one API key or none: no column
  $("no-queue").hidden = queue.length > 0;
  $("queue").hidden = queue.length === 0;
  tick();
}

function renderModels(models) {
  $("model-names").replaceChildren(...models.map((m) => el("option", { value: m })));
}

const EVENT_WORDS = { load: "load", ready: "ready", evict: "evict", unload: "unload", crash: "crash", "load-failed": "load failed", refused: "refused" };

function eventItem(e) {
  const words = [e.model, e.reason, e.detail].filter((w) => w).join(" — ");
  return el("li", { dataset: { kind: e.kind, model: e.model || "", seq: String(e.seq) } },
    el("time", { datetime: new Date(e.time * 1000).toISOString() }, clock(e.time)),
    el("span", { class: "kind kind-" + e.kind }, EVENT_WORDS[e.kind] || e.kind),
    el("span", { class: "detail", title: words }, words.length > 240 ? words.slice(0, 240) + "…" : words));
}

function addEvents(list, gap) {
  const box = $("events");
  if (gap) box.prepend(el("li", { class: "gap muted" }, "… earlier events were dropped while this page was behind"));
  for (const e of list) {
    const last = ui.events[ui.events.length - 1];
    if (e.kind === "refused" && last && last.kind === "refused" && last.model === e.model && last.reason === e.reason && last.status === e.status) {
      ui.events[ui.events.length - 1] = e; // the server folded a flood of the same refusal into one
      box.firstElementChild.replaceWith(eventItem(e));
      continue;
    }
    ui.events.push(e);
    box.prepend(eventItem(e));
  }
  while (ui.events.length > MAX_EVENTS) { ui.events.shift(); box.lastElementChild.remove(); }
}

function addLog(lines) {
  const box = $("log");
  const atBottom = box.scrollTop + box.clientHeight >= box.scrollHeight - 4;
  for (const l of lines) {
    ui.log.push(l);
    box.append(el("span", { class: l.level }, `${clock(l.time)} ${l.level} ${l.logger}: ${l.message}\n`));
  }
  while (ui.log.length > MAX_LOG) { ui.log.shift(); box.firstChild.remove(); }
  if (atBottom) box.scrollTop = box.scrollHeight;
}

// Countdowns move every second from the last message; nothing is fetched for them.
function tick() {
  const now = serverNow();
  for (const td of document.querySelectorAll("#runners td.keep-alive")) {
    if (td.dataset.phase) td.textContent = td.dataset.expires === "" && td.dataset.phase === "in use" ? "forever" : td.dataset.phase;
    else td.textContent = td.dataset.expires === "" ? "forever" : duration(Number(td.dataset.expires) - now);
  }
  for (const td of document.querySelectorAll("#queue td.oldest")) td.textContent = duration(now - Number(td.dataset.since));
}
setInterval(tick, 1000);

// ---------- the stream ----------

function setStream(state, text) {
  document.body.dataset.stream = state;
  $("stream").textContent = text;
}

function handle(type, data) {
  ui.messages++;
  document.body.dataset.messages = String(ui.messages);
  if (type === "hello") {
    ui.clockOffset = data.time - Date.now() / 1000;
    if (ui.instance !== data.instance) { // a new server process: its lists start afresh
      ui.instance = data.instance;
      ui.events = []; ui.log = [];
      $("events").replaceChildren(); $("log").replaceChildren();
    }
    document.body.dataset.instance = data.instance;
    renderModels(data.models);
    document.title = `trioshed ${data.version}`;
    return;
  }
  if (type === "state") {
    ui.state = data;
    ui.clockOffset = data.time - Date.now() / 1000;
    renderDevices(data.devices);
    renderRunners(data.runners);
    renderQueue(data.queue);
    $("updated").textContent = "updated " + clock(data.time);
  } else if (type === "events") {
    const seen = ui.events.length ? ui.events[ui.events.length - 1].seq : 0;
    addEvents(data.events.filter((e) => e.seq > seen), data.gap);
  } else if (type === "log") {
    const seen = ui.log.length ? ui.log[ui.log.length - 1].seq : 0;
    addLog(data.lines.filter((l) => l.seq > seen));
  }
}

function headers(extra) {
  const h = Object.assign({}, extra);
  const key = sessionStorage.getItem(KEY_STORAGE);
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function readStream(response, controller) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  let watchdog = setTimeout(() => controller.abort(), HEARTBEAT_GRACE_MS);
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      clearTimeout(watchdog);
      watchdog = setTimeout(() => controller.abort(), HEARTBEAT_GRACE_MS);
      buffer += value.replace(/\r\n/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        let type = "message", data = "";
        for (const line of block.split("\n")) {
          if (line.startsWith(":")) continue; // a comment: the heartbeat
          const colon = line.indexOf(":");
          const field = colon < 0 ? line : line.slice(0, colon);
          const val = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
          if (field === "event") type = val;
          else if (field === "data") data += (data ? "\n" : "") + val;
        }
        if (data) handle(type, JSON.parse(data));
        if (type === "hello" || type === "state") setStream("live", "live");
      }
    }
  } finally {
    clearTimeout(watchdog);
  }
}

async function connect() {
  let delay = RETRY_MIN_MS;
  for (;;) {
    const controller = new AbortController();
    try {
      const response = await fetch("/api/events", { headers: headers({ Accept: "text/event-stream" }), cache: "no-store", signal: controller.signal });
      if (response.status === 401) {
        sessionStorage.removeItem(KEY_STORAGE);
        setStream("key", "API key needed");
        $("key-form").hidden = false;
        $("key-input").focus();
        await new Promise((resolve) => { ui.keyEntered = resolve; });
        continue;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      delay = RETRY_MIN_MS;
      await readStream(response, controller);
    } catch (err) {
      // the server restarts, the network drops, or the watchdog aborted: try again below
    }
    setStream("reconnecting", "reconnecting…");
    await new Promise((resolve) => setTimeout(resolve, delay));
    delay = Math.min(delay * 2, RETRY_MAX_MS);
  }
}

// ---------- actions: each one ordinary API call, confirmed first ----------

const ACTIONS = {
  load: { ask: (m) => `Load ${m}?`, path: "/api/generate", body: (m) => ({ model: m, stream: false }) },
  unload: { ask: (m) => `Unload ${m}? Requests being answered finish first.`, path: "/api/generate", body: (m) => ({ model: m, keep_alive: 0, stream: false }) },
  pin: { ask: (m) => `Pin ${m} until trioshed restarts? It will not be evicted to make room.`, path: "/api/pin", body: (m) => ({ model: m, pinned: true }) },
  unpin: { ask: (m) => `Unpin ${m}? It may then be evicted to make room.`, path: "/api/pin", body: (m) => ({ model: m, pinned: false }) },
};

function confirmDialog(text) {
  const dialog = $("confirm");
  $("confirm-text").textContent = text;
  return new Promise((resolve) => {
    const done = (ok) => () => { dialog.close(); $("confirm-ok").onclick = $("confirm-cancel").onclick = null; resolve(ok); };
    $("confirm-ok").onclick = done(true);
    $("confirm-cancel").onclick = done(false);
    dialog.oncancel = done(false);
    dialog.showModal();
  });
}

function showError(text) {
  const box = $("error");
  box.textContent = text;
  box.hidden = !text;
}

async function act(action, model) {
  const spec = ACTIONS[action];
  if (!model || ui.pending) return;
  if (!(await confirmDialog(spec.ask(model)))) return;
  ui.pending = true;
  document.body.dataset.action = "pending";
  showError("");
  for (const b of document.querySelectorAll("button")) if (!b.closest("dialog")) b.disabled = true;
  try {
    const response = await fetch(spec.path, {
      method: "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(spec.body(model)),
    });
    if (!response.ok) {
      let message = `HTTP ${response.status}`;
      try { const body = await response.json(); if (body.error) message = typeof body.error === "string" ? body.error : body.error.message; } catch (e) { /* not JSON */ }
      showError(`${action} ${model}: ${message}`);
      document.body.dataset.action = "failed";
    } else {
      await response.arrayBuffer();
      document.body.dataset.action = "done";
    }
  } catch (err) {
    showError(`${action} ${model}: ${err.message}`);
    document.body.dataset.action = "failed";
  } finally {
    ui.pending = false;
    for (const b of document.querySelectorAll("button")) b.disabled = false;
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("load-form").addEventListener("submit", (e) => { e.preventDefault(); act("load", $("load-model").value.trim()); });
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    sessionStorage.setItem(KEY_STORAGE, $("key-input").value);
    $("key-input").value = "";
    $("key-form").hidden = true;
    setStream("connecting", "connecting…");
    if (ui.keyEntered) ui.keyEntered();
  });
  connect();
});
