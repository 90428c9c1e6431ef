"""Spend alerts delivered to webhooks on a running stack: signed, retried while the receiver
is down, each alert once per endpoint, also after the auth service restarts."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import nats.js.errors
import pytest
from aiohttp import web

from tests.auth.test_admin import chat
from tests.conftest import Stack
from tests.lib.net import free_port
from tests.lib.streams import read_subject
from tests.router.test_auth import wait_status
from tollgate.keys.tokens import auth_dir
from tollgate.keys.webhooks import SIGNATURE_HEADER, sign, verify
from tollgate.wire import codec
from tollgate.wire.contracts import SpendAlert
from tollgate.wire.subjects import Subjects

pytestmark = pytest.mark.usefixtures("sim_workers")

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


@dataclass
class Receiver:
    """A webhook endpoint in the test: what it was sent, once it listens."""

    port: int = field(default_factory=free_port)
    calls: list[tuple[dict[str, str], bytes]] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/tollgate"

    async def listen(self) -> None:
        async def hook(request: web.Request) -> web.Response:
            self.calls.append((dict(request.headers), await request.read()))
            return web.Response(status=204)

        app = web.Application()
        app.router.add_post("/hooks/tollgate", hook)
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


def admin_client(base: str, stack: Stack) -> httpx.Client:
    token = (auth_dir(stack.var_dir) / "admin-token").read_text().strip()
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=10)


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
    stack: Stack, router_url: str, api_key: str, receiver: Receiver
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
    other = admin.post("/admin/webhooks", json={"url": receiver.url + "/other", "tenant": "x"})
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

    # The alerts are on the bus while the receiver is down: their calls fail (in this
    # auth service or another of the session, which share the consumer) and are retried.
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
