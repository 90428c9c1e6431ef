"""Tenant-wide limits and budgets in money on a running stack: set through the admin API,
held across two routers, the budgets counted by the ledger over all of a tenant's keys."""

from __future__ import annotations

import asyncio
import time
import uuid
from decimal import Decimal
from urllib.parse import quote

import httpx
import orjson
import pytest
from nats.js.errors import KeyNotFoundError

from tests.auth.test_admin import chat
from tests.conftest import SIM_ADAPTER, SIM_MODEL, Stack
from tests.router.test_auth import wait_status
from tests.router.test_limits import clear_of_minute_edge

pytestmark = pytest.mark.usefixtures("sim_workers")

CHAT = "/v1/chat/completions"


def new_tenant() -> str:
    # a name that is not a subject token as it is: the tenant's entry is its escaped form
    return f"acme corp/{uuid.uuid4().hex[:8]}"


def tenant_path(tenant: str) -> str:
    return f"/admin/tenants/{quote(tenant, safe='')}"


def issue(admin: httpx.Client, tenant: str, **limits: object) -> str:
    created = admin.post("/admin/keys", json={"tenant": tenant, **limits})
    assert created.status_code == 201, created.text
    return str(created.json()["key"])


async def until(check: object, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


async def test_tenant_requests_per_minute_hold_over_two_keys_and_two_routers(
    admin: httpx.Client, router_url: str, stack: Stack
) -> None:
    _, second = stack.router()
    routers = (router_url, second)
    tenant = new_tenant()
    keys = [issue(admin, tenant), issue(admin, tenant)]  # keys without limits of their own
    for url in routers:
        for key in keys:
            await wait_status(url, key, 200)
    await clear_of_minute_edge()
    # First with a token limit no call fits: each router refusing for the tenant shows its
    # mirror has the record. A refused call gives back the request it took.
    r = admin.put(tenant_path(tenant), json={"rpm": 6, "tpm": 1})
    assert r.status_code == 200, r.text
    assert r.json()["rpm"] == 6 and r.json()["tenant"] == tenant
    for url in routers:
        await until(
            lambda url=url: chat(url, keys[0]).status_code == 429,
            "the router never refused for the tenant",
        )
        refused = chat(url, keys[1])
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "tenant" in error["message"] and "tokens" in error["message"]
    r = admin.put(tenant_path(tenant), json={"rpm": 6})
    assert r.json()["tpm"] is None
    for url in routers:  # one call through each once its mirror has the new record
        await until(lambda url=url: chat(url, keys[1]).status_code == 200, "never served again")
    async with httpx.AsyncClient(timeout=30) as http:
        responses = await asyncio.gather(
            *(
                http.post(
                    f"{routers[i % 2]}{CHAT}",
                    json={"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]},
                    headers={"Authorization": f"Bearer {keys[(i // 2) % 2]}"},
                )
                for i in range(20)
            )
        )
    ok = [r for r in responses if r.status_code == 200]
    limited = [r for r in responses if r.status_code == 429]
    # six a minute for the tenant: two went before the burst, four in it
    assert len(ok) == 4 and len(limited) == 16, [r.status_code for r in responses]
    sample = limited[0]
    assert sample.json()["error"]["code"] == "rate_limit_exceeded"
    assert "tenant" in sample.json()["error"]["message"]
    assert sample.headers["x-ratelimit-limit-requests"] == "6"
    assert sample.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(sample.headers["Retry-After"]) >= 1
    # cleared: the keys have no limits again
    assert admin.delete(tenant_path(tenant)).status_code == 200
    assert admin.get(tenant_path(tenant)).status_code == 404
    for url in routers:
        await until(lambda url=url: chat(url, keys[0]).status_code == 200, "still limited")


async def test_a_tenant_budget_counts_every_key_and_refuses_them_all_once_spent(
    admin: httpx.Client, router_url: str
) -> None:
    tenant = new_tenant()
    keys = [issue(admin, tenant), issue(admin, tenant, rpm=1000)]
    r = admin.put(tenant_path(tenant), json={"budget_tokens": 10_000, "budget_period": "day"})
    assert r.status_code == 200 and r.json()["spent_tokens"] == 0
    for key in keys:
        await wait_status(router_url, key, 200)
    billed = 0
    for i in range(6):
        r = chat(router_url, keys[i % 2])
        assert r.status_code == 200, r.text
        billed += r.json()["usage"]["total_tokens"]

    def spent() -> int | None:
        value: int | None = admin.get(tenant_path(tenant)).json()["spent_tokens"]
        return value

    await until(lambda: spent() == billed, f"the ledger did not count {billed} tokens")
    listed = {t["tenant"]: t for t in admin.get("/admin/tenants").json()["data"]}
    assert listed[tenant]["spent_tokens"] == billed and not listed[tenant]["over_budget"]

    # The budget lowered below the spend: the ledger marks the tenant, every key is refused.
    admin.put(tenant_path(tenant), json={"budget_tokens": billed, "budget_period": "day"})
    await until(lambda: admin.get(tenant_path(tenant)).json()["over_budget"], "not marked")
    for key in keys:
        await until(lambda key=key: chat(router_url, key).status_code == 429, "not refused")
        error = chat(router_url, key).json()["error"]
        assert error["code"] == "insufficient_quota" and "tenant" in error["message"]
    # Raised: served again, and what was spent was counted once.
    admin.put(tenant_path(tenant), json={"budget_tokens": 10 * billed, "budget_period": "day"})
    await until(lambda: not admin.get(tenant_path(tenant)).json()["over_budget"], "still over")
    for key in keys:
        await until(lambda key=key: chat(router_url, key).status_code == 200, "not served")
    assert spent() is not None and spent() >= billed  # type: ignore[operator]


def test_bad_tenant_limits_are_a_clear_400(admin: httpx.Client) -> None:
    path = tenant_path(new_tenant())
    for body, where in [
        ({"rpm": 0}, "rpm"),
        ({"rpm": "6"}, "rpm"),
        ({"budget_tokens": 10}, "budget"),
        ({"budget_period": "week", "budget_tokens": 10}, "budget_period"),
        ({"weight": 2}, "weight"),
        ({"rpm": 2**53}, "rpm"),
        ({"budget_amount": "0", "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": "0.000", "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": 1.5, "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": "1.1234567891", "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": "-1", "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": "1e3", "budget_period": "day"}, "budget_amount"),
        ({"budget_amount": "5"}, "budget"),
        ({"budget_period": "day"}, "budget"),
        ({"budget_amount": "5", "budget_currency": "usd", "budget_period": "day"}, "currency"),
    ]:
        r = admin.put(path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert where in r.json()["error"]["message"], r.text
    assert admin.get(path).status_code == 404  # nothing was written
    long = tenant_path("x" * 201)
    assert admin.put(long, json={"rpm": 1}).status_code == 400
    assert admin.get(long).status_code == 400
    assert admin.delete(path).status_code == 404
    assert httpx.get(f"{admin.base_url}/admin/tenants", timeout=10).status_code == 401


async def spend_entry(stack: Stack, name: str) -> int:
    nc = await stack.nats.connect(name="test-spend")
    try:
        entry = await (await nc.jetstream().key_value("tg_spend")).get(name)
        return int(orjson.loads(entry.value or b"{}")["tokens"])
    except KeyNotFoundError:
        return 0
    finally:
        await nc.close()


@pytest.mark.usefixtures("lora_adapter")
async def test_a_budget_in_money_prices_calls_refuses_unpriced_models_and_counts_exactly(
    admin: httpx.Client, router_url: str, stack: Stack
) -> None:
    """SIM_ADAPTER is priced at 0.5 and 1.5 USD per million tokens; SIM_MODEL has no price."""
    tenant = new_tenant()
    created = admin.post(
        "/admin/keys",
        json={"tenant": tenant, "budget_amount": "0.001", "budget_period": "day"},
    )
    assert created.status_code == 201, created.text
    assert created.json()["record"]["budget_amount"] == "0.001"
    token, key_id = created.json()["key"], created.json()["record"]["key_id"]
    r = admin.put(tenant_path(tenant), json={"budget_amount": "2.5", "budget_period": "month"})
    assert r.status_code == 200 and r.json()["spent_amount"] == "0"
    await wait_status(router_url, token, 200)

    unpriced = chat(router_url, token)
    assert unpriced.status_code == 403, unpriced.text
    error = unpriced.json()["error"]
    assert error["code"] == "model_not_priced" and SIM_MODEL in error["message"]

    nanos = 0
    for _ in range(3):
        r = chat(router_url, token, model=SIM_ADAPTER)
        assert r.status_code == 200, r.text
        used = r.json()["usage"]
        nanos += used["prompt_tokens"] * 500 + used["completion_tokens"] * 1500
    day = time.strftime("%Y%m%d", time.gmtime())
    entry = f"money.{key_id}.{day}.USD"
    await until_async(lambda: spend_entry(stack, entry), nanos)
    spent = admin.get(tenant_path(tenant)).json()["spent_amount"]
    assert Decimal(spent) == Decimal(nanos).scaleb(-9)  # to the billionth

    # the key's budget lowered below what it spent: refused, as a spent budget is
    admin.patch(f"/admin/keys/{key_id}", json={"budget_amount": str(Decimal(nanos).scaleb(-9))})
    await until(lambda: chat(router_url, token, model=SIM_ADAPTER).status_code == 429, "served")
    error = chat(router_url, token, model=SIM_ADAPTER).json()["error"]
    assert error["code"] == "insufficient_quota"


async def until_async(read: object, expected: int, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while (value := await read()) != expected:  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{value} != {expected}"
        await asyncio.sleep(0.05)
