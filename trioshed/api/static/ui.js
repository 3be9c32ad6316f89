// trioshed status page. One server-sent-events stream (GET /api/events), read with fetch so that
// the API key can travel as a header (EventSource cannot send one). Everything shown is built
// with textContent: nothing from the server is parsed as HTML.
"use strict";

const KEY_STORAGE = "trioshed.apiKey";
const HEARTBEAT_GRACE_MS = 40000; // the server sends something at least every 15 s
const RETRY_MIN_MS = 250, RETRY_MAX_MS = 5000;
const MAX_EVENTS = 200, MAX_LOG = 500, MAX_REQUESTS = 200, HOUR = 3600;

const $ = (id) => document.getElementById(id);
const ui = {
  instance: null,       // the server process the lists below came from
  state: null,          // the last "state" message
  events: [],           // newest last
  log: [],
  clockOffset: 0,       // server time - local time, seconds
  messages: 0,
  pending: false,       // an action is in flight
  samples: new Map(),   // the last hour, by wall second (history messages)
  requests: [],         // recent requests, newest last (activity messages)
  models: [],           // every model in the store, described (models messages)
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
      const label = r.prompt_cache ? `${r.model} prompt cache` : r.model;
      bar.append(el("span", { class: r.prompt_cache ? "runner cache" : "runner", title: `${label}: ${bytes(r.bytes)}`, style: { width: pct(r.bytes), background: colour(r.model) } }));
      legend.append(el("span", {}, el("span", { class: r.prompt_cache ? "swatch cache" : "swatch", style: { background: colour(r.model) } }), `${label} ${bytes(r.bytes)}`));
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
  // r.size is /api/ps's size: the runner's own buffers (measured once llama.cpp reported them),
  // the prompt-cache reservation (--cache-ram, in system memory) named apart, as /api/ps has it
  const size = (r.measured !== null && r.measured !== undefined
    ? `${bytes(r.size)} measured / ${bytes(r.estimated)} est.`
    : `${bytes(r.estimated)} est.`) + (r.prompt_cache ? ` + ${bytes(r.prompt_cache)} prompt cache` : "");
  const state = r.evicting && r.state === "ready" ? "ready, leaving" : r.state;
  const phase = r.state !== "ready" ? "–" : r.leases > 0 ? "in use" : ""; // counts down only while idle
  const keep = el("td", { class: "keep-alive num", dataset: { expires: r.expires_at === null ? "" : String(r.expires_at), phase } });
  const row = el("tr", { dataset: { model: r.model, state: r.state } },
    el("td", {}, el("span", { class: "swatch", style: { background: colour(r.model) } }), r.model),
    el("td", { class: "state state-" + r.state }, state),
    el("td", { class: "num" }, `${r.leases} / ${r.slots}` + (r.waiting ? ` (+${r.waiting} waiting)` : "")),
    keep,
    el("td", { class: "num size", dataset: { size: String(r.size), promptCache: String(r.prompt_cache || 0) } }, size),
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

// Every node of a fleet (an admin's view; no fleet: no section)
function renderFleet(nodes) {
  const rows = (nodes || []).map((n) => el("tr", { dataset: { node: n.name } },
    el("td", {}, n.name + (n.url ? "" : " (this node)")),
    el("td", {}, !n.reachable ? `unreachable: ${n.error}` : n.draining ? "draining" : "up"),
    el("td", { class: "num" }, `${n.runners} of ${n.max_runners}`), el("td", { class: "num" }, String(n.queued)),
    el("td", { class: "num" }, bytes(n.room)),
    el("td", {}, n.devices.map((d) => `${d.id}: ${bytes(d.free)} free of ${bytes(d.total)}`).join("; ")),
    el("td", {}, n.loaded.map((m) => `${m.model} (${m.busy}/${m.slots} busy, ${m.queued} queued${m.ready ? "" : ", loading"})`).join("; ") || "–")));
  $("fleet").tBodies[0].replaceChildren(...rows);
  $("fleet-section").hidden = rows.length === 0;
}

// Usage per API key (an admin sees every key, a user key its own; no keys: no section)
function renderKeys(usage) {
  const rows = (usage || []).filter((u) => u.key).map((u) => el("tr", {},
    el("td", {}, u.key), el("td", {}, u.role || ""),
    el("td", { class: "num" }, String(u.prompt_tokens_today)), el("td", { class: "num" }, String(u.completion_tokens_today)),
    el("td", {}, Object.entries(u.budgets || {}).map(([name, b]) => `${name.replaceAll("_", " ")}: ${b.left} of ${b.limit}`).join("; ") || "no budget")));
  $("keys").tBodies[0].replaceChildren(...rows);
  $("keys-section").hidden = rows.length === 0;
}

// The usage store (admin): said only while this node cannot use it (serving goes on meanwhile)
function renderDatabase(db) {
  const down = Boolean(db && !db.reachable);
  $("database").hidden = !down;
  if (down) {
    $("database").textContent = `usage database ${db.where} ${db.problem || "cannot be reached"} (node ${db.node}): ` +
      `serving continues; ${db.pending} usage rows wait in memory` + (db.dropped ? `, ${db.dropped} dropped` : "");
  }
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

// ---------- the last hour: tokens/s, waiting, memory, with the scheduler's events as marks ----------

function svg(tag, attrs) {
  // the page's own <svg> elements name the SVG namespace (no address string in this script)
  const node = document.createElementNS($("chart-tokens").querySelector("svg").namespaceURI, tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
  return node;
}

const W = 600, H = 120, AXIS = 12;
const MARKS = { load: "load", ready: null, evict: "evict", unload: "evict", crash: "crash", "load-failed": "crash", refused: "refused" };

function series(samples, pick) {
  // one value per label per second; a second with no sample reads 0 (nothing held or waiting)
  const labels = new Set();
  for (const smp of samples) for (const k of Object.keys(pick(smp))) labels.add(k);
  return [...labels].sort().map((label) => ({ label, points: samples.map((smp) => [smp.time, pick(smp)[label] || 0]) }));
}

function span() {
  // the window drawn: the last hour, or less while trioshed has not run that long (5 min at least)
  let oldest = Infinity;
  for (const t of ui.samples.keys()) oldest = Math.min(oldest, t);
  return Math.min(HOUR, Math.max(300, Math.ceil((serverNow() - oldest) / 60) * 60 || 300));
}

function drawChart(box, lines, { now, max, stacked, unit, device }) {
  const window = span();
  const x = (t) => ((t - (now - window)) / window) * W;
  const y = (v) => (H - AXIS) - (max > 0 ? (Math.min(v, max) / max) * (H - AXIS - 4) : 0);
  const text = (attrs, words) => { const t = svg("text", { class: "axis", ...attrs }); t.textContent = words; return t; };
  const parts = [svg("line", { x1: 0, y1: H - AXIS, x2: W, y2: H - AXIS, stroke: "currentColor", "stroke-opacity": 0.3 }),
    text({ x: 2, y: H - 2 }, `-${window / 60} min`), text({ x: W / 2, y: H - 2 }, `-${window / 120} min`), text({ x: W - 24, y: H - 2 }, "now"),
    text({ x: 2, y: 10 }, unit === "bytes" ? bytes(max) : `${Math.round(max * 10) / 10} ${unit}`)];
  const drawn = [];
  const below = new Map(); // stacked: the top of the layers drawn so far, per second
  for (const line of lines) {
    const pts = [];
    let prev = null;
    for (const [t, v0] of line.points) {
      if (t < now - window) continue;
      const v = (stacked ? (below.get(t) || 0) : 0) + v0;
      if (stacked) below.set(t, v);
      if (prev !== null && t - prev > 1.5) pts.push([x(prev + 1), y(stacked ? 0 : 0)], [x(t - 1), y(0)]); // nothing between
      pts.push([x(t), y(v)]);
      prev = t;
    }
    if (!pts.length) continue;
    const hueOf = colour(line.label.replace(" · prompt cache", ""));
    const attrs = { "data-label": line.label, stroke: hueOf, "stroke-width": 1.5, fill: "none" };
    if (stacked) {
      pts.push([pts[pts.length - 1][0], y(0)], [pts[0][0], y(0)]);
      Object.assign(attrs, { fill: hueOf, "fill-opacity": line.label.endsWith("prompt cache") ? 0.25 : 0.65 });
    }
    const points = pts.map(([px, py]) => `${px.toFixed(1)},${py.toFixed(1)}`).join(" ");
    drawn.push(svg(stacked ? "polygon" : "polyline", { ...attrs, points }));
  }
  parts.push(...(stacked ? drawn.reverse() : drawn)); // stacked: the tallest first, the rest over it
  for (const e of ui.events) {
    const kind = MARKS[e.kind];
    if (!kind || e.time < now - window) continue;
    parts.push(svg("line", { x1: x(e.time), x2: x(e.time), y1: 0, y2: H - AXIS, class: "mark-" + kind, "data-kind": kind, "data-model": e.model || "",
      stroke: { load: "#1f7a3a", evict: "#a15c00", crash: "#b3261e", refused: "#7a4fc2" }[kind], "stroke-width": 1 }));
  }
  box.querySelector("svg").replaceChildren(...parts);
  box.querySelector(".legend").replaceChildren(...lines.map((l) => el("span", { dataset: { label: l.label } },
    el("span", { class: "swatch", style: { background: colour(l.label.replace(" · prompt cache", "")) } }), l.label)));
  if (device) box.dataset.device = device;
}

let historyTimer = null;
function renderHistory() {
  if (historyTimer) return; // at most once a second, whatever the stream brings
  historyTimer = setTimeout(() => {
    historyTimer = null;
    const now = serverNow();
    for (const t of ui.samples.keys()) if (t < now - HOUR - 5) ui.samples.delete(t);
    const samples = [...ui.samples.values()].sort((a, b) => a.time - b.time);
    const tokens = series(samples, (smp) => smp.tokens);
    const most = (lines) => Math.max(1, ...lines.flatMap((l) => l.points.map(([, v]) => v)));
    drawChart($("chart-tokens"), tokens, { now, max: most(tokens), unit: "tokens/s" });
    const waiting = series(samples, (smp) => smp.waiting);
    drawChart($("chart-waiting"), waiting, { now, max: most(waiting), unit: "requests" });
    const devices = (ui.state ? ui.state.devices : []).filter((d) => d.kind !== "rpc" || d.runners.length);
    const boxes = devices.map((d) => {
      let box = document.querySelector(`#chart-memory figure[data-device="${CSS.escape(d.id)}"]`);
      if (!box) {
        box = el("figure", { class: "chart", dataset: { device: d.id } }, el("figcaption", {}, `memory: ${d.name}`), el("div", { class: "legend" }));
        box.insertBefore(svg("svg", { viewBox: `0 0 ${W} ${H}`, preserveAspectRatio: "none", role: "img", "aria-label": `memory of ${d.name} over the last hour` }), box.lastChild);
      }
      drawChart(box, series(samples, (smp) => (smp.memory[d.id] || {})), { now, max: d.total, stacked: true, unit: "bytes", device: d.id });
      return box;
    });
    $("chart-memory").replaceChildren(...boxes);
    document.body.dataset.historySamples = String(samples.length);
  }, ui.samples.size ? 250 : 0);
}

// ---------- recent requests ----------

function ms(s) { return s === null || s === undefined ? "–" : s < 1 ? `${Math.round(s * 1000)} ms` : `${s.toFixed(2)} s`; }

function requestRow(r) {
  const ok = r.status >= 200 && r.status < 300;
  return el("tr", { dataset: { model: r.model, key: r.key, status: String(r.status), seq: String(r.seq) } },
    el("td", {}, clock(r.time)), el("td", { class: "key" }, r.key || "–"), el("td", {}, r.model || "–"), el("td", {}, r.protocol),
    el("td", { class: "num" + (ok ? "" : " bad") }, r.status ? String(r.status) : "left"),
    el("td", { class: "num" }, ms(r.queue_wait)), el("td", { class: "num" }, ms(r.load_wait)), el("td", { class: "num ttft" }, ms(r.ttft)),
    el("td", { class: "num" }, `${r.prompt_tokens ?? "–"} / ${r.eval_tokens ?? "–"}`),
    el("td", { class: "num" }, r.tokens_per_second ? r.tokens_per_second.toFixed(1) : "–"),
    el("td", { class: "slow" }, r.slow || ""));
}

function fillSelect(select, values) {
  const keep = select.value;
  select.replaceChildren(el("option", { value: "" }, "all"), ...values.map((v) => el("option", { value: v }, v)));
  select.value = values.includes(keep) ? keep : "";
}

function renderActivity() {
  const model = $("activity-model").value, key = $("activity-key").value;
  const shown = ui.requests.filter((r) => (!model || r.model === model) && (!key || r.key === key)).slice().reverse();
  $("activity").tBodies[0].replaceChildren(...shown.map(requestRow));
  const keys = [...new Set(ui.requests.map((r) => r.key).filter((k) => k))].sort();
  fillSelect($("activity-model"), [...new Set(ui.requests.map((r) => r.model).filter((m) => m))].sort());
  fillSelect($("activity-key"), keys);
  $("activity").classList.toggle("no-keys", !keys.length);
  $("activity-section").classList.toggle("no-keys-filter", !keys.length);
  $("no-activity").hidden = ui.requests.length > 0;
  $("activity").hidden = ui.requests.length === 0;
}

// ---------- every model in reach ----------

function storeRow(m) {
  const loaded = ui.state && ui.state.runners.find((r) => r.model === m.name);
  const fitClass = m.error ? "fit-no" : m.fits_now ? "fit-now" : m.fit && m.fit.startsWith("fits after") ? "fit-later" : "fit-no";
  const estimate = m.estimate ? `${bytes(m.estimate)} est.` + (m.prompt_cache ? ` + ${bytes(m.prompt_cache)} prompt cache` : "") : "";
  return el("tr", { dataset: { model: m.name, loaded: loaded ? "yes" : "no" } },
    el("td", {}, el("span", { class: "swatch", style: { background: colour(m.name) } }), m.name),
    el("td", { class: "num", title: estimate }, bytes(m.size)),
    el("td", {}, [m.family, m.parameters].filter((x) => x).join(" ") || "–"),
    el("td", {}, m.quantization || "–"),
    el("td", { class: "num", title: "trained context / a runner's num_ctx" }, m.context_length ? `${m.context_length} / ${m.num_ctx}` : "–"),
    el("td", {}, (m.capabilities || []).join(", ")),
    el("td", { class: "fit " + fitClass, title: estimate }, m.error || m.fit),
    el("td", {},
      loaded ? el("button", { type: "button", class: "unload", onclick: () => act("unload", m.name) }, "Unload")
        : el("button", { type: "button", class: "load", onclick: () => act("load", m.name) }, "Load"), " ",
      el("button", { type: "button", class: "pin", onclick: () => act(loaded && loaded.pinned ? "unpin" : "pin", m.name) }, loaded && loaded.pinned ? "Unpin" : "Pin"), " ",
      el("button", { type: "button", class: "delete", onclick: () => act("delete", m.name) }, "Delete")));
}

function renderStore() {
  $("models").tBodies[0].replaceChildren(...ui.models.map(storeRow));
  $("no-models").hidden = ui.models.length > 0;
  $("models").hidden = ui.models.length === 0;
  const select = $("play-model"), before = select.value, keep = before || sessionStorage.getItem(PLAY_MODEL) || "";
  const usable = ui.models.filter((m) => !m.error).map((m) => m.name);
  if (usable.join("\n") !== [...select.options].map((o) => o.value).join("\n")) {
    select.replaceChildren(...usable.map((name) => el("option", { value: name }, name)));
    if (usable.includes(keep)) select.value = keep;
  }
  if (select.value !== before || !document.body.dataset.playKind) playModelChanged(); // never under a stream
}

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
      ui.events = []; ui.log = []; ui.requests = []; ui.samples.clear();
      $("events").replaceChildren(); $("log").replaceChildren();
      renderActivity();
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
    renderKeys(data.usage);
    renderDatabase(data.database);
    renderFleet(data.fleet);
    $("updated").textContent = "updated " + clock(data.time);
  } else if (type === "events") {
    const seen = ui.events.length ? ui.events[ui.events.length - 1].seq : 0;
    addEvents(data.events.filter((e) => e.seq > seen), data.gap);
  } else if (type === "log") {
    const seen = ui.log.length ? ui.log[ui.log.length - 1].seq : 0;
    addLog(data.lines.filter((l) => l.seq > seen));
  } else if (type === "history") {
    for (const smp of data.samples) ui.samples.set(smp.time, smp);
    renderHistory();
  } else if (type === "activity") {
    const seen = ui.requests.length ? ui.requests[ui.requests.length - 1].seq : 0;
    ui.requests.push(...data.requests.filter((r) => r.seq > seen));
    ui.requests.splice(0, Math.max(0, ui.requests.length - MAX_REQUESTS));
    renderActivity();
  } else if (type === "models") {
    ui.models = data.models;
    renderStore();
  }
  if (type === "state" || type === "events") { renderHistory(); if (ui.models.length) renderStore(); }
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
  delete: { ask: (m) => `Delete ${m} from the store?`, again: (m) => `Really delete ${m}? Its file is removed unless another model still uses it; this cannot be undone.`,
            method: "DELETE", path: "/api/delete", body: (m) => ({ model: m }), done: (m) => { ui.models = ui.models.filter((x) => x.name !== m); renderStore(); } },
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
  if (spec.again && !(await confirmDialog(spec.again(model)))) return; // asked twice
  ui.pending = true;
  document.body.dataset.action = "pending";
  showError("");
  for (const b of document.querySelectorAll("button")) if (!b.closest("dialog") && !b.closest("#play-form")) b.disabled = true;
  try {
    const response = await fetch(spec.path, {
      method: spec.method || "POST", headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(spec.body(model)),
    });
    if (!response.ok) {
      let message = `HTTP ${response.status}`;
      try { const body = await response.json(); if (body.error) message = typeof body.error === "string" ? body.error : body.error.message; } catch (e) { /* not JSON */ }
      showError(`${action} ${model}: ${message}`);
      document.body.dataset.action = "failed";
    } else {
      await response.arrayBuffer();
      if (spec.done) spec.done(model);
      document.body.dataset.action = "done";
    }
  } catch (err) {
    showError(`${action} ${model}: ${err.message}`);
    document.body.dataset.action = "failed";
  } finally {
    ui.pending = false;
    for (const b of document.querySelectorAll("button")) if (!b.closest("#play-form")) b.disabled = false;
  }
}

// ---------- the playground: the same API and key as any client ----------

const PLAY_STORAGE = "trioshed.playground", PLAY_MODEL = "trioshed.playgroundModel";
const play = { controller: null };

function conversations() {
  try { return JSON.parse(sessionStorage.getItem(PLAY_STORAGE) || "{}"); } catch (e) { return {}; }
}

function conversation(model) { return conversations()[model] || []; }

function saveConversation(model, messages) {
  const all = conversations();
  all[model] = messages;
  sessionStorage.setItem(PLAY_STORAGE, JSON.stringify(all));
}

function playKind(model) {
  const m = ui.models.find((x) => x.name === model);
  const caps = (m && m.capabilities) || [];
  if (caps.includes("rerank")) return "rerank";
  if (caps.includes("embedding") && !caps.includes("completion")) return "embedding";
  if (m && m.chat_template === false) return "continue";  // a base model: it continues text, it does not chat
  return "chat";
}

//: The most tokens one continuation of a base model takes here (as `trioshed run` writes one).
const CONTINUE_TOKENS = 128;

function turn(role, content) { return el("div", { class: "turn " + role, dataset: { role } }, content); }

function renderConversation() {
  const model = $("play-model").value;
  $("play-chat").replaceChildren(...conversation(model).map((m) => turn(m.role, m.content)));
}

function playModelChanged() {
  const model = $("play-model").value;
  if (model) sessionStorage.setItem(PLAY_MODEL, model);
  const kind = playKind(model);
  document.body.dataset.playKind = kind;
  $("play-kind").textContent = { chat: "chat", embedding: "embedding model: shows the vector", rerank: "reranker: ranks the documents",
    continue: `base model: it continues your text (up to ${CONTINUE_TOKENS} tokens), it does not chat · for a chat model: trioshed pull llama3.2:1b` }[kind];
  $("play-label").textContent = { chat: "Message", rerank: "Query", embedding: "Text to embed", continue: "Text to continue" }[kind];
  $("play-input").placeholder = kind === "continue" ? "The three largest cities in France are" : "";
  $("play-docs").hidden = kind !== "rerank";
  $("play-chat").hidden = kind !== "chat";
  $("play-clear").hidden = kind !== "chat";
  $("play-result").hidden = true;
  renderConversation();
}

function playBusy(busy) {
  $("play-send").disabled = busy;
  $("play-stop").disabled = !busy;
  document.body.dataset.play = busy ? "streaming" : document.body.dataset.play === "streaming" ? "done" : (document.body.dataset.play || "idle");
}

async function playError(response) {
  let message = `HTTP ${response.status}`;
  try { const body = await response.json(); if (body.error) message = typeof body.error === "string" ? body.error : body.error.message; } catch (e) { /* not JSON */ }
  return message;
}

async function* ndjson(response) {
  // The lines of an Ollama-style stream, parsed; an error line ends it with that error.
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n")) >= 0) {
      const line = buffer.slice(0, end).trim();
      buffer = buffer.slice(end + 1);
      if (!line) continue;
      const chunk = JSON.parse(line);
      if (chunk.error) throw new Error(chunk.error);
      yield chunk;
    }
  }
}

