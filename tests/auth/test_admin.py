"""The admin API on a running stack: key lifecycle, audit, rotation, budgets."""

from __future__ import annotations

import asyncio
import time

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SIM_MODEL, SLOW_MODEL, Stack
from tests.lib.streams import read_subject
from tests.router.test_auth import wait_status
from tollgate.wire.subjects import Subjects

pytestmark = pytest.mark.usefixtures("sim_workers")

CHAT = "/v1/chat/completions"
BODY = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def chat(router_url: str, token: str, **body: object) -> httpx.Response:
    return httpx.post(
        f"{router_url}{CHAT}",
        json={**BODY, **body},
        headers={"Authorization": f"Bearer {token}"},
        timeout=30,
    )


def test_admin_credential_is_required(admin: httpx.Client) -> None:
    base = str(admin.base_url).rstrip("/")
    assert httpx.get(f"{base}/admin/keys", timeout=5).status_code == 401
    wrong = httpx.get(
        f"{base}/admin/keys", headers={"Authorization": "Bearer tga-wrong"}, timeout=5
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_admin_key"


def test_bad_admin_input_is_a_clear_400(admin: httpx.Client) -> None:
    r = admin.post("/admin/keys", json={"tenant": "", "rpm": 0})
    assert r.status_code == 400 and "tenant" in r.json()["error"]["message"]
    r = admin.post("/admin/keys", content=b"{nope")
    assert r.status_code == 400
    assert admin.get("/admin/keys/nope").status_code == 404


def test_values_without_a_meaning_are_a_400(admin: httpx.Client) -> None:
    """An infinite lifetime (pydantic would take "inf") and a null name or model list."""
    r = admin.post("/admin/keys", json={"tenant": "acme", "ttl_s": "inf"})
    assert r.status_code == 400 and "ttl_s" in r.json()["error"]["message"], r.text
    created = admin.post("/admin/keys", json={"tenant": "acme"})
    assert created.status_code == 201, created.text
    key_id = created.json()["record"]["key_id"]
    for change in ({"name": None}, {"models": None}, {"expires_at": "inf"}):
        r = admin.patch(f"/admin/keys/{key_id}", json=change)
        assert r.status_code == 400, (change, r.text)
    # a limit still clears with null
    assert admin.patch(f"/admin/keys/{key_id}", json={"rpm": None}).status_code == 200


def test_numbers_are_json_numbers(admin: httpx.Client) -> None:
    """As the document types them: true is not 1 and "60" is not 60; 60.0 is the integer 60."""
    for field, value in (("rpm", True), ("tpm", "60"), ("ttl_s", True), ("ttl_s", "3600")):
        r = admin.post("/admin/keys", json={"tenant": "acme", field: value})
        assert r.status_code == 400, (field, value, r.text)
        assert (
            r.json()["error"]["message"]
            == f"Invalid value for '{field}': Input should be a JSON number."
        )
    created = admin.post("/admin/keys", json={"tenant": "acme", "rpm": 60.0, "ttl_s": 3600})
    assert created.status_code == 201, created.text
    key_id = created.json()["record"]["key_id"]
    assert created.json()["record"]["rpm"] == 60
    r = admin.patch(f"/admin/keys/{key_id}", json={"expires_at": False})
    assert r.status_code == 400, r.text


@pytest.mark.parametrize("limit", ["rpm", "tpm", "budget_tokens"])
def test_limits_are_stored_exactly_up_to_2_53_and_refused_past_it(
    admin: httpx.Client, limit: str
) -> None:
    """No limit is stored rounded: 2**53-1 is kept as sent, and every larger one is a 400
    naming the field, however many digits it has."""
    created = admin.post("/admin/keys", json={"tenant": "acme", limit: 2**53 - 1})
    assert created.status_code == 201, created.text
    record = created.json()["record"]
    assert record[limit] == 2**53 - 1
    key_id = record["key_id"]
    assert admin.get(f"/admin/keys/{key_id}").json()[limit] == 2**53 - 1
    json_type = {"Content-Type": "application/json"}
    for digits in (b"9007199254740992", b"18446744073709551617", b"1" + b"0" * 400, b"9" * 5000):
        for method, path, body in (
            ("POST", "/admin/keys", b'{"tenant": "acme", "%s": %s}'),
            ("PATCH", f"/admin/keys/{key_id}", b'{"%s": %s}'),
        ):
            r = admin.request(
                method, path, content=body % (limit.encode(), digits), headers=json_type
            )
            assert r.status_code == 400, (method, digits[:30], r.text)
            message = r.json()["error"]["message"]
            assert message.startswith(f"Invalid value for '{limit}'"), message
            assert len(message) < 200, message  # the number is not quoted back
    # the refused changes left the limit as it was
    assert admin.get(f"/admin/keys/{key_id}").json()[limit] == 2**53 - 1


async def test_key_lifecycle_reaches_the_router(
    admin: httpx.Client, router_url: str, stack: Stack
) -> None:
    created = admin.post("/admin/keys", json={"tenant": "acme", "name": "ci", "ttl_s": 3600})
    assert created.status_code == 201
    token, record = created.json()["key"], created.json()["record"]
    assert token.startswith("tg-") and record["state"] == "active"
    await wait_status(router_url, token, 200)
    assert chat(router_url, token).status_code == 200

    listed = admin.get("/admin/keys").json()["data"]
    assert record["key_id"] in [r["key_id"] for r in listed]
    assert token not in admin.get("/admin/keys").text  # the token is never stored

    changed = admin.patch(f"/admin/keys/{record['key_id']}", json={"models": [SLOW_MODEL]})
    assert changed.json()["models"] == [SLOW_MODEL]
    deadline = time.monotonic() + 30
    while chat(router_url, token).status_code != 404:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)

    assert admin.delete(f"/admin/keys/{record['key_id']}").json()["state"] == "revoked"
    await wait_status(router_url, token, 401)

    actions = await audit_actions(stack, record["key_id"])
    assert actions[:3] == ["create", "update", "revoke"]


