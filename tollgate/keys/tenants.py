"""Tenant-wide limits in JetStream KV (``tg_tenants``): the one writer API.

A tenant's record holds limits over all its keys together (requests and
tokens per minute, calls in flight, a token budget per period). Routers
mirror the bucket with the key whitelist and hold a call to both its key's
and its tenant's limits; the budget ledger counts the tenant's spend and
marks the record over budget. The admin API and ``tollgate tenants`` set and
clear the limits here; every change is revision-checked and audited.

Entries are keyed by the tenant's subject token (:func:`model_token`), so any
tenant name is a valid KV key and two names never share an entry.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from tollgate.keys.records import AuditEvent, TenantRecord
from tollgate.wire.subjects import model_token
from tollgate.wire.topology import Role, Topology, bucket_keys

LIMIT_FIELDS = (
    "rpm",
    "tpm",
    "max_concurrent",
    "budget_tokens",
    "budget_period",
    "budget_amount",
    "budget_currency",
    "alert_thresholds",
)


def tenant_key(tenant: str) -> str:
    """The tenant's entry in ``tg_tenants`` (and its part of counter names)."""
    return model_token(tenant)


def tenant_scope(tenant: str) -> str:
    """The tenant's part of a counter's or spend entry's name: ``t.<tenant key>``.

    A key id has no dot, so ``rpm.t.<tenant>.<minute>`` never meets a key's
    ``rpm.<key id>.<minute>``, nor ``t.<tenant>.<window>`` a key's ``<key id>.<window>``.
    """
    return f"t.{tenant_key(tenant)}"


class TenantStore:
    def __init__(
        self, js: Any, topology: Topology, actor: str = "tollgate", role: Role | None = None
    ) -> None:
        self.js = js
        self.topology = topology
        self.actor = actor
        self.role = role
        self.kv: Any = None

    async def open(self) -> TenantStore:
        topology = self.topology
        if self.role is None or self.role in topology.audit.writers:
            await topology.ensure_stream(self.js, topology.audit, self.role)
        self.kv = await topology.bucket(self.js, topology.tenants)
        return self

    async def _entry(self, tenant: str) -> tuple[TenantRecord, int] | None:
        try:
            entry = await self.kv.get(tenant_key(tenant))
        except KeyNotFoundError:
            return None
        if not entry.value:  # a delete marker
            return None
        return TenantRecord.model_validate_json(entry.value), entry.revision

    async def get(self, tenant: str) -> TenantRecord | None:
        found = await self._entry(tenant)
        return found[0] if found is not None else None

    async def all(self) -> list[TenantRecord]:
        names = await bucket_keys(self.js, self.topology.tenants.name)
        records = []
        for name in names:
            try:
                entry = await self.kv.get(name)
            except KeyNotFoundError:
                continue
            if entry.value:
                records.append(TenantRecord.model_validate_json(entry.value))
        return sorted(records, key=lambda r: r.tenant)

    async def update(
        self,
        tenant: str,
        change: Callable[[TenantRecord], dict[str, Any] | None],
        action: str = "tenant_update",
        create: bool = True,
    ) -> TenantRecord | None:
        """Apply ``change`` (fields to set, or None: nothing) to the tenant's record.

        A tenant without a record starts from one with no limits (``create``;
        else nothing is written and the answer is None). The write names the
        revision it read; a concurrent change makes it read again.
        """
        while True:
            found = await self._entry(tenant)
            if found is None and not create:
                return None
            current, revision = found if found is not None else (TenantRecord(tenant=tenant), 0)
            fields = change(current)
            if fields is None:
                return current
            updated = current.model_validate(
                {**current.model_dump(), **fields, "tenant": tenant, "updated_at": time.time()}
            )
            value = updated.model_dump_json().encode()
            try:
                if revision:
                    await self.kv.update(tenant_key(tenant), value, last=revision)
                else:
                    await self.kv.create(tenant_key(tenant), value)
            except KeyWrongLastSequenceError:
                continue
            await self._audit(action, updated)
            return updated

    async def set_limits(self, tenant: str, limits: dict[str, Any]) -> TenantRecord:
        """Replace the tenant's limits by ``limits`` (a field absent: no such limit)."""
        fields = {name: limits.get(name) for name in LIMIT_FIELDS}
        fields["budget_currency"] = fields["budget_currency"] or "USD"
        updated = await self.update(tenant, lambda _: fields, "tenant_set")
        assert updated is not None  # created when missing
        return updated

    async def clear(self, tenant: str) -> TenantRecord | None:
        """Remove the tenant's record: no tenant-wide limits (None: there was none)."""
        found = await self._entry(tenant)
        if found is None:
            return None
        await self.kv.delete(tenant_key(tenant))
        await self._audit("tenant_clear", found[0])
        return found[0]

    async def _audit(self, action: str, record: TenantRecord) -> None:
        event = AuditEvent(
            actor=self.actor,
            action=action,
            tenant=record.tenant,
            record=record.model_dump(mode="json"),
        )
        await self.js.publish(self.topology.subjects.audit, event.model_dump_json().encode())