function showTimings(started, first, final) {
  const words = [];
  if (first !== null) words.push(`first token ${((first - started) / 1000).toFixed(2)} s`);
  if (final && final.eval_count && final.eval_duration) words.push(`${(final.eval_count / (final.eval_duration / 1e9)).toFixed(1)} tokens/s`, `${final.eval_count} tokens`);
  $("play-timings").textContent = words.join(" · ");
}

async function playChat(model, text) {
  const messages = [...conversation(model), { role: "user", content: text }];
  saveConversation(model, messages);
  renderConversation();
  const answer = turn("assistant", "");
  $("play-chat").append(answer);
  const started = performance.now();
  let first = null, content = "", final = null;
  try {
    const response = await fetch("/api/chat", { method: "POST", signal: play.controller.signal,
      headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify({ model, messages, stream: true }) });
    if (!response.ok) throw new Error(await playError(response));
    for await (const chunk of ndjson(response)) {
      const piece = (chunk.message && chunk.message.content) || "";
      if (piece && first === null) first = performance.now();
      content += piece;
      answer.textContent = content;
      if (chunk.done) final = chunk;
    }
    document.body.dataset.play = "done";
  } catch (err) {
    if (err.name === "AbortError") { document.body.dataset.play = "stopped"; answer.append(el("span", { class: "muted" }, " [stopped]")); }
    else { document.body.dataset.play = "failed"; showError(`${model}: ${err.message}`); }
  }
  if (content) saveConversation(model, [...messages, { role: "assistant", content }]);
  showTimings(started, first, final);
}

