"""Render benchmark results as docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.embeddings import render as _embeddings
from bench.messages import render as _messages
from bench.routing import render as _routing
from bench.soak import REQUEST_TIMEOUT_S
from bench.stack import render as _stack


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def _inference(r: dict[str, Any]) -> list[str]:
    lines = [
        "## Inference: Tollgate vs `vllm serve` (SmolLM2-135M-Instruct, vLLM on the CPU)",
        "",
        f"Measured {r.get('date', '')}.",
        "",
        "Same model folder, same engine arguments (`--max-num-seqs 16 --dtype bfloat16 "
        "--max-model-len 2048`), same machine, same run. Streaming chat completions of "
        "exactly 64 tokens (`ignore_eos`), temperature 0. `vllm serve` is vLLM's own "
        "OpenAI server called directly; Tollgate is router + NATS + worker. Both "
        "are loaded at once, each with its own engine, and measured in alternating "
        "rounds (the one not measured is idle).",
        "",
        "| concurrency | metric | vllm serve | Tollgate | Tollgate / vllm | Tollgate minus vllm |",
        "|---|---|---|---|---|---|",
    ]
    for level in ("c1", "c16"):
        v, t = r["vllm"][level], r["tollgate"][level]
        for key, label in (
            ("ttft_p50_ms", "TTFT p50 (ms)"),
            ("ttft_p99_ms", "TTFT p99 (ms)"),
            ("itl_p50_ms", "inter-token p50 (ms)"),
            ("itl_p99_ms", "inter-token p99 (ms)"),
            ("output_tokens_per_s", "output tokens/s"),
        ):
            lines.append(
                f"| {level[1:]} | {label} | {v[key]:.1f} | {t[key]:.1f} | "
                f"{_ratio(t[key], v[key])} | {t[key] - v[key]:+.1f} |"
            )
    lines += [
        "",
        f"Engine start to first ready: vllm serve {r['vllm_start_s']:.0f} s, "
        f"Tollgate worker {r['tollgate_start_s']:.0f} s.",
        "",
        f"Greedy (temperature 0) non-streaming replies to the {r.get('compared_outputs', 0)} "
        f"benchmark prompts were identical on both servers for "
        f"{r.get('identical_outputs', 0)} of them.",
        "",
    ]
    return lines


def _gateway(r: dict[str, Any]) -> list[str]:
    d, t = r["direct"], r["tollgate"]
    lines = [
        "## Gateway hop: simulated engine through Tollgate vs the same engine served directly",
        "",
        f"Measured {r.get('date', '')}.",
        "",
        "The simulated engine (a test double: no model, 8 tokens, no delay) behind a bare "
        "aiohttp server (baseline) and behind Tollgate's router + NATS + worker. "
        "Non-streaming chat completions; the load generator runs on the same 2 cores.",
        "",
        "| metric | direct | Tollgate | added by the hop |",
        "|---|---|---|---|",
    ]
    for key, label in (
        ("latency_p50_ms", "latency p50 at concurrency 1 (ms)"),
        ("latency_p99_ms", "latency p99 at concurrency 1 (ms)"),
    ):
        lines.append(
            f"| {label} | {d['c1'][key]:.2f} | {t['c1'][key]:.2f} | "
            f"{t['c1'][key] - d['c1'][key]:+.2f} |"
        )
    lines.append(
        f"| requests/s sustained with p99 ≤ 50 ms | {d['rate_at_p99_50ms']:.0f} | "
        f"{t['rate_at_p99_50ms']:.0f} | "
        f"ratio {_ratio(t['rate_at_p99_50ms'], d['rate_at_p99_50ms'])} |"
    )
    lines += [
        "",
        "| concurrency | direct req/s | direct p99 (ms) | Tollgate req/s | Tollgate p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for dl, tl in zip(d["levels"], t["levels"], strict=True):
        lines.append(
            f"| {dl['concurrency']} | {dl['requests_per_s']:.0f} | {dl['latency_p99_ms']:.1f} | "
            f"{tl['requests_per_s']:.0f} | {tl['latency_p99_ms']:.1f} |"
        )
    lines.append("")
    lines += _baseline(r)
    lines += _auth(r)
    return lines


def _bus(r: dict[str, Any]) -> list[str]:
    o, c = r["open_bus"], r["closed_bus"]
    lines = [
        "## Bus security: the gateway hop with and without authentication and TLS on NATS",
        "",
        f"Measured {r.get('date', '')}.",
        "",
        "Two stacks side by side, each with its own nats-server, router (API keys on) and "
        "simulated-engine worker (a test double): one on an open bus (plain TCP, no "
        "identities), one on the closed bus as deployed (every service on its own nkey, "
        "permissions derived from the topology, TLS with a certificate the services verify). "
        f"Non-streaming chat completions, {r.get('rounds', 3)} alternating rounds "
        "(`python -m bench --only bus --rounds N`).",
        "",
        "| metric | open bus | closed bus (nkeys + TLS) | closed / open |",
        "|---|---|---|---|",
    ]
    for label, key in (
        ("latency p50 at concurrency 1 (ms)", "latency_p50_ms"),
        ("latency p99 at concurrency 1 (ms)", "latency_p99_ms"),
        ("requests/s at concurrency 1", "requests_per_s"),
    ):
        a, b = o["c1"][key], c["c1"][key]
        lines.append(f"| {label} | {a:.2f} | {b:.2f} | {_ratio(b, a)} |")
    peak_o = max(lv["requests_per_s"] for lv in o["levels"])
    peak_c = max(lv["requests_per_s"] for lv in c["levels"])
    lines.append(f"| peak requests/s | {peak_o:.0f} | {peak_c:.0f} | {_ratio(peak_c, peak_o)} |")
    lines += [
        "",
        "| concurrency | open req/s | open p99 (ms) | closed req/s | closed p99 (ms) |",
        "|---|---|---|---|---|",
    ]
    for ol, cl in zip(o["levels"], c["levels"], strict=True):
        lines.append(
            f"| {ol['concurrency']} | {ol['requests_per_s']:.0f} | {ol['latency_p99_ms']:.1f} | "
            f"{cl['requests_per_s']:.0f} | {cl['latency_p99_ms']:.1f} |"
        )
    lines.append("")
    return lines


def _baseline(r: dict[str, Any]) -> list[str]:
    if "baseline" not in r:
        return []
    new, old = r["tollgate"], r["baseline"]
    rev = r.get("baseline_revision", "baseline")
    rows = [
        f"### This tree vs revision `{rev}`",
        "",
        f"The same gateway measurement for the stack at `{rev}` (router and worker run from "
        "that revision's code, on their own NATS), in the same "
        f"{r.get('rounds', 3)} alternating rounds "
        "(`python -m bench --only gateway --baseline REV --rounds N`).",
        "",
        f"| metric | `{rev}` | this tree | this / `{rev}` |",
        "|---|---|---|---|",
    ]
    for label, key in (
        ("latency p50 at concurrency 1 (ms)", "latency_p50_ms"),
        ("latency p99 at concurrency 1 (ms)", "latency_p99_ms"),
    ):
        a, b = old["c1"][key], new["c1"][key]
        rows.append(f"| {label} | {a:.2f} | {b:.2f} | {_ratio(b, a)} |")
    for ol, nl in zip(old["levels"], new["levels"], strict=True):
        rows.append(
            f"| requests/s at concurrency {nl['concurrency']} | {ol['requests_per_s']:.0f} | "
            f"{nl['requests_per_s']:.0f} | {_ratio(nl['requests_per_s'], ol['requests_per_s'])} |"
        )
    a, b = old["rate_at_p99_50ms"], new["rate_at_p99_50ms"]
    rows += [f"| peak requests/s (p99 ≤ 50 ms) | {a:.0f} | {b:.0f} | {_ratio(b, a)} |", ""]
    return rows


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def _auth(r: dict[str, Any]) -> list[str]:
    if "tollgate_auth_off" not in r:
        return []
    on, off = r["tollgate"], r["tollgate_auth_off"]
    rev = r["revocation_ms"]
    return [
        "## Auth: API-key checks on vs off, and revocation propagation",
        "",
        "The same router code with `TOLLGATE_ROUTER_AUTH=false` beside one that checks every "
        "call's key (JWT signature, whitelist mirror, model access), on the same NATS and "
        "simulated worker, measured in alternating rounds. The key has no limits, so no "
        "shared counter is touched (limits add one NATS KV round trip per limit).",
        "",
        "| metric | auth off | auth on | on / off |",
        "|---|---|---|---|",
        f"| latency p50 at concurrency 1 (ms) | {off['c1']['latency_p50_ms']:.2f} | "
        f"{on['c1']['latency_p50_ms']:.2f} | "
        f"{_ratio(on['c1']['latency_p50_ms'], off['c1']['latency_p50_ms'])} |",
        f"| requests/s at concurrency 1 | {off['c1']['requests_per_s']:.0f} | "
        f"{on['c1']['requests_per_s']:.0f} | "
        f"{_ratio(on['c1']['requests_per_s'], off['c1']['requests_per_s'])} |",
        f"| peak requests/s (p99 ≤ 50 ms) | {off['rate_at_p99_50ms']:.0f} | "
        f"{on['rate_at_p99_50ms']:.0f} | "
        f"{_ratio(on['rate_at_p99_50ms'], off['rate_at_p99_50ms'])} |",
        "",
        f"Revocation: a key revoked in the `tg_keys` bucket is refused by both of two routers "
        f"after p50 {_pct(rev, 50):.1f} ms, p99 {_pct(rev, 99):.1f} ms "
        f"(max {max(rev):.1f} ms, {len(rev)} revocations; measured by polling both routers "
        "until they answer 401).",
        "",
    ]


def _metering(r: dict[str, Any]) -> list[str]:
    ingest, router = r["ingest"], r["router"]
    lag = ingest["lag"]
    off, on = router["off"], router["on"]
    lines = [
        "## Metering: usage events into ClickHouse",
        "",
        f"Measured {r.get('date', '')}. Embedded ClickHouse (chDB) and nats-server on this "
        "machine; the metering service in its own process, batches of up to 5,000 rows.",
        "",
        "| metric | value | baseline | ratio |",
        "|---|---|---|---|",
        f"| events/s from JetStream into ClickHouse ({ingest['events']:,} events waiting) | "
        f"{ingest['ingest_per_s']:,.0f} | {ingest['direct_insert_per_s']:,.0f} (same rows and "
        f"batches inserted directly, no NATS) | "
        f"{_ratio(ingest['ingest_per_s'], ingest['direct_insert_per_s'])} |",
        f"| lag p50, request end to stored row, at 1,000 events/s (ms) | {lag['p50_ms']:.0f} | | |",
        f"| lag p99 (ms) | {lag['p99_ms']:.0f} | | |",
        f"| lag max (ms) | {lag['max_ms']:.0f} | | |",
        f"| metering CPU per 1,000 events (CPU-seconds, all threads) | "
        f"{ingest.get('cpu_s_per_1000_events', float('nan')):.3f} | | |",
        f"| metering CPU share at 1,000 events/s (cores) | "
        f"{ingest.get('cpu_share_at_1000_per_s', float('nan')):.3f} | | |",
        "",
        f"Lag: {lag['sent']:,} events published at a steady 1,000/s, each stamped with its "
        "publish time as its request end; the row's `ingested_at` is when ClickHouse stored "
        f"it ({lag['stored']:,.0f} rows stored). The service collects a batch for up to "
        "1 s after its first event (`TOLLGATE_METERING_BATCH_MAX_WAIT_S`).",
        "",
        "Router latency while the metering service runs vs while it is stopped (usage "
        "events still go to JetStream either way), simulated engine, non-streaming, "
        "alternating rounds:",
        "",
        "| concurrency | metric | metering off | metering on | performance ratio, on vs off |",
        "|---|---|---|---|---|",
    ]
    for level in ("c1", "c8"):
        for key, label, faster in (
            ("latency_p50_ms", "latency p50 (ms)", "lower"),
            ("latency_p99_ms", "latency p99 (ms)", "lower"),
            ("requests_per_s", "requests/s", "higher"),
        ):
            a, b = off[level][key], on[level][key]
            ratio = _ratio(a, b) if faster == "lower" else _ratio(b, a)
            lines.append(f"| {level[1:]} | {label} | {a:.2f} | {b:.2f} | {ratio} |")
    lines += [
        "",
        "Performance ratio: off/on for latencies, on/off for requests/s; 1.000 means no "
        "difference, below 1 means slower with the metering service running.",
        "",
    ]
    return lines


def _scaler(r: dict[str, Any]) -> list[str]:
    lines = [
        "## Scaler: strategies over a simulated day, and cold start from zero",
        "",
        f"Measured {r.get('date', '')}.",
        "",
        "`tollgate scaler simulate` replays the shipped synthetic day "
        "(`services/scaler/traces/synthetic-day.csv`: 0.5 requests/s at night, a morning "
        "ramp to 12/s, a lunch step to 30/s within two minutes, 14/s in the afternoon) with "
        "Poisson arrivals, 8 s mean request time, 32 slots per worker, at most 12 workers, "
        "one decision every 5 s, and the scaler's own policy (target 75% of slots busy, "
        "300 s down-window). The predictive strategy's profile comes from another simulated "
        "day of the same trace, computed as the scaler computes it from ClickHouse. "
        "Replica-hours count a worker from its start until it has drained.",
        "",
    ]
    for key, outcomes in r["simulation"].items():
        startup = key.split("_")[1]
        fixed = outcomes[0]
        lines += [
            f"Worker start-up {startup} s:",
            "",
            "| strategy | replica-hours | vs fixed-max | wait p50 (s) | wait p95 (s) | "
            "wait p99 (s) | max wait (s) | waited > 10 s | scale events |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for o in outcomes:
            share = o["replica_hours"] / fixed["replica_hours"]
            lines.append(
                f"| {o['strategy']} | {o['replica_hours']} | {share:.0%} | {o['wait_p50']} | "
                f"{o['wait_p95']} | {o['wait_p99']} | {o['wait_max']} | "
                f"{o['waited_over']:,} of {o['requests']:,} | {o['scale_events']} |"
            )
        lines.append("")
    lines += [
        "Cold start on this machine: a model at zero workers gets one streamed request; "
        "time from sending it to its first token, divided by the worker's own "
        "time-to-ready (process start to ready, from its heartbeat). The rest is what "
        "scaling adds: noticing the request, starting the process, pulling the request "
        "and generating the first token.",
        "",
        "| engine | run | first token (s) | worker time-to-ready (s) | ratio | added (s) |",
        "|---|---|---|---|---|---|",
    ]
    for engine, rows in r["cold_start"].items():
        for i, row in enumerate(rows, 1):
            ttft, ready = row["first_token_s"], row["time_to_ready_s"]
            lines.append(
                f"| {engine} | {i} | {ttft:.2f} | {ready:.2f} | {_ratio(ttft, ready)} | "
                f"{ttft - ready:+.2f} |"
            )
    lines.append("")
    return lines


def _registry(r: dict[str, Any]) -> list[str]:
    t = r["throughput"]
    mib = t["bytes"] >> 20
    lines = [
        "## Model registry: fetching weights, and time-to-ready",
        "",
        f"Measured {r.get('date', '')}.",
        "",
        f"One {mib} MiB object (uploaded as a multipart object) on a local S3-compatible "
        "server (s3rver, files on disk, on loopback), fetched by Tollgate's S3 adapter with "
        "1 and 8 parallel ranged GETs of 64 MiB, each part hashed (sha256) as it arrives; "
        "side by side with `cp` of the same bytes from disk and `curl` downloading the same "
        "object from the same server. `prepare` is the whole cache path: listing, fetch, "
        "manifest and the rename into the cache. Every method writes into an emptied "
        f"folder; medians of {t['runs']} interleaved runs; the source file stays in the page "
        "cache, so `cp` is a memory copy.",
        "",
        "| method | seconds | MB/s | vs cp | vs curl |",
        "|---|---|---|---|---|",
    ]
    names = {
        "cp": "`cp` (baseline)",
        "curl": "`curl` from the server",
        "tollgate_1": "Tollgate fetch, 1 stream",
        "tollgate_8": "Tollgate fetch, 8 ranged streams",
        "tollgate_prepare": "Tollgate prepare (8 streams, manifest, rename)",
    }

    def row(label: str, m: dict[str, float], cp: float | None, curl: float) -> str:
        vs_cp = _ratio(m["mb_per_s"], cp) if cp else "-"
        return (
            f"| {label} | {m['seconds']:.2f} | {m['mb_per_s']:.0f} | {vs_cp} | "
            f"{_ratio(m['mb_per_s'], curl)} |"
        )

    for key, label in names.items():
        lines.append(row(label, t[key], t["cp"]["mb_per_s"], t["curl"]["mb_per_s"]))
    cold = t.get("cold")
    if cold:
        lines += [
            "",
            "The same with the page cache dropped before every run, as for weights too large "
            "to stay in memory (the server and `cp` both read the disk; medians of "
            f"{cold['runs']}):",
            "",
            "| method | seconds | MB/s | vs cp | vs curl |",
            "|---|---|---|---|---|",
        ]
        for key, label in names.items():
            lines.append(row(label, cold[key], cold["cp"]["mb_per_s"], cold["curl"]["mb_per_s"]))
    held = t["per_connection"]
    lines += [
        "",
        "An object store holds each connection to its own bandwidth (tens of MB/s on "
        "S3); parallel ranged GETs are what gets past that. The same server behind a "
        f"proxy that holds every connection to {held['bytes_per_s'] / 1e6:.0f} MB/s:",
        "",
        "| method | seconds | MB/s | vs cp | vs curl |",
        "|---|---|---|---|---|",
    ]
    for key in ("curl", "tollgate_1", "tollgate_8"):
        lines.append(row(names[key], held[key], None, held["curl"]["mb_per_s"]))
    lines += [
        "",
        "A vLLM worker serving SmolLM2-135M-Instruct from `s3://` (the packaged GGUF "
        "uploaded to moto, the tests' S3 server): cold = empty cache (fetch the GGUF, "
        "convert it to safetensors, load the engine, one warm-up request), warm = the "
        "same cache. Parts as the worker reports them in its ready heartbeat; `process` "
        "is the interpreter and imports before the worker's own code runs.",
        "",
        "| run | total (s) | process | fetch | convert | engine | warm-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in r["time_to_ready"]:
        parts = [run.get(k, 0.0) for k in ("process", "fetch", "convert", "engine", "warmup")]
        shown = " | ".join(f"{p:.2f}" for p in parts)
        lines.append(f"| {run['run']} | {run['total_s']:.1f} | {shown} |")
    lines.append("")
    return lines


def _control(r: dict[str, Any]) -> list[str]:
    from bench.control_plane import render

    return [*render(r).splitlines(), ""]


def _lasting_budget(r: dict[str, Any]) -> str:
    """The budget that lasts: its counter beside its billed tokens, every call settled."""
    lasting = r.get("lasting_budget")
    if not lasting or lasting.get("router_counter") is None:
        return ""
    difference = lasting["router_counter_minus_billed"]
    return (
        f"A second budget, too large to run out, was billed {lasting['billed_tokens']} tokens "
        f"over {lasting['calls_billed']} calls, through every fault; the routers' counter of "
        f"it held {lasting['router_counter']} once every call was settled ("
        + (
            "the billed tokens exactly: no settlement lost or made twice). "
            if difference == 0
            else f"{difference:+d} against the billed tokens). "
        )
    )


def _soak(r: dict[str, Any]) -> list[str]:
    faults = ", ".join(f"{f['name']} ({f['recovery_s']} s)" for f in r["faults"])
    lines = [
        "## Soak: faults one after another under steady load",
        "",
        f"Measured {r.get('date', '')} with `{r.get('command', 'make soak')}` "
        "(`python -m bench.soak`): `tollgate up` with "
        f"{r['routers']} routers and {r['workers']} simulated-engine workers across two models, "
        f"{r['concurrency']} clients sending stream and non-stream chat, completions and "
        "streams they hang up, with an unlimited key, a key with a token budget that runs "
        "out, one with a budget that lasts, a rate-limited key and a key revoked part-way; "
        "one fault at a time, each listed with "
        "the time until the stack had recovered from it:",
        "",
        f"{faults}.",
        "",
        "| | count |",
        "|---|---|",
        f"| calls sent | {r['sent']} |",
        f"| accepted (the router gave the call a request id and did not refuse it) "
        f"| {r['accepted']} |",
        f"| accepted and answered in full | {r['completed_by_client']} |",
        f"| sent again to the other router after a refused connection "
        f"| {r['calls_retried_on_connect']} |",
    ]
    for reason, n in r["refused"].items():
        lines.append(f"| refused: {reason} | {n} |")
    for kind, causes in r["errors"].items():
        cause = ", ".join(f"{c}: {n}" for c, n in causes.items())
        lines.append(f"| error {kind} (by the fault in flight) | {cause} |")
    lines += [
        f"| usage rows | {r['rows']} |",
        f"| accepted calls with their row | {r['rows_for_accepted']} |",
        f"| accepted calls without a row | {r['missing_rows']} "
        f"({', '.join(f'{k}: {v}' for k, v in r['missing_rows_by_fault'].items()) or '-'}) |",
        f"| duplicate rows | {r['duplicates']} |",
        f"| calls cut off before their response began (no request id) "
        f"| {r.get('calls_cut_before_response', 0)} |",
        f"| rows of calls the clients have no id for (of those) / of refused calls "
        f"| {r['extra_rows']} / {r['refused_with_rows']} |",
        f"| rows whose tokens differ from the engine's counts | {r['token_mismatches']} |",
        f"| final reports lost (neither acknowledged nor kept; during faults) "
        f"| {r.get('final_reports_lost', 0)} |",
        f"| tokens billed (prompt / completion) | {r['tokens']['prompt']} / "
        f"{r['tokens']['completion']} |",
        "",
        f"Rows by outcome: {', '.join(f'{k} {v}' for k, v in r['rows_by_outcome'].items())}. "
        "A router killed mid-call bills that call when it starts again, from the worker's "
        "final report or, without one, at zero tokens once the call's deadline "
        f"({REQUEST_TIMEOUT_S} s in the soak) and 30 s have passed (`router_lost`); before "
        "it reads the rows, the run waits until no router's outbox holds an unpublished "
        "event, an open call or an unmade settlement.",
        "",
        f"Budget: {r['budget']['billed_tokens']} tokens billed against a budget of "
        f"{r['budget']['budget_tokens']}; at most {r['budget']['max_calls_in_flight']} calls of "
        f"that key were in flight, each reserving up to {r['budget']['worst_case_per_call']}. "
        + _lasting_budget(r)
        + f"Rate limit: at most {r['rate']['max_accepted_in_a_minute']} calls accepted in one "
        f"minute for a limit of {r['rate']['rpm']}"
        + (
            f" ({r['rate']['max_in_a_minute_nats_restarted']} in the minute NATS restarted: "
            "the per-minute counters are kept in NATS memory, and a restart forgets them)"
            if r["rate"].get("max_in_a_minute_nats_restarted")
            else ""
        )
        + ". Revocation: "
        f"{r['revocation']['accepted_after_grace']} calls accepted after it had propagated, "
        f"{r['revocation']['refused_401']} refused with 401.",
        "",
        "Memory and open files of each service's longest-lived process, sampled every 10 s:",
        "",
        "| process | span (s) | RSS first / last / max (MB) | open files first / last / max |",
        "|---|---|---|---|",
    ]
    for role, m in r["memory"].items():
        lines.append(
            f"| {role} | {m['span_s']} | {m['rss_first_mb']} / {m['rss_last_mb']} / "
            f"{m['rss_max_mb']} | {m['fds_first']} / {m['fds_last']} / {m['fds_max']} |"
        )
    lines += [
        "",
        "The metering service's open files follow the threads of its embedded ClickHouse "
        "engine, not the rows it stores: each engine thread that has run part of an "
        "insert or a query keeps three files of its own open for its counters "
        "(`/proc/self/task/<tid>/stat`, `schedstat` and `io`), so they stop at three a "
        "thread. Measured alone (2026-12-07: the metering store inserting 36 rows a "
        "second for 16 minutes), its open files rose from 53 to 191 while its threads "
        "stayed at 151, one set of three per thread that had worked.",
        "",
        f"Processes left after the run: {len(r['orphans'])}. "
        + (
            "Invariants: all held."
            if not r["problems"]
            else "Problems: " + "; ".join(r["problems"]) + "."
        ),
        "",
    ]
    for text in r.get("stale_instance_reports", []):
        lines += [
            "What `tollgate up` said after the `kill -9` of the previous one:",
            "",
            "```",
            text,
            "```",
            "",
        ]
    return lines


def _times(a: float, b: float) -> str:
    return f"{a / b:.1f} times" if b else "n/a"


def _fairness(r: dict[str, Any]) -> list[str]:
    q, hop = r["quiet"], r["hop"]
    lines = [
        "## Fair share: a quiet tenant beside a noisy one, first come first served vs fair share",
        "",
        f"Measured {r.get('date', '')} with `python -m bench --only fairness`: nats-server with "
        "Tollgate's identities and TLS, one router, and two simulated-engine workers (a test "
        f"double: {r['slots']} slots, {r['tokens_per_s']} tokens/s, no time to first token), "
        "each on its own model: one takes requests by fair share, the other oldest first "
        "(`TOLLGATE_WORKER_FAIR_SHARE=false`). Only the model measured has load; the two "
        f"alternate over {r['rounds']} round(s). The quiet tenant makes one streamed call at a "
        f"time ({r['quiet_max_tokens']} tokens, about two seconds); the noisy tenant keeps "
        f"{r['noisy_concurrency']} calls in flight (ten times the slots), of "
        f"{r['noisy_max_tokens'][0]} to {r['noisy_max_tokens'][1]} tokens. TTFT is the quiet "
        "call's first content delta at the client; queue wait is the router's own `queue_s` "
        "of the call (published to the work queue until its worker starts it), read from the "
        "router's log by the call's `x-request-id`.",
        "",
        "| quiet tenant | calls | TTFT p50 (ms) | TTFT p95 (ms) | queue wait p50 (ms) "
        "| queue wait p95 (ms) | call p50 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, label in (
        ("alone_fair", "alone, fair share"),
        ("alone_fifo", "alone, first come first served"),
        ("noisy_fifo", "beside the noisy tenant, first come first served"),
        ("noisy_fair", "beside the noisy tenant, fair share"),
    ):
        s = q[key]
        lines.append(
            f"| {label} | {s['requests']} | {s['ttft_p50_ms']:.0f} | {s['ttft_p95_ms']:.0f} | "
            f"{s['queue_p50_ms']:.0f} | {s['queue_p95_ms']:.0f} | {s['latency_p50_ms']:.0f} |"
        )
    noisy = r["noisy"]
    lines += [
        "",
        f"Beside the noisy tenant, the quiet tenant's TTFT p95 is "
        f"{_times(q['noisy_fifo']['ttft_p95_ms'], q['alone_fifo']['ttft_p95_ms'])} its "
        "own alone under first come first served and "
        f"{_times(q['noisy_fair']['ttft_p95_ms'], q['alone_fair']['ttft_p95_ms'])} under "
        "fair share. Under first come first served its call waits behind the whole noisy "
        "backlog; under fair share only for the next slot to free, whatever the backlog. "
        "Meanwhile the noisy tenant had "
        f"{noisy['fifo']['answered_per_s']:.1f} calls/s answered under first come first served "
        f"and {noisy['fair']['answered_per_s']:.1f} under fair share (one slot of "
        f"{r['slots']} is the quiet tenant's while its call runs); refused calls: "
        f"{noisy['fifo']['refused']} and {noisy['fair']['refused']}.",
        "",
        "The price of fair share when there is nothing to share: the quiet tenant alone, one "
        "non-streamed one-token call at a time (a worker with fair share picks a lane from "
        "counts it keeps from the routers' arrivals, read again from NATS every second, "
        "then claims as a worker without fair share does):",
        "",
        "| | calls | latency p50 (ms) | latency p99 (ms) |",
        "|---|---|---|---|",
    ]
    for key, label in (("fair", "fair share on"), ("fifo", "fair share off")):
        h = hop[key]
        lines.append(
            f"| {label} | {h['requests']} | {h['latency_p50_ms']:.2f} | {h['latency_p99_ms']:.2f} |"
        )
    lines += [
        "",
        f"p50 ratio on / off: {hop['p50_ratio_on_off']:.3f}.",
        "",
        "The engine here is a test double on the CPU and the load generator shares the "
        "machine's cores: the figures show how the queue is ordered, not what a GPU serves. On "
        "a GPU the engine's own time (prefill, decoding) dominates a call, and the hop's few "
        "milliseconds matter less still.",
        "",
    ]
    return lines


def write_report(results: dict[str, Any], path: Path) -> None:
    lines = [
        "# Benchmarks",
        "",
        "Every figure below comes from `make bench` (`python -m bench`; `--only gateway`,",
        "`--only bus`, `--only inference`, `--only metering`, `--only scaler`,",
        "`--only registry`, `--only control`, `--only fairness`, `--only routing`,",
        "`--only stack`, `--only embeddings` or `--only messages` reruns one part), with each",
        "system and its baseline measured side by side in the same run. Performance is never",
        "asserted in the test suite; it is measured here.",
        "",
        f"- Machine: {results['machine']}",
        f"- Command: `{results['command']}`",
        "",
    ]
    earlier = _sections(path.read_text()) if path.exists() else []
    for part, render in _PARTS.items():
        if part in results:
            lines += render(results[part])
        else:  # not measured in this run: keep what the page had
            titles = _PART_TITLES[part]
            for title, text in earlier:
                if title.startswith(titles):
                    lines += text
    path.write_text("\n".join(lines))


_PARTS = {
    "inference": _inference,
    "gateway": _gateway,
    "bus": _bus,
    "metering": _metering,
    "scaler": _scaler,
    "registry": _registry,
    "control": _control,
    "fairness": _fairness,
    "routing": _routing,
    "stack": _stack,
    "embeddings": _embeddings,
    "messages": _messages,
    "soak": _soak,
}
_PART_TITLES = {
    "inference": ("Inference",),
    "gateway": ("Gateway", "Auth"),
    "bus": ("Bus security",),
    "metering": ("Metering",),
    "scaler": ("Scaler",),
    "registry": ("Model registry",),
    "control": ("Control plane",),
    "fairness": ("Fair share",),
    "routing": ("Cache-aware routing",),
    "stack": ("Stack",),
    "embeddings": ("Embeddings",),
    "messages": ("Anthropic Messages API",),
    "soak": ("Soak",),
}


def _sections(text: str) -> list[tuple[str, list[str]]]:
    """The page's ``## `` sections: (title, lines) in order."""
    found: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        if line.startswith("## "):
            found.append((line[3:], []))
        if found:
            found[-1][1].append(line)
    return found