async def audit_actions(stack: Stack, key_id: str) -> list[str]:
    nc = await stack.nats.connect(name="test-audit")
    try:
        js = nc.jetstream()
        actions = []
        for msg in await read_subject(js, Subjects().audit, stream=Subjects().audit_stream):
            event = orjson.loads(msg.data)
            if event.get("key_id") == key_id:
                actions.append(event["action"])
                assert "tg-" not in msg.data.decode()  # no token in the audit trail
        return actions
    finally:
        await nc.close()


async def test_rotation_and_retirement(admin: httpx.Client, router_url: str, api_key: str) -> None:
    first = admin.post("/admin/signing-keys/rotate", json={})
    assert first.status_code == 201
    middle_kid = first.json()["kid"]
    token = admin.post("/admin/keys", json={"tenant": "rot"}).json()["key"]
    await wait_status(router_url, token, 200)
    second = admin.post("/admin/signing-keys/rotate", json={"alg": "RS256"})
    newest = admin.post("/admin/keys", json={"tenant": "rot"}).json()["key"]
    await wait_status(router_url, newest, 200)
    assert second.json()["alg"] == "RS256"
    # the key signed by the middle signing key still works until that key is retired
    assert chat(router_url, token).status_code == 200
    assert admin.post(f"/admin/signing-keys/{second.json()['kid']}/retire").status_code == 400
    assert admin.post(f"/admin/signing-keys/{middle_kid}/retire").status_code == 200
    await wait_status(router_url, token, 401)
    assert chat(router_url, newest).status_code == 200
    assert chat(router_url, api_key).status_code == 200  # older signing key, not retired


async def spend_of(stack: Stack, key: str) -> int:
    nc = await stack.nats.connect(name="test-spend")
    try:
        entry = await (await nc.jetstream().key_value("tg_spend")).get(key)
        return int(orjson.loads(entry.value or b"{}")["tokens"])
    finally:
        await nc.close()


async def test_ledger_counts_usage_once_and_marks_the_key_over_budget(
    admin: httpx.Client, router_url: str, stack: Stack
) -> None:
    created = admin.post(
        "/admin/keys", json={"tenant": "budget", "budget_tokens": 1000, "budget_period": "day"}
    ).json()
    token, key_id = created["key"], created["record"]["key_id"]
    await wait_status(router_url, token, 200)
    billed = 0
    for _ in range(3):
        r = chat(router_url, token)
        assert r.status_code == 200, r.text
        billed += r.json()["usage"]["total_tokens"]
    key = f"{key_id}.{time.strftime('%Y%m%d', time.gmtime())}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if await spend_of(stack, key) == billed:
                break
        except Exception:
            pass
        assert time.monotonic() < deadline, "the ledger did not count the usage"
        await asyncio.sleep(0.05)

    # An admin lowers the budget below what was spent: the key is over budget.
    admin.patch(f"/admin/keys/{key_id}", json={"budget_tokens": billed - 1})
    deadline = time.monotonic() + 10
    while (r := chat(router_url, token)).status_code != 429:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert r.json()["error"]["code"] == "insufficient_quota"
    while admin.get(f"/admin/keys/{key_id}").json()["state"] != "over_budget":
        assert time.monotonic() < deadline, "the ledger did not mark the key"
        await asyncio.sleep(0.1)

    # Raised again: active, and the spend was counted once, not per retry.
    admin.patch(f"/admin/keys/{key_id}", json={"budget_tokens": 100_000})
    deadline = time.monotonic() + 10
    while chat(router_url, token).status_code != 200:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.1)
    assert admin.get(f"/admin/keys/{key_id}").json()["state"] == "active"
    assert await spend_of(stack, key) >= billed


def test_metrics_count_keys_by_state(admin: httpx.Client) -> None:
    def keys_by_state() -> dict[str, float]:
        text = admin.get("/metrics").text
        return {
            s.labels["state"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "tollgate_auth_keys"
        }

    before = keys_by_state()
    made = [admin.post("/admin/keys", json={"tenant": "metrics"}).json() for _ in range(3)]
    admin.delete(f"/admin/keys/{made[0]['record']['key_id']}")
    # the counts follow a watch of the bucket: they arrive a moment after the writes
    deadline = time.monotonic() + 10
    while True:
        after = keys_by_state()
        if after.get("active", 0) - before.get("active", 0) == 2 and (
            after.get("revoked", 0) - before.get("revoked", 0) == 1
        ):
            break
        assert time.monotonic() < deadline, (before, after)
        time.sleep(0.05)
    assert set(after) == {"active", "over_budget", "revoked"}
    # Scraped without the admin credential, as Prometheus does.
    assert httpx.get(f"{str(admin.base_url).rstrip('/')}/metrics", timeout=5).status_code == 200


def test_readiness_has_the_shape_every_service_uses(admin: httpx.Client) -> None:
    ready = httpx.get(f"{str(admin.base_url).rstrip('/')}/readyz", timeout=5)
    assert ready.status_code == 200
    assert ready.json() == {"ready": True, "checks": {"nats": True}}
