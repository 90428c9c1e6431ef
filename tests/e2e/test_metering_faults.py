"""Exactly one usage row per accepted request, proven by injecting faults.

A whole stack runs here on its own nats-server (the tests stop and restart
it): router, simulated-engine workers, and the metering service writing to an
embedded ClickHouse. Each scenario sends 500 requests with a mix of endings
(completed, length, stop, client disconnect mid-stream, a worker killed with
SIGKILL mid-stream, no worker before the queue timeout) under its own tenant,
injects one fault, and then compares ClickHouse with what happened, request
by request:

- completed requests: the engine's counts, as the client got them in `usage`;
- client disconnects: the counts the worker's engine logged for the request;
- the killed worker's requests: the tokens the client received;
- no worker in time: zero tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import (
    CATALOG,
    METER_MODEL,
    ORPHAN_MODEL,
    VICTIM_MODEL,
    NatsServer,
    Service,
    Stack,
    free_port,
    wait_ready,
)
from tests.lib.streams import read_subject
from tests.router.test_auth import make_key, wait_status
from tollgate.analytics import run_query
from tollgate.keys.store import bootstrap
from tollgate.wire.contracts import QueryResult
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

TOTAL = 500
DISCONNECTS = 50
VICTIMS = 10
ORPHANS = 10
MESSAGES = [{"role": "user", "content": "count the tokens of this reply, please"}]


@dataclass
class Expected:
    """What one request must be billed."""

    request_id: str
    kind: str
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    delivered: int = 0  # content tokens the client received


@dataclass
class MeterStack:
    stack: Stack
    router_url: str
    metering: Service
    metering_url: str
    meter_workers: list[Service]
    model_cache: str
    subjects: Subjects = field(default_factory=Subjects)

    async def query(self, sql: str, **parameters: Any) -> QueryResult:
        nc = await self.stack.nats.connect(name="test-query")
        try:
            result = await run_query(nc, self.subjects, sql, parameters, timeout=30)
        finally:
            await nc.close()
        assert result.error is None, result.error
        return result

    def start_metering(self) -> None:
        self.metering, self.metering_url = self.stack.metering(
            TOLLGATE_METERING_BATCH_MAX_WAIT_S="0.3"
        )

    async def metric(self, name: str) -> float:
        async with httpx.AsyncClient() as http:
            text = (await http.get(f"{self.metering_url}/metrics")).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name:
                    return float(sample.value)
        raise KeyError(name)


@pytest.fixture(scope="module")
async def meter_stack(
    tmp_path_factory: pytest.TempPathFactory, prepared_model: Path
) -> AsyncIterator[MeterStack]:
    nats = NatsServer(free_port(), tmp_path_factory.mktemp("meter-nats"))
    nats.start()
    var = tmp_path_factory.mktemp("meter-var")
    (var / "models.toml").write_text(CATALOG)
    stack = Stack(nats, var)
    cache = str(prepared_model.parent.parent)
    nc = await nats.connect(name="test-bootstrap")
    await bootstrap(nc.jetstream(), Topology(Subjects()), var)
    await nc.close()
    try:
        _, router_url = stack.router(
            TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="3", TOLLGATE_ROUTER_RETRY_AFTER_S="1"
        )
        metering, metering_url = stack.metering(TOLLGATE_METERING_BATCH_MAX_WAIT_S="0.3")
        workers = [stack.worker(METER_MODEL, TOLLGATE_MODEL_CACHE=cache) for _ in range(2)]
        await wait_ready(nats, METER_MODEL, count=2)
        yield MeterStack(stack, router_url, metering, metering_url, workers, cache)
    finally:
        stack.stop_all()
        nats.stop()


async def tenant_key(ms: MeterStack, tenant: str) -> str:
    token, _ = await make_key(ms.stack, tenant=tenant, name="metering faults")
    await wait_status(ms.router_url, token, 200)  # the router has seen the key
    return token


def sse_events(lines: list[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.append(orjson.loads(line[6:]))
    return out


def content_chunks(events: list[dict[str, Any]]) -> int:
    return sum(
        1 for e in events for c in e.get("choices") or [] if (c.get("delta") or {}).get("content")
    )


class Mix:
    """Sends one scenario's 500 requests and records what each must be billed."""

    def __init__(self, ms: MeterStack, key: str, seed: int) -> None:
        self.ms = ms
        self.headers = {"Authorization": f"Bearer {key}"}
        self.rng = random.Random(seed)
        self.expected: dict[str, Expected] = {}
        self.done = 0
        self.victims_streaming = 0
        self.victims_ready = asyncio.Event()
        self.prompt_tokens: int | None = None
        self._waiters: list[tuple[int, asyncio.Event]] = []

    def _record(self, exp: Expected) -> None:
        assert exp.request_id not in self.expected
        self.expected[exp.request_id] = exp
        self.done += 1
        for count, event in self._waiters:
            if self.done >= count:
                event.set()

    async def reached(self, count: int) -> None:
        """Until ``count`` requests have finished."""
        event = asyncio.Event()
        self._waiters.append((count, event))
        if self.done >= count:
            event.set()
        await event.wait()

    async def full(self, http: httpx.AsyncClient, max_tokens: int) -> None:
        body = {"model": METER_MODEL, "messages": MESSAGES, "max_tokens": max_tokens}
        r = await http.post("/v1/chat/completions", json=body)
        rid = r.headers["x-request-id"]
        if r.status_code == 200:
            usage = r.json()["usage"]
            self.prompt_tokens = usage["prompt_tokens"]
            self._record(Expected(rid, "full", usage["prompt_tokens"], usage["completion_tokens"]))
        else:  # a fault made it fail after dispatch: billed what the worker reported
            self._record(Expected(rid, f"failed-{r.status_code}"))

    async def stream(self, http: httpx.AsyncClient, max_tokens: int) -> None:
        body = {
            "model": METER_MODEL,
            "messages": MESSAGES,
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            lines = [line async for line in r.aiter_lines()]
        events = sse_events(lines)
        usage = next((e["usage"] for e in events if e.get("usage")), None)
        if r.status_code == 200 and usage is not None:
            exp = Expected(rid, "stream", usage["prompt_tokens"], usage["completion_tokens"])
        else:
            exp = Expected(rid, f"failed-{r.status_code}")
        exp.delivered = content_chunks(events)
        self._record(exp)

    async def disconnect(self, http: httpx.AsyncClient) -> None:
        body = {"model": METER_MODEL, "messages": MESSAGES, "max_tokens": 400, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    seen += content_chunks([orjson.loads(line[6:])])
                if seen >= 5:
                    break  # hang up mid-stream
        self._record(Expected(rid, "disconnect" if seen >= 5 else f"failed-{r.status_code}"))

    async def victim(self, http: httpx.AsyncClient) -> None:
        body = {"model": VICTIM_MODEL, "messages": MESSAGES, "stream": True, "max_tokens": 900}
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            events: list[dict[str, Any]] = []
            counted = False
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    events.append(orjson.loads(line[6:]))
                if not counted and content_chunks(events) >= 3:
                    counted = True
                    self.victims_streaming += 1
                    if self.victims_streaming == VICTIMS:
                        self.victims_ready.set()
        assert any("error" in e for e in events), "the stream must end with worker_lost"
        self._record(Expected(rid, "victim", delivered=content_chunks(events)))

    async def orphan(self, http: httpx.AsyncClient) -> None:
        body = {"model": ORPHAN_MODEL, "messages": MESSAGES, "max_tokens": 5}
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 503
        self._record(Expected(r.headers["x-request-id"], "orphan", 0, 0))

    async def run(self, fault: Callable[[Mix], Awaitable[None]] | None = None) -> None:
        """All 500 requests, 32 at a time, with ``fault`` injected alongside."""
        kinds = ["victim"] * VICTIMS + ["orphan"] * ORPHANS + ["disconnect"] * DISCONNECTS
        rest = TOTAL - len(kinds)
        kinds += ["full"] * (rest // 2) + ["stream"] * (rest - rest // 2)
        self.rng.shuffle(kinds)
        kinds.sort(key=lambda k: k != "victim")  # victims first: they stream while others run
        gate = asyncio.Semaphore(32 + VICTIMS)
        victim_worker = self.ms.stack.worker(VICTIM_MODEL, TOLLGATE_MODEL_CACHE=self.ms.model_cache)
        await wait_ready(self.ms.stack.nats, VICTIM_MODEL)
        timeout = httpx.Timeout(60, connect=10)
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(
            base_url=self.ms.router_url, headers=self.headers, timeout=timeout, limits=limits
        ) as http:

            async def one(kind: str) -> None:
                async with gate:
                    if kind in ("full", "stream"):
                        # 1..60 tokens: below 40 ends on length, above on stop.
                        await getattr(self, kind)(http, self.rng.randint(1, 60))
                    else:
                        await getattr(self, kind)(http)

            async def kill_victim() -> None:
                await asyncio.wait_for(self.victims_ready.wait(), 60)
                victim_worker.stop(signal.SIGKILL)

            tasks = [asyncio.create_task(one(k)) for k in kinds]
            side = [asyncio.create_task(kill_victim())]
            if fault is not None:
                side.append(asyncio.create_task(fault(self)))
            await asyncio.gather(*tasks, *side)
        assert self.done == TOTAL

    def engine_reports(self) -> dict[str, tuple[int, int]]:
        """(prompt, completion) per request, from the workers' "request done" logs."""
        reports = {}
        for worker in self.ms.meter_workers:
            for line in worker.log_text().splitlines():
                with contextlib.suppress(ValueError):
                    entry = orjson.loads(line)
                    if entry.get("msg") == "request done" and "request_id" in entry:
                        reports[entry["request_id"]] = (
                            entry["prompt_tokens"],
                            entry["completion_tokens"],
                        )
        return reports


async def settle(ms: MeterStack, tenant: str, want: int, timeout: float = 90) -> None:
    """Until the tenant has ``want`` rows and the metering consumer has nothing pending."""
    nc = await ms.stack.nats.connect(name="test-settle")
    js = nc.jetstream()
    state: tuple[Any, ...] = ()
    try:
        async with asyncio.timeout(timeout):
            while True:
                with contextlib.suppress(Exception):
                    info = await js.consumer_info(ms.subjects.usage_stream, "metering")
                    result = await ms.query(
                        "SELECT count() FROM usage_events WHERE tenant = {t:String}", t=tenant
                    )
                    state = (info.num_pending, info.num_ack_pending, result.rows[0][0])
                    if state[:2] == (0, 0) and state[2] >= want:
                        return
                await asyncio.sleep(0.25)
    except TimeoutError:
        raise AssertionError(f"not settled: (pending, ack pending, rows) = {state}") from None
    finally:
        await nc.close()


async def check_exactly_once(ms: MeterStack, mix: Mix, tenant: str) -> None:
    with contextlib.suppress(AssertionError):  # the row comparison below says what is off
        await settle(ms, tenant, TOTAL)
    result = await ms.query(
        "SELECT request_id, prompt_tokens, completion_tokens, outcome, http_status"
        " FROM usage_events WHERE tenant = {t:String}",
        t=tenant,
    )
    rows = {r[0]: r for r in result.rows}
    missing = [mix.expected[rid] for rid in set(mix.expected) - set(rows)]
    assert not missing, f"every accepted request has its row; missing: {missing}"
    assert len(result.rows) == TOTAL, "one row per request, none doubled"
    assert set(rows) == set(mix.expected)

    outcomes: dict[str, int] = {}
    for row in result.rows:
        outcomes[row[3]] = outcomes.get(row[3], 0) + 1
    print(f"{tenant}: {TOTAL} rows by outcome {dict(sorted(outcomes.items()))}")
    engine = mix.engine_reports()
    for rid, exp in mix.expected.items():
        _, prompt, completion, outcome, status = rows[rid]
        where = (exp, outcome, status, prompt, completion)
        if outcome == "completed" and exp.kind in ("full", "stream"):
            # The engine's own counts, as the client got them.
            assert (prompt, completion) == (exp.prompt_tokens, exp.completion_tokens), where
        elif outcome == "completed":
            # A hang-up after the router had written the whole reply (chunks
            # that arrive in a burst, on a busy host or after a NATS outage):
            # a completed request, billed the engine's counts.
            assert exp.kind == "disconnect", where
            assert (prompt, completion) == engine[rid], where
        elif outcome == "worker_lost":
            # No final report from the worker: what the router relayed.
            assert completion == exp.delivered and prompt in (0, mix.prompt_tokens), where
        elif outcome in ("client_disconnected", "cancelled", "deadline_exceeded"):
            # The worker's final report of what its engine generated.
            assert (prompt, completion) == engine.get(rid, (0, 0)), where
        else:  # never reached a worker: nothing generated
            assert (prompt, completion) == (0, 0) and status >= 500, where
        if exp.kind == "victim":
            assert outcome == "worker_lost" and completion >= 3, where
        elif exp.kind == "disconnect":
            assert completion >= 5, where
            assert outcome in ("client_disconnected", "completed"), where
        elif exp.kind == "orphan":
            assert status == 503, where

    sums = await ms.query(
        "SELECT sum(requests), sum(prompt_tokens), sum(completion_tokens)"
        " FROM usage_hourly WHERE tenant = {t:String}",
        t=tenant,
    )
    raw = [TOTAL, sum(r[1] for r in result.rows), sum(r[2] for r in result.rows)]
    assert sums.rows[0] == raw, "the rollups count every row once"


async def test_every_ending_yields_exactly_one_row(meter_stack: MeterStack) -> None:
    ms = meter_stack
    tenant = "faults-none"
    mix = Mix(ms, await tenant_key(ms, tenant), seed=1)

    async def malformed(mix: Mix) -> None:
        # Garbage on the usage subject, among the real events.
        nc = await ms.stack.nats.connect(name="test-garbage")
        js = nc.jetstream()
        for body in (b"not json", b'{"type": "tg.usage.v1"}', b"[]"):
            await mix.reached(100)
            await js.publish(ms.subjects.usage(tenant), body)
        await nc.close()

    before = await ms.metric("tollgate_metering_events_dead_lettered_total")
    await mix.run(malformed)
    assert not [e for e in mix.expected.values() if e.kind.startswith("failed")]
    await check_exactly_once(ms, mix, tenant)
    assert await ms.metric("tollgate_metering_events_dead_lettered_total") == before + 3

    # The same events published twice: with the same message id (the stream
    # drops them) and as new messages (the metering service skips them).
    nc = await ms.stack.nats.connect(name="test-replay")
    js = nc.jetstream()
    events = [msg.data for msg in await read_subject(js, ms.subjects.usage_tenant(tenant))]
    valid = [e for e in events if e.startswith(b"{") and b"request_id" in e]
    assert len(valid) == TOTAL
    duplicates_before = await ms.metric("tollgate_metering_events_duplicate_total")
    for data in valid:
        rid = orjson.loads(data)["request_id"]
        same = await js.publish(ms.subjects.usage(tenant), data, headers={"Nats-Msg-Id": rid})
        assert same.duplicate
        await js.publish(ms.subjects.usage(tenant), data, headers={"Nats-Msg-Id": rid + "-2"})
    await nc.close()
    await settle(ms, tenant, TOTAL)
    await check_exactly_once(ms, mix, tenant)
    assert await ms.metric("tollgate_metering_events_duplicate_total") == duplicates_before + TOTAL
    # everything delivered: the consumer-lag gauge comes down to zero (updated every 5 s)
    deadline = time.monotonic() + 15
    while await ms.metric("tollgate_metering_consumer_pending") != 0:
        assert time.monotonic() < deadline, "consumer lag gauge never reached 0"
        await asyncio.sleep(0.5)


async def test_a_nats_restart_loses_and_doubles_nothing(meter_stack: MeterStack) -> None:
    ms = meter_stack
    tenant = "faults-nats"
    mix = Mix(ms, await tenant_key(ms, tenant), seed=2)

    async def restart_nats(mix: Mix) -> None:
        await mix.reached(150)
        ms.stack.nats.stop()
        await asyncio.sleep(5)
        ms.stack.nats.start()

    await mix.run(restart_nats)
    await check_exactly_once(ms, mix, tenant)

    # The router's key mirror follows the restarted server: a new key works.
    key = await tenant_key(ms, "faults-after-restart")
    body = {"model": METER_MODEL, "messages": MESSAGES, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=ms.router_url, timeout=30) as http:
        r = await http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
        )
    assert r.status_code == 200, r.text


async def test_a_killed_metering_service_loses_and_doubles_nothing(
    meter_stack: MeterStack,
) -> None:
    ms = meter_stack
    tenant = "faults-metering"
    mix = Mix(ms, await tenant_key(ms, tenant), seed=3)

    async def kill_metering(mix: Mix) -> None:
        for at in (120, 300):
            await mix.reached(at)
            ms.metering.stop(signal.SIGKILL)
            await asyncio.sleep(1)
            await asyncio.to_thread(ms.start_metering)

    await mix.run(kill_metering)
    assert not [e for e in mix.expected.values() if e.kind.startswith("failed")]
    await check_exactly_once(ms, mix, tenant)