async function playContinue(model, text) {
  // A base model's continuation of the text: streamed, shown after the text it continues.
  const result = $("play-result");
  result.replaceChildren(el("span", { class: "muted" }, text));
  result.hidden = false;
  const started = performance.now();
  let first = null, final = null, written = "";
  try {
    const response = await fetch("/api/generate", { method: "POST", signal: play.controller.signal, headers: headers({ "Content-Type": "application/json" }),
      body: JSON.stringify({ model, prompt: text, stream: true, options: { num_predict: CONTINUE_TOKENS } }) });
    if (!response.ok) throw new Error(await playError(response));
    const continuation = document.createTextNode("");
    result.append(continuation);
    for await (const chunk of ndjson(response)) {
      if (chunk.response && first === null) first = performance.now();
      written += chunk.response || "";
      continuation.data = written;
      if (chunk.done) final = chunk;
    }
    document.body.dataset.play = "done";
  } catch (err) {
    if (err.name === "AbortError") document.body.dataset.play = "stopped";
    else { document.body.dataset.play = "failed"; showError(`${model}: ${err.message}`); }
  }
  showTimings(started, first, final);
}

async function playOther(kind, model, text) {
  const body = kind === "rerank"
    ? { model, query: text, documents: $("play-docs").value.split("\n").map((d) => d.trim()).filter((d) => d) }
    : { model, input: text };
  const path = kind === "rerank" ? "/v1/rerank" : "/api/embed";
  try {
    const response = await fetch(path, { method: "POST", signal: play.controller.signal, headers: headers({ "Content-Type": "application/json" }), body: JSON.stringify(body) });
    if (!response.ok) throw new Error(await playError(response));
    const answer = await response.json();
    let shown;
    if (kind === "rerank") shown = answer.results.map((r) => `${r.relevance_score.toFixed(4)}  ${body.documents[r.index]}`).join("\n");
    else { const v = answer.embeddings[0]; shown = `${v.length} dimensions\n[${v.slice(0, 8).map((n) => n.toFixed(5)).join(", ")}, …]`; }
    $("play-result").textContent = shown;
    $("play-result").hidden = false;
    document.body.dataset.play = "done";
  } catch (err) {
    if (err.name === "AbortError") document.body.dataset.play = "stopped";
    else { document.body.dataset.play = "failed"; showError(`${model}: ${err.message}`); }
  }
}

async function playSend() {
  const model = $("play-model").value, text = $("play-input").value.trim();
  if (!model || !text || play.controller) return;
  showError("");
  $("play-input").value = "";
  $("play-timings").textContent = "";
  play.controller = new AbortController();
  playBusy(true);
  try {
    const kind = playKind(model);
    if (kind === "chat") await playChat(model, text);
    else if (kind === "continue") await playContinue(model, text);
    else await playOther(kind, model, text);
  } finally {
    play.controller = null;
    playBusy(false);
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("play-form").addEventListener("submit", (e) => { e.preventDefault(); playSend(); });
  $("play-stop").addEventListener("click", () => { if (play.controller) play.controller.abort(); });
  $("play-clear").addEventListener("click", () => { saveConversation($("play-model").value, []); renderConversation(); $("play-timings").textContent = ""; });
  $("play-model").addEventListener("change", playModelChanged);
  $("activity-model").addEventListener("change", renderActivity);
  $("activity-key").addEventListener("change", renderActivity);
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
