"""The whitelist and the public signing keys in JetStream KV, with an audit trail."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jwt
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from tollgate.keys.records import Algorithm, AuditEvent, KeyRecord, KeyState, SigningKey
from tollgate.keys.tokens import SigningKeySet, auth_dir, new_key, strip_prefix, write_secret
from tollgate.wire.topology import Role, Topology, bucket_keys


class KeyExistsError(Exception):
    """A new record's key id is already in the whitelist (records are never overwritten)."""


class KeyStore:
    """The whitelist and the public signing keys in JetStream KV: the one writer API.

    The auth service's admin API, its budget ledger and the ``tollgate keys``
    command all change key records through these methods. Every change is a
    revision-checked write (a concurrent change makes it read again and
    re-apply, never overwrite) and goes to the audit stream.

    Revoked is final, for every writer: :meth:`update` never writes over a
    revoked record, whatever its ``change`` returns, and :meth:`put` only
    creates. Because each write names the revision it read, a change racing a
    revocation either lands before it (and the revocation is written over it)
    or reads the revoked record again and is refused.
    """

    def __init__(
        self, js: Any, topology: Topology, actor: str = "tollgate", role: Role | None = None
    ) -> None:
        self.js = js
        self.topology = topology
        self.actor = actor
        self.role = role  # whose identity: a reader (the router) creates nothing
        self.keys: Any = None
        self.signing: Any = None

    async def audit(self, action: str, **fields: Any) -> None:
        event = AuditEvent(actor=self.actor, action=action, **fields)
        await self.js.publish(self.topology.subjects.audit, event.model_dump_json().encode())

    async def open(self) -> KeyStore:
        topology = self.topology
        if self.role is None or self.role in topology.audit.writers:
            await topology.ensure_stream(self.js, topology.audit, self.role)
        self.keys = await topology.bucket(self.js, topology.keys)
        self.signing = await topology.bucket(self.js, topology.signing_keys)
        return self

    async def create(
        self,
        signing: SigningKeySet,
        *,
        tenant: str,
        name: str = "",
        models: list[str] | None = None,
        ttl_s: float | None = None,
        **limits: Any,
    ) -> tuple[str, KeyRecord]:
        """Issue a key: the token (shown once, stored nowhere) and its new record."""
        token, record = new_key(
            signing, tenant=tenant, name=name, models=models, ttl_s=ttl_s, **limits
        )
        await self.put(record, "create")
        return token, record

    async def put(self, record: KeyRecord, action: str = "create") -> None:
        """Write a new key's record as it is; changes go through :meth:`update`.

        Raises :class:`KeyExistsError` when the key id is taken: an existing
        record (a revoked one above all) is never overwritten here.
        """
        try:
            await self.keys.create(record.key_id, record.model_dump_json().encode())
        except KeyWrongLastSequenceError:
            raise KeyExistsError(record.key_id) from None
        await self.audit(action, key_id=record.key_id, record=record.model_dump(mode="json"))

    async def _entry(self, key_id: str) -> tuple[KeyRecord, int] | None:
        try:
            entry = await self.keys.get(key_id)
        except KeyNotFoundError:
            return None
        if entry.value is None:
            return None
        return KeyRecord.model_validate_json(entry.value), entry.revision

    async def get(self, key_id: str) -> KeyRecord | None:
        found = await self._entry(key_id)
        return None if found is None else found[0]

    async def all(self) -> list[KeyRecord]:
        names = await bucket_keys(self.js, self.topology.keys.name)
        records = [await self.get(name) for name in names]
        return [r for r in records if r is not None]

    async def update(
        self,
        key_id: str,
        change: Callable[[KeyRecord], dict[str, Any] | None],
        action: str = "update",
    ) -> KeyRecord | None:
        """Apply ``change`` to the current record and write it if nobody wrote in between.

        ``change`` returns the fields to set, or None to leave the record as it
        is (then nothing is written). On a concurrent write the record is read
        again and ``change`` applied to the newer one. Returns the record after
        the change, or None when there is no such key.

        A revoked record is final: ``change`` is not called, nothing is
        written, and the revoked record is returned as it is. A caller tells
        the refusal by the returned ``state`` (``revoked``, where its change
        was not a revocation); :meth:`revoke` of a revoked key is a no-op.
        """
        while True:
            found = await self._entry(key_id)
            if found is None:
                return None
            record, revision = found
            if record.state is KeyState.REVOKED:
                return record
            fields = change(record)
            if fields is None:
                return record
            updated = KeyRecord.model_validate(
                {**record.model_dump(), **fields, "updated_at": time.time()}
            )
            try:
                await self.keys.update(key_id, updated.model_dump_json().encode(), last=revision)
            except KeyWrongLastSequenceError:
                continue
            await self.audit(action, key_id=key_id, record=updated.model_dump(mode="json"))
            return updated

    async def revoke(self, key_id: str) -> KeyRecord | None:
        return await self.update(key_id, lambda _: {"state": KeyState.REVOKED}, "revoke")

    async def publish_signing_key(self, key: SigningKey, action: str = "publish") -> None:
        await self.signing.put(key.kid, key.model_dump_json().encode())
        await self.audit(action, kid=key.kid)


async def bootstrap(js: Any, topology: Topology, var_dir: Path, alg: Algorithm = "EdDSA") -> str:
    """First start of the embedded stack: signing key, admin credential, demo key.

    Idempotent: later starts reuse what ``var/auth`` holds. Returns the demo key.
    """
    folder = auth_dir(var_dir)
    signing = SigningKeySet(folder / "signing-keys.json")
    if signing.current is None:
        signing.generate(alg)
    store = await KeyStore(js, topology, actor="tollgate up").open()
    for kid in signing.keys:
        await store.publish_signing_key(signing.public(kid))
    admin = folder / "admin-token"
    if not admin.exists():
        write_secret(admin, "tga-" + secrets.token_urlsafe(32))
    demo = folder / "demo-key"
    if demo.exists():
        token = demo.read_text().strip()
        key_id = jwt.decode(strip_prefix(token), options={"verify_signature": False})["jti"]
        if await store.get(key_id) is not None:
            return token
    token, _ = await store.create(signing, tenant="demo", name="demo key")
    write_secret(demo, token)
    return token
