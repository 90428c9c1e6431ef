"""Many tenants on one model: fair share, classes, bounded queues, cold-start holds, retries.

On the shared stack (real nats-server, router, simulated workers: test doubles).
``sim/fair`` has eight slots and makes ten tokens a second, so a model is
saturated by a few dozen requests and a backlog is cheap to build. The
quiet tenant's latency is compared with itself alone in the same run; with
fair share off the same load must starve it, so the test can fail.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import (
    COLD_MODEL,
    FAIR_MODEL,
    RETRY_MODEL,
    HeartbeatWatch,
    Service,
    Stack,
    wait_ready,
)
from tests.router.test_auth import make_key
from tollgate.wire.subjects import Subjects

SLOTS = 8
# The quiet tenant's calls run two seconds; the noisy tenant's 0.2 to 0.8 s, varied so
# that the slots do not all free at the same moment (an engine's never do).
BODY = {"model": FAIR_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20}
NOISY_CONCURRENCY = 10 * SLOTS  # ten times what the model runs at once


async def quiet_latencies(
    http: httpx.AsyncClient, url: str, key: str, n: int, headers: dict[str, str] | None = None
) -> list[float]:
    """``n`` calls one after another; the seconds each took."""
    out = []
    for _ in range(n):
        start = time.monotonic()
        r = await http.post(
            f"{url}/v1/chat/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {key}", **(headers or {})},
        )
        assert r.status_code == 200, r.text
        out.append(time.monotonic() - start)
    return out


class Noisy:
    """A tenant that keeps ``concurrency`` calls open: a backlog far beyond the model's slots."""

    def __init__(
        self, url: str, key: str, concurrency: int, headers: dict[str, str] | None = None
    ) -> None:
        self.url, self.key, self.concurrency = url, key, concurrency
        self.headers = {"Authorization": f"Bearer {key}", **(headers or {})}
        self.statuses: list[int] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def _loop(self, http: httpx.AsyncClient, seed: int) -> None:
        lengths = random.Random(seed)
        while not self._stop.is_set():
            body = {**BODY, "max_tokens": lengths.randint(2, 8)}
            r = await http.post(f"{self.url}/v1/chat/completions", json=body, headers=self.headers)
            self.statuses.append(r.status_code)

    async def __aenter__(self) -> Noisy:
        self._http = httpx.AsyncClient(
            timeout=120, limits=httpx.Limits(max_connections=self.concurrency + 4)
        )
        self._tasks = [
            asyncio.create_task(self._loop(self._http, seed)) for seed in range(self.concurrency)
        ]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.aclose()


async def queued(stack: Stack, model: str) -> int:
    subjects = Subjects()
    nc = await stack.nats.connect(name="test-queue", prefix=subjects.prefix)
    try:
        info = await nc.jetstream().stream_info(
            subjects.infer_stream, subjects_filter=subjects.infer_lanes(model)
        )
    finally:
        await nc.close()
    return sum((info.state.subjects or {}).values())


async def until(check: Any, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.1)


