"""Cache-aware routing on the shared stack: real nats-server and router, two workers of
``sim/affinity`` (simulated engines with a simulated prefix cache: test doubles).

Which worker served a call comes from the router's own record of it (its
``request done`` log line, the usage event it publishes).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from services.router.affinity import Affinity, affinity_key
from tests.conftest import AFFINITY_MODEL, HeartbeatWatch, Service, Stack, wait_ready
from tests.router.test_auth import make_key
from tollgate.runtime.workers import WorkerView
from tollgate.wire import codec
from tollgate.wire.contracts import Endpoint, WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role

SLOTS = 4  # sim/affinity's max_num_seqs


@pytest.fixture(scope="module")
async def two_workers(stack: Stack) -> AsyncIterator[list[Service]]:
    workers = [stack.worker(AFFINITY_MODEL), stack.worker(AFFINITY_MODEL)]
    await wait_ready(stack.nats, AFFINITY_MODEL, count=2)
    yield workers
    for worker in workers:
        worker.stop(timeout=30)


def done_records(stack: Stack) -> dict[str, dict[str, Any]]:
    """The router's record of each finished call, by request id."""
    records = {}
    for service in stack.services:
        if service.name != "router":
            continue
        for line in service.log_text().splitlines():
            if '"request done"' in line:
                record = json.loads(line)
                records[record["request_id"]] = record
    return records


async def until_recorded(stack: Stack, request_ids: list[str]) -> dict[str, dict[str, Any]]:
    """The records of ``request_ids`` (the log is written as the calls end)."""
    async with asyncio.timeout(30):
        while True:
            records = done_records(stack)
            if all(rid in records for rid in request_ids):
                return {rid: records[rid] for rid in request_ids}
            await asyncio.sleep(0.1)


def conversation(n: int) -> list[dict[str, str]]:
    system = f"You are assistant number {n}. " + "Answer briefly and kindly. " * 40
    return [{"role": "system", "content": system}, {"role": "user", "content": f"Hello {n}"}]


async def chat(
    http: httpx.AsyncClient,
    url: str,
    key: str,
    messages: list[dict[str, str]],
    headers: dict[str, str] | None = None,
    max_tokens: int = 4,
) -> httpx.Response:
    r = await http.post(
        f"{url}/v1/chat/completions",
        json={"model": AFFINITY_MODEL, "messages": messages, "max_tokens": max_tokens},
        headers={"Authorization": f"Bearer {key}", **(headers or {})},
    )
    assert r.status_code == 200, r.text
    return r


async def test_each_conversation_stays_on_one_worker_and_conversations_spread(
    stack: Stack, router_url: str, two_workers: list[Service]
) -> None:
    key, _ = await make_key(stack, tenant="affinity")
    turns: dict[int, list[str]] = {}

    async def talk(n: int) -> None:
        messages = conversation(n)
        for _ in range(3):  # each turn repeats the earlier ones, as chat clients do
            r = await chat(http, router_url, key, messages)
            turns.setdefault(n, []).append(r.headers["x-request-id"])
            reply = r.json()["choices"][0]["message"]["content"]
            messages = [*messages, {"role": "assistant", "content": reply}]
            messages.append({"role": "user", "content": "Tell me more."})

    async with (
        HeartbeatWatch(stack.nats, Subjects()) as watch,
        httpx.AsyncClient(timeout=60) as http,
    ):
        # two conversations at a time: never more than one worker's slots, so a
        # conversation's worker always has room and nothing overflows
        for first in range(0, 12, 2):
            await asyncio.gather(talk(first), talk(first + 1))
        records = await until_recorded(stack, [rid for ids in turns.values() for rid in ids])
        workers_of = {n: {records[rid]["worker_id"] for rid in ids} for n, ids in turns.items()}
        assert all(len(w) == 1 for w in workers_of.values()), workers_of
        spread = Counter(next(iter(w)) for w in workers_of.values())
        assert len(spread) == 2, spread  # twelve conversations: both workers have some
        # the simulated prefix cache saw the later turns' openings again
        beats = await watch.wait_for(lambda b: any(cache_hits(b).values()))
    hits = cache_hits(beats)
    assert any(hits.values()), hits


