"""Per-key limits hold under concurrency and across router replicas."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import date
from decimal import Decimal
from typing import Any

import httpx
import pytest
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import KeyNotFoundError, NoKeysError

from services.router.auth import request_priority
from services.router.errors import InvalidRequest, PermissionDenied, QuotaExceeded, RateLimited
from services.router.limits import (
    ConcurrencyLimited,
    CounterStore,
    Limiter,
    Reservation,
    UnpricedModel,
)
from tests.conftest import SIM_MODEL, SLOW_MODEL, NatsServer, Stack
from tests.router.test_auth import make_key, wait_status
from tollgate.keys.records import KeyRecord, TenantRecord, budget_window, money_entry
from tollgate.keys.tenants import tenant_scope
from tollgate.models.catalog import Price
from tollgate.wire import bus
from tollgate.wire.contracts import Priority
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

# the tests through a router need workers; those on the limiter alone need only NATS
through_routers = pytest.mark.usefixtures("sim_workers")

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]


async def clear_of_minute_edge() -> None:
    """Windows are whole minutes: start a burst well inside one."""
    if time.time() % 60 > 50:
        await asyncio.sleep(61 - time.time() % 60)


@through_routers
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


@through_routers
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


@through_routers
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
    assert KeyRecord(key_id="k", tenant="t", max_concurrent=3).limited
    # fair share settings are not limits: they change the order of calls, not how many
    assert not KeyRecord(key_id="k", tenant="t", weight=5, priority=Priority.BATCH).limited


async def counters(kv: Any, within_s: float = 10.0) -> list[str]:
    """The bucket's keys, once it has any (a bucket made again is found before it is written)."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return list(await kv.keys())
        except NoKeysError:
            if time.monotonic() > deadline:
                return []
            await asyncio.sleep(0.2)  # polls the bucket: no event to await


@through_routers
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
            assert await counters(kv), "the counters are kept again"
        finally:
            await nc.close()
    assert answers[-1].headers["x-ratelimit-remaining-requests"] == str(1000 - 3)


@through_routers
async def test_a_key_limited_to_one_call_at_once_is_refused_a_second_on_any_router(
    router_url: str, stack: Stack
) -> None:
    _, second = stack.router()
    token, _ = await make_key(stack, max_concurrent=1)
    for url in (router_url, second):
        await wait_status(url, token, 200)
    headers = {"Authorization": f"Bearer {token}"}
    quick = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 1}
    # 100 s of output at the slow model's 10 tokens per second: in flight until dropped
    slow = {"model": SLOW_MODEL, "messages": MESSAGES, "max_tokens": 1000, "stream": True}
    async with httpx.AsyncClient(timeout=30, headers=headers) as http:
        async with http.stream("POST", f"{router_url}{CHAT}", json=slow) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    break  # the call runs
            for url in (router_url, second):
                refused = await http.post(f"{url}{CHAT}", json=quick)
                assert refused.status_code == 429, refused.text
                error = refused.json()["error"]
                assert error["code"] == "concurrency_limit_exceeded"
                assert error["message"].startswith("Too many concurrent requests for this key: 1")
        # the client hung up: the call ends, its place is given back
        deadline = time.monotonic() + 30
        while (r := await http.post(f"{second}{CHAT}", json=quick)).status_code != 200:
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            await asyncio.sleep(0.05)


# -- a key's class: X-Tollgate-Priority ----------------------------------------

INTERACTIVE_KEY = KeyRecord(key_id="k", tenant="t")
BATCH_KEY = KeyRecord(key_id="k", tenant="t", priority=Priority.BATCH)
BATCH_KEY_WITH_HEADER = KeyRecord(
    key_id="k", tenant="t", priority=Priority.BATCH, priority_header=True
)


@pytest.mark.parametrize(
    ("record", "header", "expected"),
    [
        (INTERACTIVE_KEY, None, Priority.INTERACTIVE),
        (BATCH_KEY, None, Priority.BATCH),
        (INTERACTIVE_KEY, "batch", Priority.BATCH),  # any call may lower itself
        (INTERACTIVE_KEY, "interactive", Priority.INTERACTIVE),
        (BATCH_KEY, "batch", Priority.BATCH),
        (BATCH_KEY_WITH_HEADER, "interactive", Priority.INTERACTIVE),
        (BATCH_KEY_WITH_HEADER, " Interactive ", Priority.INTERACTIVE),
        (INTERACTIVE_KEY, "BATCH", Priority.BATCH),
        (None, None, Priority.INTERACTIVE),  # no keys: the router runs without auth
        (None, "batch", Priority.BATCH),
        (None, "interactive", Priority.INTERACTIVE),
    ],
)
def test_a_calls_class_is_its_keys_or_the_headers(
    record: KeyRecord | None, header: str | None, expected: Priority
) -> None:
    assert request_priority(record, header) is expected


