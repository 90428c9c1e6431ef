"""The auth service's admin API, in process, on a real nats-server.

The app comes from its factory (``create_app``) on aiohttp's test server, under
a subject prefix of its own; each change is checked where it lands: the key
bucket and the audit stream.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import SecretStr

from services.auth.app import create_app
from services.auth.settings import AuthSettings
from tests.conftest import NatsServer
from tests.lib.streams import read_subject
from tollgate.keys.records import AuditEvent, KeyState
from tollgate.keys.store import KeyStore
from tollgate.wire.contracts import Priority
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

ADMIN_TOKEN = "tga-in-process-test-0123456789abcdefghijklmn"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.fixture
async def subjects() -> Subjects:
    return Subjects(f"auth-{uuid.uuid4().hex[:10]}")


@pytest.fixture
async def client(
    nats_server: NatsServer, tmp_path: Path, subjects: Subjects
) -> AsyncIterator[TestClient]:  # type: ignore[type-arg]
    common = nats_server.settings(Role.AUTH, subjects.prefix, var_dir=tmp_path)
    settings = AuthSettings(
        admin_token=SecretStr(ADMIN_TOKEN), signing_keys_file=tmp_path / "signing-keys.json"
    )
    async with TestClient(TestServer(create_app(settings, common))) as client:
        yield client


@pytest.fixture
async def store(nats_server: NatsServer, subjects: Subjects) -> AsyncIterator[KeyStore]:
    nc = await nats_server.connect(name="test-auth-store")
    try:
        yield await KeyStore(nc.jetstream(), Topology(subjects), actor="test").open()
    finally:
        await nc.close()


async def test_the_admin_api_needs_the_admin_token(client: TestClient) -> None:  # type: ignore[type-arg]
    refused = (
        {},
        {"Authorization": ""},
        {"Authorization": "Bearer tga-wrong"},
        {"Authorization": "Bearer "},
        {"Authorization": ADMIN_TOKEN},  # no scheme
        {"Authorization": f"Basic {ADMIN_TOKEN}"},
        {"Authorization": f"Token {ADMIN_TOKEN}"},
        {"Authorization": f"bearer {ADMIN_TOKEN}"},
        {"Authorization": f"Bearer  {ADMIN_TOKEN}"},
        {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
        {"X-Admin": ADMIN_TOKEN},
    )
    for headers in refused:
        r = await client.get("/admin/keys", headers=headers)
        assert r.status == 401, headers
        error = (await r.json())["error"]
        assert error["code"] == "invalid_admin_key" and error["type"] == "invalid_request_error"
        assert error["message"] and r.headers["WWW-Authenticate"] == "Bearer"
    r = await client.post("/admin/keys", json={"tenant": "acme"})
    assert r.status == 401
    assert (await client.get("/admin/keys", headers=ADMIN)).status == 200


async def test_a_key_is_created_listed_updated_and_revoked(
    client: TestClient,  # type: ignore[type-arg]
    store: KeyStore,
    subjects: Subjects,
) -> None:
    r = await client.post("/admin/keys", json={"tenant": "acme", "name": "ci"}, headers=ADMIN)
    assert r.status == 201
    created = await r.json()
    token, record = created["key"], created["record"]
    key_id = record["key_id"]
    assert token.startswith("tg-") and record["state"] == "active"
    stored = await store.get(key_id)
    assert stored is not None and stored.tenant == "acme" and stored.state is KeyState.ACTIVE

    r = await client.get("/admin/keys", headers=ADMIN)
    listing = await r.text()
    assert key_id in [k["key_id"] for k in (await r.json())["data"]]
    assert token not in listing  # the token is shown once, stored nowhere

    r = await client.patch(f"/admin/keys/{key_id}", json={"models": ["sim/*"]}, headers=ADMIN)
    assert r.status == 200 and (await r.json())["models"] == ["sim/*"]
    stored = await store.get(key_id)
    assert stored is not None and stored.models == ["sim/*"]

    r = await client.delete(f"/admin/keys/{key_id}", headers=ADMIN)
    assert r.status == 200 and (await r.json())["state"] == "revoked"
    r = await client.get(f"/admin/keys/{key_id}", headers=ADMIN)
    assert (await r.json())["state"] == "revoked"
    stored = await store.get(key_id)
    assert stored is not None and stored.state is KeyState.REVOKED

    trail = [
        AuditEvent.model_validate_json(m.data) for m in await read_subject(store.js, subjects.audit)
    ]
    assert [e.action for e in trail if e.key_id == key_id] == ["create", "update", "revoke"]


async def test_a_patch_on_a_revoked_key_is_a_409(
    client: TestClient,  # type: ignore[type-arg]
    store: KeyStore,
) -> None:
    r = await client.post("/admin/keys", json={"tenant": "acme"}, headers=ADMIN)
    key_id = (await r.json())["record"]["key_id"]
    assert (await client.delete(f"/admin/keys/{key_id}", headers=ADMIN)).status == 200
    r = await client.patch(f"/admin/keys/{key_id}", json={"name": "back"}, headers=ADMIN)
    assert r.status == 409
    error = (await r.json())["error"]
    assert error["code"] == "key_revoked" and error["type"] == "invalid_request_error"
    assert "revoked" in error["message"]
    stored = await store.get(key_id)
    assert stored is not None and stored.state is KeyState.REVOKED and stored.name == ""
    # revoking again answers with the revoked record
    r = await client.delete(f"/admin/keys/{key_id}", headers=ADMIN)
    assert r.status == 200 and (await r.json())["state"] == "revoked"


async def test_an_unknown_key_is_a_404(client: TestClient) -> None:  # type: ignore[type-arg]
    r = await client.get("/admin/keys/nope", headers=ADMIN)
    assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"


async def test_fair_share_settings_are_set_changed_and_kept_as_sent(
    client: TestClient,  # type: ignore[type-arg]
    store: KeyStore,
) -> None:
    r = await client.post("/admin/keys", json={"tenant": "acme"}, headers=ADMIN)
    record = (await r.json())["record"]
    defaults = {k: record[k] for k in ("max_concurrent", "weight", "priority", "priority_header")}
    assert defaults == {
        "max_concurrent": None,
        "weight": 1.0,
        "priority": "interactive",
        "priority_header": False,
    }
    body = {"tenant": "acme", "max_concurrent": 4, "weight": 0.5, "priority": "batch"}
    r = await client.post("/admin/keys", json=body, headers=ADMIN)
    assert r.status == 201, await r.text()
    key_id = (await r.json())["record"]["key_id"]
    stored = await store.get(key_id)
    assert stored is not None and stored.limited
    assert (stored.max_concurrent, stored.weight, stored.priority) == (4, 0.5, Priority.BATCH)

    change = {"priority_header": True, "weight": 20}
    r = await client.patch(f"/admin/keys/{key_id}", json=change, headers=ADMIN)
    assert r.status == 200, await r.text()
    answer = await r.json()
    assert answer["priority_header"] is True and answer["weight"] == 20
    assert answer["max_concurrent"] == 4 and answer["priority"] == "batch"  # kept
    # null lifts the concurrency limit, and what else the key had stays
    r = await client.patch(f"/admin/keys/{key_id}", json={"max_concurrent": None}, headers=ADMIN)
    stored = await store.get(key_id)
    assert r.status == 200 and stored is not None
    assert stored.max_concurrent is None and not stored.limited and stored.weight == 20


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_concurrent", 0),
        ("max_concurrent", 2**53),
        ("max_concurrent", "4"),
        ("max_concurrent", True),
        ("weight", 0),
        ("weight", -1),
        ("weight", 1000.5),
        ("weight", "2"),
        ("weight", None),  # a share is not a limit: no null
        ("priority", "urgent"),
        ("priority", None),
        ("priority_header", 1),
        ("priority_header", "true"),
        ("priority_header", None),
    ],
)
async def test_a_fair_share_setting_no_key_can_hold_is_a_400_naming_it(
    client: TestClient,  # type: ignore[type-arg]
    store: KeyStore,
    field: str,
    value: object,
) -> None:
    r = await client.post("/admin/keys", json={"tenant": "acme"}, headers=ADMIN)
    key_id = (await r.json())["record"]["key_id"]
    before = await store.get(key_id)
    r = await client.patch(f"/admin/keys/{key_id}", json={field: value}, headers=ADMIN)
    assert r.status == 400, await r.text()
    error = (await r.json())["error"]
    assert error["code"] == "invalid_request" and field in error["message"]
    assert await store.get(key_id) == before  # nothing written
    if value is not None:  # a new key cannot have it either
        r = await client.post("/admin/keys", json={"tenant": "acme", field: value}, headers=ADMIN)
        assert r.status == 400 and field in (await r.json())["error"]["message"]


async def test_a_value_nested_a_thousand_deep_is_a_400_not_a_500(
    client: TestClient,  # type: ignore[type-arg]
) -> None:
    # within what a JSON reader takes (1,024 levels), past Python's recursion limit
    deep = '{"a": ' * 1000 + "{}" + "}" * 1000
    body = f'{{"tenant": "acme", "priority": {deep}}}'.encode()
    r = await client.post(
        "/admin/keys", data=body, headers={**ADMIN, "Content-Type": "application/json"}
    )
    assert r.status == 400, await r.text()
    assert (await r.json())["error"]["type"] == "invalid_request_error"