def cache_hits(beats: dict[str, WorkerHeartbeat]) -> dict[str, int]:
    return {w: b.prefix_cache_hits or 0 for w, b in beats.items() if b.model == AFFINITY_MODEL}


async def test_a_busy_conversation_overflows_to_the_other_worker(
    stack: Stack, router_url: str, two_workers: list[Service]
) -> None:
    key, _ = await make_key(stack, tenant="affinity-burst")
    headers = {"X-Tollgate-Session": "one-busy-conversation"}
    messages = [{"role": "user", "content": "the same opening every time"}]
    async with httpx.AsyncClient(timeout=60) as http:
        # three times one worker's slots, all for one session: affinity is a
        # preference, not a wait for one worker
        answers = await asyncio.gather(
            *(
                chat(http, router_url, key, messages, headers, max_tokens=200)
                for _ in range(3 * SLOTS)
            )
        )
    records = await until_recorded(stack, [r.headers["x-request-id"] for r in answers])
    served = Counter(record["worker_id"] for record in records.values())
    assert len(served) == 2, served
    assert all(record["outcome"] == "completed" for record in records.values())


def ghost_and_other_openings(affinity: Affinity, n: int) -> list[list[dict[str, str]]]:
    """``n`` openings that the ghost worker's hash wins, then ``n`` that others win."""
    ghost: list[list[dict[str, str]]] = []
    other: list[list[dict[str, str]]] = []
    for i in range(1000):
        messages = [{"role": "user", "content": f"opening {i}"}]
        key = affinity_key(Endpoint.CHAT, {"messages": messages}, None, 2048)
        chosen, _ = affinity.choose(AFFINITY_MODEL, key)
        (ghost if chosen == "ghost-worker" else other).append(messages)
        if len(ghost) >= n and len(other) >= n:
            return ghost[:n] + other[:n]
    raise AssertionError("the ghost worker's hash never won")


async def test_requests_for_a_worker_that_vanished_are_served_by_another_and_billed_once(
    stack: Stack, router_url: str, two_workers: list[Service]
) -> None:
    """A worker that beat once and is gone (killed right after its beat): the router
    sends it the keys that hash to it until its beats are missed; every one of
    those requests spills to a live worker."""
    key, _ = await make_key(stack, tenant="affinity-ghost")
    subjects = Subjects()
    ghost = await stack.nats.connect(Role.WORKER, name="test-ghost-worker")
    try:
        beat = WorkerHeartbeat(
            worker_id="ghost-worker",
            model=AFFINITY_MODEL,
            engine="simulated",
            state=WorkerState.READY,
            slots_used=0,
            slots_total=1000,  # room for every key that hashes to it
            interval_s=30.0,  # missed only after 90 s: the test is long over
            sent_at=time.time(),
        )
        async with HeartbeatWatch(stack.nats, subjects) as watch:
            await ghost.publish(subjects.heartbeat(AFFINITY_MODEL), codec.encode(beat))
            await ghost.flush()
            await watch.wait_for(lambda beats: len(watch.ready(AFFINITY_MODEL)) == 3)
            # the router hashes as this view does: half the openings are the ghost's
            view = WorkerView()
            for seen in watch.ready(AFFINITY_MODEL):
                view.observe(seen.model_copy(update={"slots_used": 0}))
            openings = ghost_and_other_openings(Affinity(view), 6)
        async with httpx.AsyncClient(timeout=60) as http:
            answers = await asyncio.gather(
                *(chat(http, router_url, key, messages) for messages in openings)
            )
        records = await until_recorded(stack, [r.headers["x-request-id"] for r in answers])
    finally:
        stopped = beat.model_copy(update={"state": WorkerState.STOPPED, "sent_at": time.time()})
        await ghost.publish(subjects.heartbeat(AFFINITY_MODEL), codec.encode(stopped))
        await ghost.close()
    served = Counter(record["worker_id"] for record in records.values())
    assert "ghost-worker" not in served
    assert sum(served.values()) == 12
    assert all(record["outcome"] == "completed" for record in records.values())
    assert all(record["attempts"] == 1 for record in records.values())  # spilled, not retried
    logs = "\n".join(s.log_text() for s in stack.services if s.name == "router")
    for r in answers:  # billed once: one record per request
        rid = r.headers["x-request-id"]
        assert sum(1 for line in logs.splitlines() if rid in line and '"request done"' in line) == 1
