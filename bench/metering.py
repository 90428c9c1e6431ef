"""Metering: usage events from JetStream into ClickHouse, measured.

1. Ingest rate: N events already in the usage stream; the metering service
   starts and drains them into the embedded ClickHouse. Baseline: the same
   rows inserted straight into ClickHouse in the same batch size, without
   NATS (the ceiling of the engine on this machine).
2. Lag: events published at a steady 1,000/s; for each row, from the event's
   time (the request's end) to ``ingested_at`` (when ClickHouse stored it).
3. Router latency with the metering service running vs stopped, alternating
   rounds, on the simulated engine.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families

from bench import procs as P
from bench.load import RunStats, run_load
from tollgate.analytics import run_query
from tollgate.wire import bus
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SUBJECTS = Subjects()
BATCH = 5000


def event(i: int, tenant: str, at: float) -> dict[str, Any]:
    return {
        "type": "tg.usage.v1",
        "request_id": uuid.uuid4().hex,
        "time": at,
        "tenant": tenant,
        "key_id": f"key-{i % 50}",
        "model": ("SmolLM2-135M-Instruct", "sim/bench")[i % 2],
        "worker_id": "bench-worker",
        "prompt_tokens": 20 + i % 300,
        "completion_tokens": i % 512,
        "outcome": "completed",
        "finish_reason": "stop",
        "streamed": bool(i % 2),
        "queue_s": 0.001,
        "ttft_s": 0.02,
        "total_s": 0.4,
        "http_status": 200,
    }


async def publish_all(nats: str, events: list[dict[str, Any]]) -> float:
    """Publish with a window of acks in flight; the publish rate."""
    nc = await bus.connect(nats, "bench-publish")
    js = nc.jetstream()
    await Topology(SUBJECTS).ensure_stream(js, Topology(SUBJECTS).usage)
    started = time.perf_counter()
    window = 2000
    for start in range(0, len(events), window):
        await asyncio.gather(
            *(
                js.publish(
                    SUBJECTS.usage(e["tenant"]),
                    orjson.dumps(e),
                    headers={"Nats-Msg-Id": e["request_id"]},
                )
                for e in events[start : start + window]
            )
        )
    rate = len(events) / (time.perf_counter() - started)
    await nc.close()
    return rate


async def publish_paced(nats: str, tenant: str, rate: int, seconds: float) -> int:
    """``rate`` events/s for ``seconds``, each stamped with its publish time."""
    nc = await bus.connect(nats, "bench-paced")
    js = nc.jetstream()
    tick = 0.01
    per_tick = max(1, round(rate * tick))
    sent = 0
    started = time.perf_counter()
    pending: list[asyncio.Future[Any]] = []
    while time.perf_counter() - started < seconds:
        due = started + (sent // per_tick + 1) * tick
        for _ in range(per_tick):
            e = event(sent, tenant, time.time())
            pending.append(
                asyncio.ensure_future(
                    js.publish(
                        SUBJECTS.usage(tenant),
                        orjson.dumps(e),
                        headers={"Nats-Msg-Id": e["request_id"]},
                    )
                )
            )
            sent += 1
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
    await asyncio.gather(*pending)
    await nc.close()
    return sent


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise KeyError(name)


def direct_insert_rate(events: list[dict[str, Any]]) -> float:
    """The same rows into a fresh embedded ClickHouse, no NATS: rows/s."""
    from services.metering.ingest import to_row
    from services.metering.store import UsageStore

    with tempfile.TemporaryDirectory(prefix="tollgate-ch-") as tmp:
        store = UsageStore(f"chdb://{tmp}", "bench").open()
        store.migrate()
        now = time.time()
        started = time.perf_counter()
        for start in range(0, len(events), BATCH):
            batch = events[start : start + BATCH]
            rows = [to_row(orjson.dumps(e), start + i, now) for i, e in enumerate(batch)]
            times = [r["time"] for r in rows]
            store.existing_ids([r["request_id"] for r in rows], min(times), max(times))
            store.insert(rows)
        rate = len(events) / (time.perf_counter() - started)
        store.close()
    return rate


def start_metering(procs: P.Procs, nats: str, dsn: str) -> tuple[Any, str]:
    port = P.free_port()
    procs.env["TOLLGATE_NATS_URL"] = nats
    proc = procs.spawn(
        f"metering-{port}",
        [sys.executable, "-m", "services.metering", "--port", str(port)],
        TOLLGATE_METERING_CLICKHOUSE_DSN=dsn,
    )
    url = f"http://127.0.0.1:{port}"
    P.wait_http(f"{url}/readyz", 60)
    return proc, url


async def caught_up(nats: str, timeout: float = 300) -> None:
    nc = await bus.connect(nats, "bench-lag")
    js = nc.jetstream()
    try:
        async with asyncio.timeout(timeout):
            while True:
                info = await js.consumer_info(SUBJECTS.usage_stream, "metering")
                if info.num_pending == 0 and info.num_ack_pending == 0:
                    return
                await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def lag_quantiles(nats: str, tenant: str) -> list[float]:
    nc = await bus.connect(nats, "bench-query")
    try:
        result = await run_query(
            nc,
            SUBJECTS,
            "SELECT count(), quantilesExact(0.5, 0.99, 1)("
            "toUnixTimestamp64Milli(ingested_at) - toUnixTimestamp64Milli(time))"
            " FROM usage_events WHERE tenant = {t:String}",
            {"t": tenant},
        )
    finally:
        await nc.close()
    assert result.error is None, result.error
    count, (p50, p99, worst) = result.rows[0]
    return [float(count), float(p50), float(p99), float(worst)]


def bench_ingest(work: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    n = 50_000 if quick else 200_000
    base = time.time() - 3600
    events = [event(i, f"tenant-{i % 20}", base + i * 0.001) for i in range(n)]
    print(f"metering: baseline, {n} rows straight into ClickHouse", flush=True)
    direct = direct_insert_rate(events)
    out: dict[str, Any] = {"events": n, "direct_insert_per_s": direct}
    with P.processes(work, env) as procs:
        nats = P.start_nats(procs)
        out["publish_per_s"] = asyncio.run(publish_all(nats, events))
        print(f"metering: {n} events in the stream; starting the service", flush=True)
        started = time.perf_counter()
        proc, url = start_metering(procs, nats, f"chdb://{work / 'clickhouse-ingest'}")
        ready = time.perf_counter()
        while metric(url, "tollgate_metering_events_inserted_total") < n:
            time.sleep(0.05)
        done = time.perf_counter()
        out["ingest_per_s"] = n / (done - ready)
        out["service_start_s"] = ready - started
        seconds = 10 if quick else 30
        print(f"metering: lag at 1,000 events/s for {seconds} s", flush=True)
        cpu_before, wall_before = cpu_seconds(proc.pid), time.perf_counter()
        sent = asyncio.run(publish_paced(nats, "lag", 1000, seconds))
        asyncio.run(caught_up(nats))
        out["cpu_s_per_1000_events"] = 1000 * (cpu_seconds(proc.pid) - cpu_before) / sent
        out["cpu_share_at_1000_per_s"] = (cpu_seconds(proc.pid) - cpu_before) / (
            time.perf_counter() - wall_before
        )
        count, p50, p99, worst = asyncio.run(lag_quantiles(nats, "lag"))
        out["lag"] = {"sent": sent, "stored": count, "p50_ms": p50, "p99_ms": p99, "max_ms": worst}
    print(f"  {out}", flush=True)
    return out


def bench_router_overhead(
    work: Path, env: dict[str, str], quick: bool, sim_body: dict[str, Any], rounds: int = 4
) -> dict[str, Any]:
    """Router latency while the metering service runs vs while it is stopped."""
    print("metering: router latency with the metering service on vs off", flush=True)
    n = 300 if quick else 600
    merged: dict[tuple[str, int], RunStats] = {}
    with P.processes(work, env) as procs:
        nats = P.start_nats(procs)
        headers = P.api_key(nats, work)
        router = P.start_router(procs, nats)
        P.start_worker(procs, nats, sim_body["model"])
        url = f"{router}/v1/chat/completions"
        asyncio.run(run_load(url, [sim_body] * 100, 4, stream=False, headers=headers))
        dsn = f"chdb://{work / 'clickhouse-overhead'}"
        for _ in range(rounds):
            for state in ("off", "on"):
                proc = None
                if state == "on":
                    proc, _ = start_metering(procs, nats, dsn)
                    # Steady state: the backlog of the "off" round stored, and
                    # ClickHouse's merges of those parts done.
                    asyncio.run(caught_up(nats))
                    time.sleep(3)
                for concurrency in (1, 8):
                    stats = asyncio.run(
                        run_load(url, [sim_body] * n, concurrency, stream=False, headers=headers)
                    )
                    into = merged.setdefault((state, concurrency), RunStats())
                    into.samples += stats.samples
                    into.errors += stats.errors
                    into.wall += stats.wall
                if proc is not None:
                    procs.stop(proc)
    out = {
        state: {f"c{c}": merged[(state, c)].summary() for c in (1, 8)} for state in ("off", "on")
    }
    print(f"  {out}", flush=True)
    return out