def test_a_batch_key_raises_its_class_only_when_allowed() -> None:
    with pytest.raises(PermissionDenied) as refused:
        request_priority(BATCH_KEY, "interactive")
    status, body = refused.value.status, refused.value.body()["error"]
    assert status == 403 and body["code"] == "permission_denied"
    assert body["type"] == "invalid_request_error"
    assert "X-Tollgate-Priority" in body["message"] and "batch" in body["message"]


@pytest.mark.parametrize("header", ["", "urgent", "high", "interactive,batch", "0"])
def test_a_class_that_does_not_exist_is_a_400_naming_the_header(header: str) -> None:
    for record in (INTERACTIVE_KEY, BATCH_KEY_WITH_HEADER, None):
        with pytest.raises(InvalidRequest) as refused:
            request_priority(record, header)
        body = refused.value.body()["error"]
        assert refused.value.status == 400 and body["type"] == "invalid_request_error"
        assert body["param"] == "X-Tollgate-Priority"
        assert "'interactive' or 'batch'" in body["message"]


def test_a_record_written_before_the_fair_share_settings_loads_with_their_defaults() -> None:
    old = b'{"type": "tg.key.v1", "key_id": "k", "tenant": "t", "rpm": 5, "created_at": 1}'
    record = KeyRecord.model_validate_json(old)
    assert record.max_concurrent is None and record.weight == 1.0
    assert record.priority is Priority.INTERACTIVE and record.priority_header is False
    for bad in ({"weight": 0}, {"weight": 1001}, {"max_concurrent": 0}, {"priority": "low"}):
        with pytest.raises(ValueError):
            KeyRecord.model_validate({"key_id": "k", "tenant": "t", **bad})


# -- calls in flight per key (max_concurrent) -----------------------------------


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[Any]:
    nc = await nats_server.connect(name="test-concurrency")
    yield nc.jetstream()
    await bus.close(nc)


@pytest.fixture
async def limiters(js: Any) -> AsyncIterator[tuple[Limiter, Limiter]]:
    """Two routers' limiters on the same buckets."""
    topology = Topology(Subjects("conc"))
    pair = (await Limiter.open(js, topology), await Limiter.open(js, topology))
    yield pair
    for limiter in pair:
        await limiter.close()


_keys = iter(range(1_000_000))


def concurrent_key(limit: int, **limits: Any) -> KeyRecord:
    key_id = f"conc{next(_keys)}-{time.time_ns()}"
    return KeyRecord(**{"key_id": key_id, "tenant": "t", "max_concurrent": limit, **limits})


async def in_flight(limiter: Limiter, record: KeyRecord) -> int | None:
    """The key's in-flight counter as NATS holds it (None: no entry)."""
    try:
        entry = await limiter.rates.kv.get(f"conc.{record.key_id}")
    except KeyNotFoundError:
        return None
    return int(entry.value or b"0")


async def test_a_third_call_of_a_key_limited_to_two_is_refused_until_one_ends(
    limiters: tuple[Limiter, Limiter],
) -> None:
    limiter, _ = limiters
    record = concurrent_key(2)
    results = await asyncio.gather(
        *(limiter.reserve(record, 10) for _ in range(3)), return_exceptions=True
    )
    held = [r for r in results if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, BaseException)]
    assert len(held) == 2 and len(refused) == 1, results
    error = refused[0]
    assert isinstance(error, ConcurrencyLimited) and isinstance(error, RateLimited)
    body = error.body()["error"]
    assert error.status == 429 and body["code"] == "concurrency_limit_exceeded"
    assert body["message"] == (
        "Too many concurrent requests for this key: 2 at once. Please retry when one finishes."
    )
    assert "Retry-After" not in error.headers  # the serving layer adds it from its drain rate
    assert await in_flight(limiter, record) == 2
    await limiter.settle(held[0], 7)
    assert await in_flight(limiter, record) == 1
    again = await limiter.reserve(record, 10)
    assert again.concurrency_keys == [f"conc.{record.key_id}"]
    with pytest.raises(ConcurrencyLimited):
        await limiter.reserve(record, 10)
    for reservation in (held[1], again):
        await limiter.settle(reservation, 3)
    assert await in_flight(limiter, record) == 0


