"""Revoked is final for every writer of key records, on a real nats-server.

Revocation races ledger-style updates (whose change may return any state) and
admin-style edits (each one field) in many interleavings; after each, the key
is revoked and every edit that was accepted is in the record.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from services.auth.admin import KeyAdmin, KeyRevokedError
from services.auth.protocol import UpdateKey
from tests.conftest import NatsServer
from tests.lib.streams import read_subject
from tollgate.keys.records import AuditEvent, KeyRecord, KeyState
from tollgate.keys.store import KeyExistsError, KeyStore
from tollgate.keys.tokens import SigningKeySet
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

ROUNDS = 40


@pytest.fixture
async def store(nats_server: NatsServer) -> AsyncIterator[KeyStore]:
    nc = await nats_server.connect(name="test-revocation")
    try:
        topology = Topology(Subjects(f"rev-{uuid.uuid4().hex[:10]}"))
        yield await KeyStore(nc.jetstream(), topology, actor="test").open()
    finally:
        await nc.close()


@pytest.fixture
def signing(tmp_path: Path) -> SigningKeySet:
    keys = SigningKeySet(tmp_path / "signing-keys.json")
    keys.generate("EdDSA")
    return keys


def state_to(state: KeyState) -> Callable[[KeyRecord], dict[str, Any]]:
    """A careless writer: sets the state whatever the record holds."""
    return lambda _: {"state": state}


async def test_a_revoked_record_is_returned_unchanged_whatever_the_change(
    store: KeyStore, signing: SigningKeySet
) -> None:
    _, record = await store.create(signing, tenant="acme")
    revoked = await store.revoke(record.key_id)
    assert revoked is not None and revoked.state is KeyState.REVOKED
    for change in (
        state_to(KeyState.ACTIVE),
        state_to(KeyState.OVER_BUDGET),
        lambda _: {"name": "renamed", "rpm": 5},
    ):
        after = await store.update(record.key_id, change, "reactivate")
        assert after == revoked
    assert await store.revoke(record.key_id) == revoked  # revoking again writes nothing
    assert await store.get(record.key_id) == revoked
    trail = [
        AuditEvent.model_validate_json(m.data)
        for m in await read_subject(store.js, store.topology.subjects.audit)
    ]
    assert [e.action for e in trail if e.key_id == record.key_id] == ["create", "revoke"]


async def test_a_new_record_never_overwrites_one(store: KeyStore, signing: SigningKeySet) -> None:
    _, record = await store.create(signing, tenant="acme")
    await store.revoke(record.key_id)
    with pytest.raises(KeyExistsError):
        await store.put(record.model_copy(update={"state": KeyState.ACTIVE}))
    stored = await store.get(record.key_id)
    assert stored is not None and stored.state is KeyState.REVOKED


async def test_the_admin_api_refuses_to_change_a_revoked_key(
    store: KeyStore, signing: SigningKeySet
) -> None:
    admin = KeyAdmin(store, signing)
    _, record = await store.create(signing, tenant="acme")
    await admin.revoke(record.key_id)
    with pytest.raises(KeyRevokedError):
        await admin.update(record.key_id, UpdateKey(name="back"))
    stored = await store.get(record.key_id)
    assert stored is not None and stored.state is KeyState.REVOKED and stored.name == ""


async def _jittered(op: Awaitable[Any]) -> Any:
    await asyncio.sleep(random.random() * 0.004)
    return await op


async def test_revocation_racing_ledger_and_admin_writers(
    store: KeyStore, signing: SigningKeySet
) -> None:
    random.seed(1234)
    admin = KeyAdmin(store, signing)
    edits: dict[str, tuple[UpdateKey, dict[str, Any]]] = {
        "name": (UpdateKey(name="ci"), {"name": "ci"}),
        "rpm": (UpdateKey(rpm=60), {"rpm": 60}),
        "tpm": (UpdateKey(tpm=9000), {"tpm": 9000}),
        "models": (UpdateKey(models=["sim/*"]), {"models": ["sim/*"]}),
        "budget": (UpdateKey(budget_tokens=500), {"budget_tokens": 500}),
    }
    refused_seen = accepted_seen = 0
    for _ in range(ROUNDS):
        _, record = await store.create(signing, tenant="race")
        key_id = record.key_id
        ops: list[tuple[str, Awaitable[Any]]] = [("revoke", store.revoke(key_id))]
        for name, (change, _) in edits.items():
            ops.append((f"admin:{name}", admin.update(key_id, change)))
        for state in (KeyState.ACTIVE, KeyState.OVER_BUDGET, KeyState.ACTIVE):
            ops.append((f"ledger:{state}", store.update(key_id, state_to(state), "reactivate")))
        random.shuffle(ops)
        results = await asyncio.gather(*(_jittered(op) for _, op in ops), return_exceptions=True)

        final = await store.get(key_id)
        assert final is not None
        assert final.state is KeyState.REVOKED, [name for name, _ in ops]
        for (name, _), result in zip(ops, results, strict=True):
            if isinstance(result, BaseException):
                # only an admin edit that came after the revocation is refused
                assert isinstance(result, KeyRevokedError), (name, result)
                refused_seen += 1
                continue
            assert isinstance(result, KeyRecord)
            if name.startswith("admin:"):
                # accepted: written before the revocation, and still there after it
                assert result.state is not KeyState.REVOKED
                for field, value in edits[name.removeprefix("admin:")][1].items():
                    assert getattr(final, field) == value, (name, final)
                accepted_seen += 1
    # the interleavings covered both outcomes
    assert refused_seen and accepted_seen
