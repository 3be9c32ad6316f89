"""The comparison's summary: rows with ratios to direct, a markdown report, PNG plots.

``summary_rows`` is pure (results in, rows out); ``plots`` imports matplotlib (the ``bench``
extra) only when called, with the non-interactive Agg backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.plan import TARGETS

FLOORS = ("floor-raw", "floor-hypercorn", "floor-quart")

Row = dict[str, Any]


def _get(d: Any, *path: str) -> Any:
    for key in path:
        if not isinstance(d, Mapping) or key not in d:
            return None
        d = d[key]
    return d


def _ratio(v: Any, base: Any) -> float | None:
    if not isinstance(v, int | float) or not isinstance(base, int | float) or not base:
        return None
    return round(v / base, 3)


def _row(metric: str, values: dict[str, Any], target: str = "", met: bool | None = None,
         ratios: bool = True, note: str = "") -> Row:  # fmt: skip
    base = values.get("direct")
    return {
        "metric": metric,
        "values": values,
        "ratio": {t: _ratio(v, base) for t, v in values.items() if t != "direct"} if ratios else {},
        "target": target,
        "met": met,
        "note": note,
    }


def summary_rows(results: Mapping[str, Any]) -> list[Row]:
    rows: list[Row] = []

    def per(scenario: str) -> Mapping[str, Any]:
        return _get(results, scenario, "per_target") or {}

    floor = per("overhead-generate")
    floors = {k.removeprefix("floor-"): _get(floor, k, "summary", "p50") for k in FLOORS if k in floor}
    if floors:
        raw = floors.get("raw")
        own = ", ".join(f"{k} {v - raw:+.2f} ms" for k, v in floors.items() if k != "raw" and v is not None and raw is not None)
        rows.append(_row("inbound floor c=1 p50 ms (raw socket / hypercorn alone / quart-trio alone, same POST)",
                         {"trioshed": " / ".join(_fmt(v) for v in floors.values())}, ratios=False,
                         note="what the inbound stack costs by itself, paired with the generate requests "
                              f"(raw: no HTTP library, the client's own cost); over raw: {own}"))  # fmt: skip
    forward = {f: _get(per(f"overhead-{f}"), "floor-forward", "paired_delta_ms", "p50") for f in ("generate", "chat")}
    if any(v is not None for v in forward.values()):
        rows.append(_row("proxy floor c=1: paired Δ p50 ms of a bare forwarder (generate / chat)",
                         {"trioshed": " / ".join(_fmt(v) for v in forward.values())}, ratios=False,
                         note="hypercorn and trioshed's upstream client relaying the direct llama-server, with nothing "
                              "else: what any proxy on this stack adds by itself"))  # fmt: skip
    for family in ("generate", "chat"):
        pt = per(f"overhead-{family}")
        if not pt:
            continue
        values = {t: _get(pt, t, "summary", "p50") for t in TARGETS if t in pt}
        deltas = {t: _get(pt, t, "paired_delta_ms", "p50") for t in TARGETS if t in pt and t != "direct"}
        d_tri, d_rou = deltas.get("trioshed"), deltas.get("router")
        met = None if d_tri is None or d_rou is None else d_tri <= d_rou + 0.5
        note = ", ".join(f"{t} {v:+.2f} ms" for t, v in deltas.items() if v is not None)
        if forward.get(family) is not None:
            note += f"; the bare forwarder {forward[family]:+.2f} ms"
        rows.append(_row(f"overhead c=1 p50 ms ({family})", values,
                         "trioshed Δ ≤ router Δ + 0.5 ms", met, note=f"paired Δ p50: {note}"))  # fmt: skip

    for scen in sorted((k for k in results if k.startswith("throughput-c")), key=lambda k: int(k[12:])):
        pt = per(scen)
        conc = scen.removeprefix("throughput-c")
        values = {t: _get(pt, t, "summary", "req_s") for t in TARGETS if t in pt}
        r = _ratio(values.get("trioshed"), values.get("direct"))
        r_router = _ratio(values.get("router"), values.get("direct"))
        target = "trioshed/direct ≥ router/direct" if conc == "16" else ""
        met = (None if r is None or r_router is None else r >= r_router) if conc == "16" else None
        per_round = []
        for t in ("router", "trioshed"):
            rd, rt = _get(pt, "direct", "rounds") or [], _get(pt, t, "rounds") or []
            rs = [_ratio(b.get("req_s"), a.get("req_s")) for a, b in zip(rd, rt, strict=False)]
            if rs:
                per_round.append(f"{t}/direct per round: {', '.join(_fmt(x) for x in rs)}")
        rows.append(_row(f"req/s c={conc}", values, target, met, note="; ".join(per_round)))
        p99 = {t: _get(pt, t, "summary", "p99") for t in TARGETS if t in pt}
        rows.append(_row(f"p99 ms c={conc}", p99))

    pt = per("streaming")
    if pt:
        values = {t: _get(pt, t, "summary", "stream_tok_s") for t in TARGETS if t in pt}
        r = _ratio(values.get("trioshed"), values.get("direct"))
        rows.append(_row("stream tokens/s (gemma3, 128)", values, "trioshed ≥ 0.99x direct",
                         None if r is None else r >= 0.99))  # fmt: skip
        ttft = {t: _get(pt, t, "summary", "ttft_p50") for t in TARGETS if t in pt}
        dt = _get(pt, "trioshed", "paired_ttft_delta_ms", "p50")
        note = ", ".join(
            f"{t} {v:+.2f} ms" for t in ("router", "trioshed")
            if (v := _get(pt, t, "paired_ttft_delta_ms", "p50")) is not None
        )  # fmt: skip
        rows.append(_row("time to first token p50 ms", ttft, "trioshed ≤ direct +1 ms",
                         None if dt is None else dt <= 1.0, note=f"paired Δ p50: {note}"))  # fmt: skip

    pt = per("concurrent-streams")
    if pt:
        streams, slots = _get(results, "concurrent-streams", "streams"), _get(results, "concurrent-streams", "slots")
        values = {t: _get(pt, t, "summary", "tok_s") for t in TARGETS if t in pt}
        r = _ratio(values.get("trioshed"), values.get("direct"))
        rounds = ", ".join(f"{t} {_get(pt, t, 'tok_s_rounds')}" for t in TARGETS if t in pt)
        rows.append(_row(f"{streams} chat streams, {slots} slots (gemma3): aggregate tokens/s", values,
                         "trioshed ≥ 0.99x direct", None if r is None else r >= 0.99,
                         note=f"per round: {rounds}"))  # fmt: skip
        for q in ("p50", "p99"):
            ttft = {t: _get(pt, t, f"ttft_{q}_ms") for t in TARGETS if t in pt}
            d, base = ttft.get("trioshed"), ttft.get("direct")
            rows.append(_row(f"{streams} chat streams, {slots} slots: TTFT {q} ms", ttft, "trioshed ≤ direct +2 ms",
                             None if d is None or base is None else d <= base + 2.0))  # fmt: skip

    pt = per("swap")
    if pt:
        values = {t: _get(pt, t, "summary", "p50") for t in TARGETS if t in pt}
        r = _ratio(values.get("trioshed"), values.get("direct"))
        errs = {t: _get(pt, t, "summary", "n") - (_get(pt, t, "summary", "ok") or 0) for t in pt}
        rows.append(_row("swap ms p50 (max loaded 1; direct = cold start)", values,
                         "trioshed ≤ 1.05x direct", None if r is None else r <= 1.05,
                         note="failed: " + ", ".join(f"{t} {n}" for t, n in errs.items())))  # fmt: skip

    pt = per("head-of-line")
    if pt:
        values = {t: _get(pt, t, "p99_ratio") for t in TARGETS if t in pt}
        v = values.get("trioshed")
        p99s = ", ".join(
            f"{t} {_get(pt, t, 'alone', 'p99')}→{_get(pt, t, 'with_swaps', 'p99')} ms" for t in pt
        )
        rows.append(_row("head-of-line: A p99 with B swaps / without", values, "trioshed ≤ 1.2",
                         None if v is None else v <= 1.2, ratios=False, note=p99s))  # fmt: skip

    pt = per("overload")
    if pt:
        values = {t: _outcomes(_get(pt, t) or {}) for t in TARGETS if t in pt}
        tri = _get(pt, "trioshed") or {}
        met = None if not tri else (tri.get("lost", 1) == 0 and tri.get("other_5xx", 1) == 0)
        q = _get(results, "overload", "trioshed_max_queue")
        rows.append(_row("overload: answered/503/other 5xx/lost", values,
                         "trioshed 0 lost, 0 other 5xx", met, ratios=False,
                         note=f"trioshed queue {q}"))  # fmt: skip

    for scen in sorted((k for k in results if k.startswith("contention-c")), key=lambda k: int(k[12:])):
        pt = per(scen)
        values = {}
        for t in TARGETS:
            if t not in pt:
                continue
            s = _get(pt, t, "summary") or {}
            failed = (s.get("n") or 0) - (s.get("ok") or 0)
            values[t] = f"{failed} failed, {s.get('stalls', 0)} stalls, max {_fmt(s.get('max'), 0)} ms"
        tri = _get(pt, "trioshed", "summary") or {}
        met = None if not tri else (tri.get("n") == tri.get("ok"))
        clients = scen.removeprefix("contention-c")
        rows.append(_row(f"contention c={clients} (max loaded 1, 3 models)", values,
                         "trioshed 0 failed", met, ratios=False,
                         note="direct: three always-loaded servers (no swaps)"))  # fmt: skip

    sched = _get(results, "sched-scale", "points")
    if sched:
        biggest = max(sched, key=lambda p: (p["models"], p["queued"]))
        at = [p for p in sched if (p["models"], p["queued"]) == (biggest["models"], biggest["queued"])]
        worst = max(at, key=lambda p: p["per_request_us"])
        slopes = _get(results, "sched-scale", "queue_growth_exponent") or {}
        top = [v for k, v in slopes.items() if k.endswith(f"/{biggest['models']}") and v is not None]
        met = worst["per_request_us"] <= 50 and all(v <= 1.15 for v in top)
        note = "; ".join(f"{p['shape']} {p['per_call_us'] / 1e3:.1f} ms/call" for p in at)
        rows.append(_row(
            f"scheduler plan() us per queued request at {biggest['models']} models, {biggest['queued']} queued (in-process)",
            {"trioshed": worst["per_request_us"]}, "≤ 50 us, growth ≤ linear in queue", met, ratios=False,
            note=f"{note}; queue growth exponents {', '.join(f'{k} {v}' for k, v in slopes.items())}",
        ))  # fmt: skip

    loop = [p for p in (_get(results, "sched-scale", "loop") or []) if not p.get("skipped")]
    if loop:
        big = max(loop, key=lambda p: (p["models"], p["queued"]))
        done = "" if big["finished"] else f", only {big['served']} served in {big['seconds']} s"
        rows.append(_row(
            f"scheduler loop, fake runners: us per request, {big['models']} models, {big['queued']} queued at once",
            {"trioshed": big["us_per_request"]}, "", None, ratios=False,
            note="in-process, no processes: " + ", ".join(
                f"{p['models']}/{p['queued']}: {p['us_per_request']} us" for p in loop) + done,
        ))  # fmt: skip

    embed = results.get("embed-index")
    if embed:
        s = embed["summary"]
        rows.append(_row("embeddings: indexing chunks/s (1,000 x ~300 tokens, requests of 32)",
                         {"direct": s["direct"]["chunks_per_s"], "trioshed": s["trioshed"]["chunks_per_s"]},
                         f"trioshed ≥ {embed['target']}x direct", embed["met"],
                         note=f"tokens/s {s['direct']['tokens_per_s']} / {s['trioshed']['tokens_per_s']}; CPU s per 1000 chunks "
                              f"{s['direct']['cpu_s_per_1000']} / {s['trioshed']['cpu_s_per_1000']}"))  # fmt: skip

    pt = per("rss")
    if pt:
        values = {t: _get(pt, t, "idle_rss_mb_after") for t in ("router", "trioshed") if t in pt}
        fresh = {t: _get(pt, t, "idle_rss_mb_fresh") for t in ("router", "trioshed") if t in pt}
        v = values.get("trioshed")
        rows.append(_row("idle RSS MB of the server process (no children)", values,
                         "trioshed ≤ 80 MB", None if v is None else v <= 80, ratios=False,
                         note="fresh: " + ", ".join(f"{t} {x} MB" for t, x in fresh.items())))  # fmt: skip
    return rows


def _outcomes(d: Mapping[str, Any]) -> str:
    return f"{d.get('answered', 0)}/{d.get('busy_503', 0)}/{d.get('other_5xx', 0)}/{d.get('lost', 0)}"


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def summary_markdown(doc: Mapping[str, Any]) -> str:
    """The summary table: one row per figure, each target's value and its ratio to direct."""
    meta = doc.get("meta", {})
    lines = [
        f"trioshed bench ({meta.get('mode')}), {meta.get('started')} on {meta.get('host')} "
        f"({meta.get('cpu_count')} CPUs, {meta.get('cpu')}), commit {meta.get('commit')}"
        f"{' + uncommitted ' + ', '.join(meta['dirty']) if meta.get('dirty') else ''}, "
        f"{meta.get('binary_version') or meta.get('binary')}, "
        f"flags {meta.get('flags')}",
        "",
        "| metric | direct | router | trioshed | router/direct | trioshed/direct | target | met |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for row in doc.get("summary", []):
        v, r = row["values"], row["ratio"]
        met = {True: "yes", False: "**no**", None: ""}[row["met"]]
        lines.append(
            f"| {row['metric']} | {_fmt(v.get('direct'))} | {_fmt(v.get('router'))} | "
            f"{_fmt(v.get('trioshed'))} | {_fmt(r.get('router'), 3)} | {_fmt(r.get('trioshed'), 3)} | "
            f"{row['target']} | {met} |"
        )
    notes = [f"- {row['metric']}: {row['note']}" for row in doc.get("summary", []) if row.get("note")]
    if notes:
        lines += ["", *notes]
    unavailable = doc.get("unavailable") or {}
    if unavailable:
        lines += ["", "Unavailable targets:"]
        for k, msg in unavailable.items():
            text = [line for line in msg.strip().splitlines() if line.strip()]
            first, last = (text[0], text[-1]) if text else ("", "")
            lines.append(f"- {k}: {first} {last if last != first else ''}".rstrip())
    if meta.get("cut_short"):
        lines += ["", "**The run hit its hard time limit and was cut short.**"]
    if meta.get("skipped"):
        lines += ["", f"Skipped for time: {', '.join(meta['skipped'])}"]
    lines += ["", f"elapsed {meta.get('elapsed_s')} s; leaked llama-servers: {meta.get('leaked_llama_servers')}"]
    return "\n".join(lines) + "\n"


def markdown(doc: Mapping[str, Any], files: Mapping[str, str]) -> str:
    meta = doc.get("meta", {})
    out = ["# trioshed side-by-side benchmark", "", summary_markdown(doc)]
    out += [
        "## How to reproduce",
        "",
        f"`make bench` (quick) or `make bench-full`; this run: `python -m bench.compare --{meta.get('mode')}`.",
        "Targets share the binary, models and runner flags; targets are interleaved; ratios are to direct.",
        "",
    ]
    for kind in ("cdf", "ratios"):
        if kind in files:
            out.append(f"![{kind}]({files[kind]})")
    out += ["", "## Per scenario", ""]
    for scen, data in doc.get("results", {}).items():
        if scen == "sched-scale":
            from bench.sched_scale import markdown as sched_markdown

            out += [f"### {scen}", "", sched_markdown(data)]
            if "sched" in files:
                out += [f"![sched]({files['sched']})", ""]
            continue
        if scen == "embed-index":
            from bench.embed_index import markdown as embed_markdown

            out += [f"### {scen}", "", embed_markdown(data)]
            continue
        if scen == "relay":
            from bench.relay import markdown as relay_markdown

            out += [f"### {scen}", "", relay_markdown(data)]
            continue
        if scen == "state-scale":
            from bench.state_scale import table as state_table

            met = ", ".join(f"{k} {'yes' if v else '**no**'}" for k, v in data["met"].items())
            out += [f"### {scen}", "", state_table(data), "", f"Under {data['target_ms']} ms at the largest point: {met}", ""]
            continue
        pt = data.get("per_target", {})
        out.append(f"### {scen}")
        out.append("")
        out.append("| target | n | ok | by status | p50 ms | p90 ms | p99 ms | req/s | tok/s | ttft p50 ms |")
        out.append("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for t, d in pt.items():
            for label, s in _summaries(d):
                out.append(
                    f"| {t}{label} | {s.get('n')} | {s.get('ok')} | {s.get('by_status')} | {_fmt(s.get('p50'))} | "
                    f"{_fmt(s.get('p90'))} | {_fmt(s.get('p99'))} | {_fmt(s.get('req_s'))} | "
                    f"{_fmt(s.get('tok_s'))} | {_fmt(s.get('ttft_p50'))} |"
                )
        out.append("")
    return "\n".join(out) + "\n"


def _summaries(d: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for key, label in (("summary", ""), ("alone", " (alone)"), ("with_swaps", " (with swaps)"), ("swaps", " (B swaps)")):
        if isinstance(d.get(key), Mapping):
            out.append((label, d[key]))
    return out


def plots(doc: Mapping[str, Any], out_dir: Path, stem: str) -> dict[str, Path]:
    """Latency CDFs per target (overhead and c=16 throughput) and ratio bars; PNG files."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    paths: dict[str, Path] = {}
    records = doc.get("records", [])
    panels = [s for s in ("overhead-generate", "overhead-chat", "throughput-c16", "streaming") if s in doc.get("results", {})]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.6), squeeze=False)
        for ax, scen in zip(axes[0], panels, strict=True):
            for t in TARGETS:
                xs = sorted(r["total"] * 1e3 for r in records
                            if r.get("scenario") == scen and r["target"] == t and r["status"] == 200
                            and r.get("error") is None and r.get("total") is not None)  # fmt: skip
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=f"{t} (n={len(xs)})")
            ax.set_title(scen)
            ax.set_xlabel("latency ms")
            ax.set_ylabel("fraction")
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        paths["cdf"] = out_dir / f"{stem}-latency-cdf.png"
        fig.savefig(paths["cdf"], dpi=110)
        plt.close(fig)

    bars = [row for row in doc.get("summary", []) if row.get("ratio")]
    if bars:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(bars) + 1.5))
        labels = [row["metric"] for row in bars]
        width = 0.38
        for k, t in enumerate(("router", "trioshed")):
            vals = [row["ratio"].get(t) or 0.0 for row in bars]
            ax.barh([i + (k - 0.5) * width for i in range(len(bars))], vals, height=width, label=t)
        ax.axvline(1.0, color="black", lw=1)
        ax.set_yticks(range(len(bars)))
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ratio to direct (1.0 = direct)")
        ax.legend()
        fig.tight_layout()
        paths["ratios"] = out_dir / f"{stem}-ratios.png"
        fig.savefig(paths["ratios"], dpi=110)
        plt.close(fig)

    sched = doc.get("results", {}).get("sched-scale")
    if sched and sched.get("points"):
        from bench.sched_scale import plot as sched_plot

        paths["sched"] = out_dir / f"{stem}-sched-scale.png"
        sched_plot(sched, paths["sched"])
    return paths