def in_flight(metrics_text: str) -> float:
    """The router's calls dispatched and not ended, from its ``/metrics`` text."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "tollgate_router_requests_in_flight":
            return sum(sample.value for sample in family.samples)
    raise AssertionError("the router has no in-flight gauge")


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(0.95 * len(ordered)) - 1)]


def assert_waited_at_most_for_a_slot(alone: list[float], beside: list[float]) -> None:
    """Calls beside a backlog waited at most for the next free slot.

    A slot is freed when a running call ends, so the next one is at most a
    whole call away (when the running calls began together), and usually a
    fraction of one: the typical call takes little longer than alone, none
    longer than alone plus one call. Behind the backlog (first come, first
    served) each would wait for many calls.
    """
    assert sorted(beside)[len(beside) // 2] <= 1.2 * p95(alone), (alone, beside)
    assert max(beside) <= 2 * p95(alone), (alone, beside)


@pytest.fixture
async def fair_worker(stack: Stack) -> AsyncIterator[Service]:
    worker = stack.worker(FAIR_MODEL)
    await wait_ready(stack.nats, FAIR_MODEL)
    yield worker
    worker.stop(timeout=30)


async def backlog(stack: Stack, at_least: int) -> None:
    await until(lambda: _at_least(stack, at_least))


async def _at_least(stack: Stack, n: int) -> bool:
    return await queued(stack, FAIR_MODEL) >= n


async def test_a_quiet_tenant_keeps_its_latency_beside_a_noisy_one_and_fifo_starves_it(
    stack: Stack, router_url: str
) -> None:
    quiet, _ = await make_key(stack, tenant="fair-quiet")
    noisy, _ = await make_key(stack, tenant="fair-noisy")
    async with httpx.AsyncClient(timeout=120) as http:
        worker = stack.worker(FAIR_MODEL)
        await wait_ready(stack.nats, FAIR_MODEL)
        alone = await quiet_latencies(http, router_url, quiet, 8)
        async with Noisy(router_url, noisy, NOISY_CONCURRENCY):
            await backlog(stack, NOISY_CONCURRENCY - 2 * SLOTS)
            shared = await quiet_latencies(http, router_url, quiet, 8)
        await until(lambda: _empty(stack))
        worker.stop(timeout=30)

        worker = stack.worker(FAIR_MODEL, TOLLGATE_WORKER_FAIR_SHARE="false")
        await wait_ready(stack.nats, FAIR_MODEL)
        async with Noisy(router_url, noisy, NOISY_CONCURRENCY):
            await backlog(stack, NOISY_CONCURRENCY - 2 * SLOTS)
            fifo = await quiet_latencies(http, router_url, quiet, 2)
        await until(lambda: _empty(stack))
        worker.stop(timeout=30)
    # Fair share: the quiet tenant waits at most for the next free slot.
    assert_waited_at_most_for_a_slot(alone, shared)
    # First come, first served: it waits behind the noisy tenant's backlog.
    assert min(fifo) > 2 * p95(alone), (alone, fifo)


async def _empty(stack: Stack) -> bool:
    return await queued(stack, FAIR_MODEL) == 0


async def test_batch_work_yields_to_interactive(
    stack: Stack, router_url: str, fair_worker: Service
) -> None:
    # One tenant, one key: only the class differs.
    key, _ = await make_key(stack, tenant="fair-classes")
    async with httpx.AsyncClient(timeout=120) as http:
        alone = await quiet_latencies(http, router_url, key, 6)
        async with Noisy(
            router_url, key, NOISY_CONCURRENCY, {"X-Tollgate-Priority": "batch"}
        ) as batch:
            await backlog(stack, NOISY_CONCURRENCY - 2 * SLOTS)
            interactive = await quiet_latencies(http, router_url, key, 6)
        await until(lambda: _empty(stack))
    assert_waited_at_most_for_a_slot(alone, interactive)
    assert batch.statuses.count(200) > 0  # batch work still ran on free capacity
    assert set(batch.statuses) <= {200}, batch.statuses


async def test_a_full_queue_and_a_busy_key_answer_at_once_with_retry_after(
    stack: Stack, api_key: str, fair_worker: Service
) -> None:
    _, url = stack.router(TOLLGATE_ROUTER_MAX_QUEUED_PER_MODEL="4")
    limited, _ = await make_key(stack, tenant="fair-limited", max_concurrent=2)
    filler, _ = await make_key(stack, tenant="fair-filler")
    async with httpx.AsyncClient(timeout=120) as http:

        async def call(key: str, max_tokens: int = 20) -> httpx.Response:
            return await http.post(
                f"{url}/v1/chat/completions",
                json={**BODY, "max_tokens": max_tokens},
                headers={"Authorization": f"Bearer {key}"},
            )

        # The key's limit: two at once, the third refused at once.
        first = [asyncio.create_task(call(limited)) for _ in range(2)]

        async def both_running() -> bool:
            text = (await http.get(f"{url}/metrics")).text
            return in_flight(text) >= 2

        await until(both_running, timeout=30)
        third = await call(limited)
        assert third.status_code == 429, third.text
        assert third.json()["error"]["code"] == "concurrency_limit_exceeded"
        assert int(third.headers["Retry-After"]) >= 1
        assert [r.status_code for r in await asyncio.gather(*first)] == [200, 200]
        assert (await call(limited)).status_code == 200  # a slot of its own again

        # The model's queue: eight running, four waiting, the next refused. The eight
        # run ten seconds, so the four are still waiting however slowly a loaded
        # machine shows the slots taken and the queue filled.
        async with HeartbeatWatch(stack.nats, Subjects()) as watch:
            fill = [asyncio.create_task(call(filler, max_tokens=100)) for _ in range(SLOTS)]
            await watch.wait_for(
                lambda _: sum(b.slots_used for b in watch.ready(FAIR_MODEL)) == SLOTS
            )
        fill += [asyncio.create_task(call(filler)) for _ in range(4)]
        await until(lambda: _at_least(stack, 4))
        full = await call(filler)
        assert full.status_code == 503, full.text
        error = full.json()["error"]
        assert error["code"] == "model_overloaded" and error["type"] == "service_unavailable"
        assert int(full.headers["Retry-After"]) >= 1
        assert [r.status_code for r in await asyncio.gather(*fill)] == [200] * (SLOTS + 4)
    # One usage record for each accepted call, none for the refused ones (a
    # call's record is written just after its response: wait for the last).
    router = next(s for s in reversed(stack.services) if s.name == "router")  # this test's
    accepted = 2 + 1 + SLOTS + 4

    def done() -> list[str]:
        return [
            json.loads(line)["request_id"]
            for line in router.log_text().splitlines()
            if '"request done"' in line and '"model":"sim/fair"' in line.replace(" ", "")
        ]

    async def all_done() -> bool:
        return len(done()) >= accepted

    await until(all_done, 30)
    ids = done()
    assert len(ids) == len(set(ids)) == accepted, len(ids)
    for refused in (third, full):
        assert refused.headers["x-request-id"] not in ids


async def test_a_request_waits_for_a_worker_that_starts_slower_than_the_queue_timeout(
    stack: Stack, api_key: str
) -> None:
    key, _ = await make_key(stack, tenant="fair-cold")
    _, url = stack.router(TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="2")
    body = {**BODY, "model": COLD_MODEL, "max_tokens": 4, "stream": True}
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        stack.worker(COLD_MODEL)  # eight seconds of engine start, plus the process's own
        await watch.wait_for(
            lambda beats: any(
                b.model == COLD_MODEL and b.state.value == "starting" for b in beats.values()
            ),
            timeout=60,
        )
        started = time.monotonic()
        async with (
            httpx.AsyncClient(timeout=120) as http,
            http.stream(
                "POST",
                f"{url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            ) as r,
        ):
            assert r.status_code == 200
            lines = [line async for line in r.aiter_lines() if line]
        waited = time.monotonic() - started
    assert any(line.startswith(": waiting") for line in lines)  # keep-alives while it waited
    assert lines[-1] == "data: [DONE]", lines[-3:]
    assert not any('"error"' in line for line in lines), lines
    assert waited > 2  # longer than the queue timeout: it was held, not refused


async def test_a_worker_lost_before_any_output_is_replaced_and_billed_once(
    stack: Stack, router_url: str
) -> None:
    key, _ = await make_key(stack, tenant="fair-retry")
    body = {**BODY, "model": RETRY_MODEL, "max_tokens": 4}
    workers = [stack.worker(RETRY_MODEL), stack.worker(RETRY_MODEL)]
    await wait_ready(stack.nats, RETRY_MODEL, count=2)
    async with (
        HeartbeatWatch(stack.nats, Subjects()) as watch,
        httpx.AsyncClient(timeout=120) as http,
    ):
        call = asyncio.create_task(
            http.post(
                f"{router_url}/v1/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
            )
        )
        # Whichever worker took it has four seconds to its first token: kill it first.
        await watch.wait_for(
            lambda beats: any(b.model == RETRY_MODEL and b.slots_used == 1 for b in beats.values()),
            timeout=30,
        )
        taken = next(b for b in watch.ready(RETRY_MODEL) if b.slots_used == 1)
        pid = int(taken.worker_id.rsplit("-", 2)[1])
        victim = next(w for w in workers if w.proc.pid == pid)
        victim.proc.send_signal(signal.SIGKILL)
        response = await call
    for worker in workers:
        worker.stop(timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
    request_id = response.headers["x-request-id"]
    logs = "\n".join(s.log_text() for s in stack.services if s.name == "router")
    done = [
        json.loads(line)
        for line in logs.splitlines()
        if request_id in line and '"request done"' in line
    ]
    assert len(done) == 1, done
    assert done[0]["attempts"] == 2 and done[0]["outcome"] == "completed", done[0]