async def test_two_routers_share_one_keys_limit(limiters: tuple[Limiter, Limiter]) -> None:
    record = concurrent_key(3)
    results = await asyncio.gather(
        *(limiters[i % 2].reserve(record, 1) for i in range(10)), return_exceptions=True
    )
    held = [(i, r) for i, r in enumerate(results) if isinstance(r, Reservation)]
    assert len(held) == 3, results
    assert all(isinstance(r, ConcurrencyLimited) for r in results if r not in dict(held).values())
    # a call that ends on one router frees a place for the other
    first, reservation = held[0]
    await limiters[first % 2].settle(reservation, 1)
    other = limiters[(first + 1) % 2]
    reservation = await other.reserve(record, 1)
    with pytest.raises(ConcurrencyLimited):
        await limiters[first % 2].reserve(record, 1)
    await other.settle(reservation, 1)
    for i, r in held[1:]:
        await limiters[i % 2].settle(r, 1)
    assert await in_flight(other, record) == 0


async def test_a_call_is_given_back_once_and_the_counter_never_goes_below_zero(
    limiters: tuple[Limiter, Limiter],
) -> None:
    limiter, other = limiters
    record = concurrent_key(5)
    first, second = await limiter.reserve(record, 1), await limiter.reserve(record, 1)
    # a lost call's copy
    rebuilt = Reservation(tokens=1, concurrency_keys=list(first.concurrency_keys))
    await limiter.settle(first, 1)
    await limiter.settle(first, 1)  # settled twice: given back once
    await limiter.release(first)
    assert await in_flight(limiter, record) == 1
    await limiter.settle(second, 1)
    assert await in_flight(limiter, record) == 0
    # more given back than taken (a counter that expired, or a lost call's copy):
    # the counter stays at zero, on either router, and then counts from there
    await other.settle(rebuilt, 1)
    await limiter.release(Reservation(concurrency_keys=[f"conc.{record.key_id}"]))
    assert await in_flight(limiter, record) == 0
    held = [await other.reserve(record, 1) for _ in range(5)]
    with pytest.raises(ConcurrencyLimited):
        await limiter.reserve(record, 1)
    for reservation in held:
        await other.settle(reservation, 1)
    assert await in_flight(other, record) == 0


