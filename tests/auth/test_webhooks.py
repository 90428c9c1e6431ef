"""Spend alerts delivered to webhooks on a running stack: signed, retried while the receiver
is down, each alert once per endpoint, also after the auth service restarts."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors
import pytest
from aiohttp import web

from services.auth.webhooks import public_url
from tests.auth.conftest import admin_client
from tests.auth.test_admin import chat
from tests.conftest import Service, Stack
from tests.lib.net import free_port
from tests.lib.streams import read_subject
from tests.router.test_auth import wait_status
from tollgate.analytics import run_query
from tollgate.keys.webhooks import SIGNATURE_HEADER, sign, verify
from tollgate.wire import codec
from tollgate.wire.contracts import SpendAlert
from tollgate.wire.subjects import Subjects

pytestmark = pytest.mark.usefixtures("sim_workers")


@pytest.fixture(scope="module")
def metering(stack: Stack) -> Iterator[Service]:
    """The metering service: the delivery log and the budgets reach ClickHouse."""
    service, _ = stack.metering(TOLLGATE_METERING_BATCH_MAX_WAIT_S="0.3")
    yield service
    service.stop()


async def clickhouse(stack: Stack, sql: str, done: Callable[[list[list[Any]]], bool]) -> list[Any]:
    """Poll a read-only query until ``done`` holds for its rows (30 s at most)."""
    nc = await stack.nats.connect(name="test-billing-logs")
    try:
        deadline = time.monotonic() + 30
        while True:
            result = await run_query(nc, Subjects(), sql, timeout=30)
            assert result.error is None, result.error
            if done(result.rows) or time.monotonic() > deadline:
                return result.rows
            await asyncio.sleep(0.3)
    finally:
        await nc.close()


RETRY = {"TOLLGATE_AUTH_WEBHOOK_RETRY_S": "0.5", "TOLLGATE_AUTH_REACTIVATE_EVERY_S": "0.5"}


def test_a_signature_holds_for_its_body_secret_and_time_only() -> None:
    body = b'{"alert_id": "k.20261202.100.80"}'
    header = sign("whsec_one", body, now=1_800_000_000)
    assert header.startswith("t=1800000000,v1=")
    assert verify("whsec_one", header, body, now=1_800_000_100)
    assert not verify("whsec_two", header, body, now=1_800_000_100)  # another secret
    assert not verify("whsec_one", header, body + b" ", now=1_800_000_100)  # another body
    assert not verify("whsec_one", header, body, now=1_800_000_301)  # replayed too late
    stamp, _ = header.split(",")
    forged = f"t=1800000200,{header.split(',')[1]}"  # a new time on an old signature
    assert not verify("whsec_one", forged, body, now=1_800_000_200) and stamp
    assert not verify("whsec_one", "v1=abc", body) and not verify("whsec_one", "", body)


def test_the_delivery_log_keeps_no_secret_of_an_endpoint_url() -> None:
    assert public_url("https://user:pw@hooks.example.com:8443/t?token=s3cret#f") == (
        "https://hooks.example.com:8443/t"
    )
    assert public_url("http://[::1]:9000/hook?x=1") == "http://[::1]:9000/hook"
    assert public_url("https://example.com") == "https://example.com"
    assert public_url("http://example.com:99999/x?k=v") == "http://example.com:99999/x"
    # a port out of range, or a host that does not parse, keeps no credentials either
    assert public_url("http://u:pw@example.com:99999/x") == "http://example.com:99999/x"
    assert public_url("http://u:pw@[::1/x") == "unparsable"


@dataclass
class Receiver:
    """A webhook endpoint in the test: what it was sent, once it listens."""

    port: int = field(default_factory=free_port)
    calls: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/tollgate?token=receivers-own-secret"

    async def listen(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            self.calls.append((dict(request.headers), await request.read()))
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/hooks/tollgate", hook)
        app.router.add_post("/hooks/tollgate/other", hook)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    found = Receiver()
    yield found
    await found.close()


async def alerts_of(stack: Stack, tenant: str, count: int, timeout: float = 30) -> list[SpendAlert]:
    """The first ``count`` spend alerts of ``tenant`` on the bus, once they are there."""
    nc = await stack.nats.connect(name="test-alerts")
    try:
        js = nc.jetstream()
        subjects = Subjects()
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(nats.js.errors.NotFoundError):
                messages = await read_subject(
                    js, subjects.spend_alert(tenant), subjects.alerts_stream
                )
                if len(messages) >= count:
                    return [codec.decode(SpendAlert, m.data) for m in messages[:count]]
            assert time.monotonic() < deadline, "the alerts never reached the bus"
            await asyncio.sleep(0.1)
    finally:
        await nc.close()


async def test_alerts_reach_a_receiver_that_comes_up_late_signed_and_once(
    stack: Stack, router_url: str, api_key: str, receiver: Receiver, metering: Service
) -> None:
    service, base = stack.auth(**RETRY)
    admin = admin_client(base, stack)
    tenant = f"hooked-{uuid.uuid4().hex[:8]}"
    created = admin.post("/admin/webhooks", json={"url": receiver.url, "tenant": tenant})
    assert created.status_code == 201, created.text
    hook = created.json()
    secret, hook_id = hook["secret"], hook["webhook_id"]
    assert secret.startswith("whsec_") and hook["tenant"] == tenant
    listed = {h["webhook_id"]: h for h in admin.get("/admin/webhooks").json()["data"]}
    assert "secret" not in listed[hook_id]  # the secret is shown once
    # an endpoint of another tenant hears nothing of this one
    other_url = receiver.url.replace("/tollgate?", "/tollgate/other?")
    other = admin.post("/admin/webhooks", json={"url": other_url, "tenant": "x"})
    assert other.status_code == 201

    key = admin.post(
        "/admin/keys",
        json={
            "tenant": tenant,
            "budget_tokens": 100_000,
            "budget_period": "day",
            "alert_thresholds": [50, 100],
        },
    ).json()
    token, key_id = key["key"], key["record"]["key_id"]
    await wait_status(router_url, token, 200)
    billed = 0
    for _ in range(2):
        r = chat(router_url, token)
        assert r.status_code == 200, r.text
        billed += r.json()["usage"]["total_tokens"]
    # the budget lowered to what was spent: both thresholds are passed at once
    admin.patch(f"/admin/keys/{key_id}", json={"budget_tokens": billed})

    # The alerts are on the bus while the receiver is down: their calls fail and are
    # retried. Every auth service of the session shares the consumer and its delivery
    # count, so one with the default retry (5 s doubling) would wait minutes here: the
    # modules before this one stop theirs.
    js_alerts = await alerts_of(stack, tenant, 2)
    assert sorted(a.threshold_pct for a in js_alerts) == [50, 100]
    await asyncio.sleep(1.5)
    assert receiver.calls == []
    await receiver.listen()
    deadline = time.monotonic() + 90
    while len(receiver.calls) < 2:
        assert time.monotonic() < deadline, f"delivered {len(receiver.calls)} of 2"
        await asyncio.sleep(0.1)

    alerts = []
    for headers, body in receiver.calls:
        assert verify(secret, headers[SIGNATURE_HEADER], body)
        assert headers["Tollgate-Webhook"] == hook_id
        assert headers["Content-Type"] == "application/json"
        alert = codec.decode(SpendAlert, body)
        assert headers["Tollgate-Delivery"] == alert.alert_id
        alerts.append(alert)
    assert sorted(a.threshold_pct for a in alerts) == [50, 100]
    assert {(a.tenant, a.key_id, a.scope, a.unit, a.budget) for a in alerts} == {
        (tenant, key_id, "key", "tokens", str(billed))
    }

    # the auth service restarted mid-period: its reconciles and redeliveries send nothing twice
    service.stop()
    _, base = stack.auth(**RETRY)
    admin = admin_client(base, stack)
    await asyncio.sleep(3)  # several reconciles and retry rounds
    assert len(receiver.calls) == 2

    # The delivery log in ClickHouse: the failed attempts while the receiver was
    # down, then one delivery per alert; the endpoint without its query string.
    sql = (
        "SELECT alert_id, attempt, outcome, http_status, error, url, webhook_id"
        f" FROM webhook_calls WHERE tenant = '{tenant}' ORDER BY alert_id, time"
    )
    log = await clickhouse(stack, sql, lambda rows: sum(r[2] == "delivered" for r in rows) >= 2)
    by_alert: dict[str, list[list[Any]]] = {}
    for row in log:
        by_alert.setdefault(row[0], []).append(row)
    assert set(by_alert) == {a.alert_id for a in alerts}
    for calls in by_alert.values():
        *failed, delivered = calls
        assert failed and all(
            c[2] == "unreachable" and c[3] is None and c[4] == "ClientConnectorError"
            for c in failed
        ), calls
        assert delivered[2:4] == ["delivered", 204] and delivered[1] > failed[0][1]
        assert [c[1] for c in calls] == sorted(c[1] for c in calls)
    assert {(r[5], r[6]) for r in log} == {(receiver.url.split("?")[0], hook_id)}
    # the same log from the command line, newest first
    command = ["webhooks", "log", "--tenant", tenant, "--format", "json"]
    shown = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", *command],
        env={**os.environ, **stack.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    attempts = json.loads(shown.stdout)
    assert len(attempts) == len(log) and attempts[0]["outcome"] == "delivered"
    assert sorted(a["alert_id"] for a in attempts) == sorted(r[0] for r in log)
    assert admin.delete(f"/admin/webhooks/{hook_id}").json()["webhook_id"] == hook_id
    assert admin.delete(f"/admin/webhooks/{hook_id}").status_code == 404
    assert admin.delete(f"/admin/webhooks/{other.json()['webhook_id']}").status_code == 200


def test_a_webhook_needs_an_http_url(stack: Stack, api_key: str) -> None:
    _, base = stack.auth()
    admin = admin_client(base, stack)
    for body in [
        {"url": "ftp://example.com/hook"},
        {"url": "http://"},
        {"url": "https:// example.com/hook"},
        {"tenant": "acme"},
        {"url": "https://example.com/hook", "tenant": ""},
        {"url": "https://example.com/hook", "secret": "mine"},
    ]:
        r = admin.post("/admin/webhooks", json=body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["code"] == "invalid_request"
    assert admin.delete("/admin/webhooks/no-such-hook").status_code == 404


async def test_budgets_reach_clickhouse_as_they_change(stack: Stack, metering: Service) -> None:
    _, base = stack.auth()
    admin = admin_client(base, stack)
    tenant = f"budgeted-{uuid.uuid4().hex[:8]}"
    key = admin.post(
        "/admin/keys", json={"tenant": tenant, "budget_tokens": 5000, "budget_period": "month"}
    ).json()["record"]
    limits = {"budget_amount": "12.5", "budget_currency": "EUR", "budget_period": "day"}
    assert admin.put(f"/admin/tenants/{tenant}", json=limits).status_code == 200
    sql = (
        "SELECT scope, key_id, period, budget_tokens, toString(budget_amount), budget_currency"
        f" FROM budgets_current WHERE tenant = '{tenant}' ORDER BY scope"
    )
    want = [
        ["key", key["key_id"], "month", 5000, None, None],
        ["tenant", "", "day", None, "12.5", "EUR"],
    ]
    assert await clickhouse(stack, sql, lambda rows: rows == want) == want

    # a changed budget replaces the row; cleared limits and a revoked key leave the view
    assert admin.patch(f"/admin/keys/{key['key_id']}", json={"budget_tokens": 7000}).is_success
    want[0][3] = 7000
    assert await clickhouse(stack, sql, lambda rows: rows == want) == want
    assert admin.delete(f"/admin/tenants/{tenant}").is_success
    assert admin.delete(f"/admin/keys/{key['key_id']}").is_success
    assert await clickhouse(stack, sql, lambda rows: rows == []) == []
    states = await clickhouse(
        stack,
        f"SELECT scope, state FROM budgets FINAL WHERE tenant = '{tenant}' ORDER BY scope",
        lambda rows: len(rows) == 2,
    )
    assert states == [["key", "revoked"], ["tenant", "removed"]]
