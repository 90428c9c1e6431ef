"""Per-key limits hold under concurrency and across router replicas."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import SIM_MODEL, Stack
from tests.router.test_auth import make_key, wait_status
from tollgate.keys.records import KeyRecord
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

pytestmark = pytest.mark.usefixtures("sim_workers")

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def clear_of_minute_edge() -> None:
    """Windows are whole minutes: start a burst well inside one."""
    if time.time() % 60 > 50:
        await asyncio.sleep(61 - time.time() % 60)


async def test_requests_per_minute_hold_across_two_routers(router_url: str, stack: Stack) -> None:
    _, second = stack.router()
    token, _ = await make_key(stack, rpm=10)
    for url in (router_url, second):
        await wait_status(url, token, 200)  # GET /v1/models: not a completion
    await clear_of_minute_edge()
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        # one request through each router, then a burst through both
        for url in (router_url, second):
            first = await http.post(f"{url}{CHAT}", json=body)
            assert first.status_code == 200, first.text
        responses = await asyncio.gather(
            *(http.post(f"{(router_url, second)[i % 2]}{CHAT}", json=body) for i in range(28))
        )
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    # the two routers share one limit of 10: 2 + 8 ran, 20 refused
    assert len(ok) == 8 and len(limited) == 20, [r.status_code for r in responses]
    sample = limited[0]
    assert sample.json()["error"]["code"] == "rate_limit_exceeded"
    assert int(sample.headers["Retry-After"]) >= 1
    assert sample.headers["x-ratelimit-limit-requests"] == "10"
    assert sample.headers["x-ratelimit-remaining-requests"] == "0"
    assert ok[0].headers["x-ratelimit-limit-requests"] == "10"


async def test_tokens_per_minute_refuse_a_request_that_cannot_fit(
    router_url: str, stack: Stack
) -> None:
    token, _ = await make_key(stack, tpm=500)
    await wait_status(router_url, token, 200)
    await clear_of_minute_edge()
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        small = await http.post(
            f"{router_url}{CHAT}", json={"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 5}
        )
        big = await http.post(
            f"{router_url}{CHAT}",
            json={"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 1000},
        )
    assert small.status_code == 200, small.text
    assert int(small.headers["x-ratelimit-remaining-tokens"]) < 500
    assert big.status_code == 429 and big.json()["error"]["code"] == "rate_limit_exceeded"
    assert big.headers["x-ratelimit-limit-tokens"] == "500"


async def budget_used(stack: Stack, record_key: str) -> int:
    nc = await stack.nats.connect(name="test-budget")
    try:
        kv = await nc.jetstream().key_value("tg_budgets")
        entry = await kv.get(record_key)
        return int(entry.value or b"0")
    finally:
        await nc.close()


async def test_fifty_concurrent_requests_against_a_budget_that_fits_ten(
    router_url: str, stack: Stack
) -> None:
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 5}
    # the router reserves len(json(messages)) + 64 prompt tokens + max_tokens
    import orjson

    worst = len(orjson.dumps(MESSAGES)) + 64 + 5
    budget = 10 * worst
    token, key_id = await make_key(stack, budget_tokens=budget, budget_period="month")
    await wait_status(router_url, token, 200)
    headers = {"Authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(timeout=60, headers=headers) as http:
        responses = await asyncio.gather(
            *(http.post(f"{router_url}{CHAT}", json=body) for _ in range(50))
        )
    ran = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ran) + len(refused) == 50
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in refused)
    billed = sum(r.json()["usage"]["total_tokens"] for r in ran)
    print(f"budget {budget}: {len(ran)} of 50 ran, billed {billed} tokens")
    # every reservation is the worst case, so the budget is never overshot
    assert 10 <= len(ran) <= budget // ran[0].json()["usage"]["total_tokens"]
    assert billed <= budget
    month = time.strftime("%Y%m", time.gmtime())
    # settled: the counter holds exactly what was billed, no reservation left over
    deadline = time.monotonic() + 30
    while (used := await budget_used(stack, f"{key_id}.{month}")) != billed:
        assert time.monotonic() < deadline, (used, billed)
        await asyncio.sleep(0.05)


def test_unlimited_keys_skip_the_counters() -> None:
    assert not KeyRecord(key_id="k", tenant="t").limited
    assert KeyRecord(key_id="k", tenant="t", rpm=1).limited
    assert not KeyRecord(key_id="k", tenant="t", budget_tokens=5).limited  # no period


async def test_a_rate_bucket_lost_with_a_nats_restart_is_made_again(
    router_url: str, stack: Stack
) -> None:
    """The per-minute counters live in NATS memory: a restart drops their bucket.

    The router creates it again on the next limited request, instead of
    failing every limited request until it restarts.
    """
    token, _ = await make_key(stack, rpm=1000)
    await wait_status(router_url, token, 200)
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 1}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        assert (await http.post(f"{router_url}{CHAT}", json=body)).status_code == 200
        nc = await stack.nats.connect(name="test-drop-bucket")
        try:
            js = nc.jetstream()
            bucket = Topology(Subjects()).ratelimits.name
            await js.delete_key_value(bucket)  # what a restart does to a memory bucket
            answers = [await http.post(f"{router_url}{CHAT}", json=body) for _ in range(3)]
            assert [a.status_code for a in answers] == [200, 200, 200], answers[0].text
            kv = await js.key_value(bucket)  # there again, counting
            assert await kv.keys(), "the counters are kept again"
        finally:
            await nc.close()
    assert answers[-1].headers["x-ratelimit-remaining-requests"] == str(1000 - 3)