async def test_a_refusal_gives_back_every_unit_already_taken(
    limiters: tuple[Limiter, Limiter],
) -> None:
    limiter, _ = limiters
    await clear_of_minute_edge()  # one minute's window throughout
    minute = int(time.time() // 60)
    # the budget refuses after the call, the request and the tokens were taken
    record = concurrent_key(2, rpm=10, tpm=1000, budget_tokens=50, budget_period="total")
    with pytest.raises(QuotaExceeded):
        await limiter.reserve(record, 100)
    assert await in_flight(limiter, record) == 0
    counters = limiter.rates.kv
    rpm = int((await counters.get(f"rpm.{record.key_id}.{minute}")).value)
    tpm = int((await counters.get(f"tpm.{record.key_id}.{minute}")).value)
    assert (rpm, tpm) == (0, 0)
    # requests per minute refuse after the call was taken: the call is given back
    record = concurrent_key(1, rpm=1)
    held = await limiter.reserve(record, 1)
    await limiter.settle(held, 1)
    with pytest.raises(RateLimited) as refused:
        await limiter.reserve(record, 1)
    assert not isinstance(refused.value, ConcurrencyLimited)
    assert await in_flight(limiter, record) == 0


async def test_a_call_longer_than_the_buckets_memory_keeps_its_place(js: Any) -> None:
    """The in-flight counter lives in a bucket that forgets an entry two minutes after
    its last write; a router rewrites the counters it holds, so a long call keeps
    its unit. Here the bucket forgets after 2 s: the held counter is still there
    after 6 s, while the same counter in a router that does not renew it is gone."""
    name = f"conc_short_{time.time_ns()}"
    kv = await js.create_key_value(
        KeyValueConfig(bucket=name, ttl=2.0, storage=StorageType.MEMORY, history=1)
    )
    budgets = CounterStore(kv)  # no budget on these keys: never written
    renewing = Limiter(CounterStore(kv), budgets, refresh_s=0.25)
    forgetful = Limiter(CounterStore(kv), budgets, refresh_s=3600)
    kept, lost = concurrent_key(1), concurrent_key(1)
    try:
        long_call = await renewing.reserve(kept, 1)
        unrenewed = await forgetful.reserve(lost, 1)
        deadline = time.monotonic() + 30
        while await in_flight(forgetful, lost) is not None:
            assert time.monotonic() < deadline, "the bucket never forgot the entry"
            await asyncio.sleep(0.1)
        await asyncio.sleep(4)  # two more lifetimes of an unwritten entry
        assert await in_flight(renewing, kept) == 1
        with pytest.raises(ConcurrencyLimited):
            await renewing.reserve(kept, 1)
        await renewing.settle(long_call, 1)
        assert await in_flight(renewing, kept) == 0
        # the forgotten counter starts from zero; giving back its unit leaves it there
        await forgetful.settle(unrenewed, 1)
        assert await in_flight(forgetful, lost) in (None, 0)
    finally:
        await renewing.close()
        await forgetful.close()
        await js.delete_key_value(name)


# -- tenant-wide limits ---------------------------------------------------------


async def counter(store: CounterStore, name: str) -> int:
    try:
        entry = await store.kv.get(name)
    except KeyNotFoundError:
        return 0
    return int(entry.value or b"0")


async def test_a_tenants_calls_in_flight_hold_over_its_keys_and_two_routers(
    limiters: tuple[Limiter, Limiter],
) -> None:
    tenant = TenantRecord(tenant=f"acme/{time.time_ns()}", max_concurrent=3)
    keys = [concurrent_key(10, tenant=tenant.tenant) for _ in range(3)]
    results = await asyncio.gather(
        *(limiters[i % 2].reserve(keys[i % 3], 1, tenant) for i in range(9)),
        return_exceptions=True,
    )
    held = [(i, r) for i, r in enumerate(results) if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, ConcurrencyLimited)]
    assert len(held) == 3 and len(refused) == 6, results
    assert "tenant" in str(refused[0])
    scope = f"conc.{tenant_scope(tenant.tenant)}"
    assert all(scope in r.concurrency_keys for _, r in held)
    assert await counter(limiters[0].rates, scope) == 3
    # every refused call gave back the key's unit it had taken
    assert sum([await in_flight(limiters[0], k) or 0 for k in keys]) == 3
    for i, reservation in held:
        await limiters[i % 2].settle(reservation, 1)
    assert await counter(limiters[0].rates, scope) == 0
    assert sum([await in_flight(limiters[0], k) or 0 for k in keys]) == 0


async def test_a_tenant_budget_is_not_overshot_by_concurrent_calls_of_its_keys(
    limiters: tuple[Limiter, Limiter],
) -> None:
    tenant = TenantRecord(
        tenant=f"budget/{time.time_ns()}", budget_tokens=1000, budget_period="day"
    )
    keys = [concurrent_key(100, tenant=tenant.tenant) for _ in range(4)]
    results = await asyncio.gather(
        *(limiters[i % 2].reserve(keys[i % 4], 300, tenant) for i in range(12)),
        return_exceptions=True,
    )
    held = [(i, r) for i, r in enumerate(results) if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    # three worst cases of 300 fit in 1000; a fourth would pass it
    assert len(held) == 3 and len(refused) == 9, results
    assert "tenant" in str(refused[0])
    name = f"{tenant_scope(tenant.tenant)}.{budget_window('day', time.time())}"
    assert await counter(limiters[0].budgets, name) == 900
    for i, reservation in held:  # each used 100: the rest is given back
        await limiters[i % 2].settle(reservation, 100)
    assert await counter(limiters[0].budgets, name) == 300
    more = await limiters[1].reserve(keys[0], 700, tenant)
    with pytest.raises(QuotaExceeded):
        await limiters[0].reserve(keys[1], 1, tenant)
    await limiters[1].settle(more, 0)
    assert await counter(limiters[0].budgets, name) == 300


async def test_a_call_refused_by_its_tenant_gives_back_what_its_key_took(
    limiters: tuple[Limiter, Limiter],
) -> None:
    limiter, _ = limiters
    tenant = TenantRecord(tenant=f"tight/{time.time_ns()}", tpm=100)
    key = concurrent_key(5, tenant=tenant.tenant, rpm=50, tpm=10_000)
    minute = int(time.time() // 60)
    first = await limiter.reserve(key, 60, tenant)
    assert first.headers["x-ratelimit-limit-tokens"] == "100"  # the tighter window shows
    assert first.headers["x-ratelimit-remaining-tokens"] == "40"
    with pytest.raises(RateLimited) as refused:
        await limiter.reserve(key, 60, tenant)
    assert "tenant" in str(refused.value)
    assert await counter(limiter.rates, f"rpm.{key.key_id}.{minute}") == 1
    assert await counter(limiter.rates, f"tpm.{key.key_id}.{minute}") == 60
    assert await in_flight(limiter, key) == 1
    await limiter.settle(first, 10)
    assert await counter(limiter.rates, f"tpm.{key.key_id}.{minute}") == 10
    assert await counter(limiter.rates, f"tpm.{tenant_scope(tenant.tenant)}.{minute}") == 10


def test_a_reservation_survives_the_outbox_in_either_format() -> None:
    held = Reservation(
        tokens=9,
        tpm_keys=["tpm.k.1", "tpm.t.acme.1"],
        budget_keys=["t.acme.total"],
        concurrency_keys=["conc.k"],
    )
    again = Reservation.from_held(held.held())
    assert again == held and again.budget
    old = Reservation.from_held({"tokens": 5, "tpm_key": "tpm.k.1", "budget_key": None})
    assert old.tpm_keys == ["tpm.k.1"] and old.budget_keys == [] and not old.budget
    assert old.concurrency_keys == []


# -- budgets in money -------------------------------------------------------------

PRICE = Price(
    valid_from=date(2026, 1, 1), prompt=Decimal("0.5"), completion=Decimal("1.5"), currency="USD"
)


async def test_a_money_budget_is_not_overshot_and_settles_to_the_exact_cost(
    limiters: tuple[Limiter, Limiter],
) -> None:
    # 1,000,000 billionths (0.001 USD); a worst case of 100 tokens at the dearer
    # kind (1.5 per million) reserves 150,000: six at once fit, a seventh does not
    key = concurrent_key(100, budget_amount=Decimal("0.001"), budget_period="day")
    results = await asyncio.gather(
        *(limiters[i % 2].reserve(key, 100, None, PRICE, "m") for i in range(12)),
        return_exceptions=True,
    )
    held = [(i, r) for i, r in enumerate(results) if isinstance(r, Reservation)]
    refused = [r for r in results if isinstance(r, QuotaExceeded)]
    assert len(held) == 6 and len(refused) == 6, results
    assert "0.001 USD" in str(refused[0])
    name = money_entry(key.key_id, budget_window("day", time.time()), "USD")
    assert await counter(limiters[0].budgets, name) == 900_000
    for i, reservation in held:  # 50 prompt and 10 completion tokens: 25,000 + 15,000
        await limiters[i % 2].settle(reservation, 60, 50)
    assert await counter(limiters[0].budgets, name) == 6 * 40_000
    # a lost call's copy settles with its outbox's price
    lost = await limiters[0].reserve(key, 100, None, PRICE, "m")
    await limiters[1].settle(Reservation.from_held(lost.held()), 3, 1)
    assert await counter(limiters[0].budgets, name) == 6 * 40_000 + 500 + 3_000


async def test_a_money_budget_refuses_a_model_without_a_price_in_its_currency(
    limiters: tuple[Limiter, Limiter],
) -> None:
    limiter, _ = limiters
    key = concurrent_key(5, budget_amount=Decimal("1"), budget_period="month", rpm=10)
    tenant = TenantRecord(
        tenant=key.tenant, budget_amount=Decimal("5"), budget_currency="EUR", budget_period="day"
    )
    minute = int(time.time() // 60)
    for price, whose in [(None, "This key has"), (PRICE, "This key's tenant has")]:
        with pytest.raises(UnpricedModel) as refused:
            await limiter.reserve(key, 10, tenant if price else None, price, "sim/unpriced")
        assert refused.value.status == 403 and refused.value.code == "model_not_priced"
        assert whose in refused.value.message and "`sim/unpriced`" in refused.value.message
    # nothing stays taken
    assert await counter(limiter.rates, f"rpm.{key.key_id}.{minute}") == 0
    assert await in_flight(limiter, key) == 0
    name = money_entry(key.key_id, budget_window("month", time.time()), "USD")
    assert await counter(limiter.budgets, name) == 0
