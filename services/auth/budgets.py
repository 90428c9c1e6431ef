"""Budgets into ClickHouse: each version of a key's or tenant's budgets, as set.

Budgets live in the key and tenant records (NATS KV), where routers and the
budget ledger read them; analysts read spend in ClickHouse. To put the two side
by side, the auth service watches both buckets and publishes every version of
every record as a ``tg.budget.v1`` (``TG_BUDGETS``); the metering service
keeps the latest per key or tenant in ``budgets``.

A watch first delivers each record as it is now, then every change. After a
reconnect (a NATS restart deletes the watch) the watch starts again, so every
record is published again: ``Nats-Msg-Id`` (``<scope>.<id>.<revision>``)
drops copies within the stream's duplicate window, and the table keeps one row
per revision. Two auth replicas publish the same versions with the same ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from tollgate.keys.records import KeyRecord, Limits, TenantRecord
from tollgate.runtime.tasks import stop_tasks
from tollgate.wire import codec
from tollgate.wire.contracts import BudgetSet
from tollgate.wire.subjects import model_id_from_token
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.auth.budgets")


def budget_set(
    record: Limits, scope: str, tenant: str, key_id: str | None, revision: int, state: str
) -> BudgetSet:
    amount = record.budget_amount
    return BudgetSet(
        scope=scope,
        tenant=tenant,
        key_id=key_id,
        revision=revision,
        time=time.time(),
        period=record.budget_period,
        budget_tokens=record.budget_tokens,
        budget_amount=format(amount, "f") if amount is not None else None,
        budget_currency=record.budget_currency if amount is not None else None,
        state=state,
    )


class BudgetPublisher:
    """Follows ``tg_keys`` and ``tg_tenants``; publishes each record's budgets."""

    def __init__(self, js: Any, topology: Topology) -> None:
        self.js = js
        self.topology = topology
        self.published = 0
        # what each entry was, to name a deleted one (a deletion has no value)
        self._names: dict[tuple[str, str], tuple[str, str | None]] = {}

    async def follow(self, reconnects: Callable[[], int] = lambda: 0) -> None:
        """Watch both buckets until cancelled; again from the start after every reconnect."""
        while True:
            try:
                keys = await self.topology.bucket(self.js, self.topology.keys)
                tenants = await self.topology.bucket(self.js, self.topology.tenants)
                break
            except Exception as exc:  # NATS away at start: try again
                log.warning("key and tenant buckets not open yet: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(1.0)
        while True:
            seen = reconnects()
            watches = {
                asyncio.create_task(self._watch(keys, "key")),
                asyncio.create_task(self._watch(tenants, "tenant")),
            }
            try:
                while reconnects() == seen and not any(w.done() for w in watches):
                    await asyncio.wait(watches, timeout=0.5)
            finally:
                await stop_tasks(*watches)

    async def _watch(self, kv: Any, scope: str) -> None:
        while True:
            try:
                watcher = await kv.watchall()
                async for entry in watcher:
                    if entry is not None:
                        await self.publish_entry(kv, scope, entry)
            except Exception as exc:  # NATS restarting: watch (and publish) again
                log.warning("watch of %s records failed: %s: %s", scope, type(exc).__name__, exc)
                await asyncio.sleep(0.5)

    async def publish_entry(self, kv: Any, scope: str, entry: Any) -> None:
        """Publish one version of a record (a deletion: ``removed``)."""
        message = await self._message(kv, scope, entry)
        if message is None:
            return
        ident = message.key_id if scope == "key" else entry.key
        await self.js.publish(
            self.topology.subjects.budget(message.tenant),
            codec.encode(message),
            headers={"Nats-Msg-Id": f"{scope}.{ident}.{entry.revision}"},
            timeout=5,
        )
        self.published += 1

    async def _message(self, kv: Any, scope: str, entry: Any) -> BudgetSet | None:
        revision = int(entry.revision or 0)
        if entry.operation in ("DEL", "PURGE") or not entry.value:
            name = self._names.get((scope, entry.key))
            name = name or await self._last_name(kv, scope, entry.key)
            if name is None:
                return None
            return budget_set(Limits(), scope, name[0], name[1], revision, "removed")
        try:
            if scope == "key":
                key = KeyRecord.model_validate_json(entry.value)
                self._names[(scope, entry.key)] = (key.tenant, key.key_id)
                return budget_set(key, scope, key.tenant, key.key_id, revision, key.state.value)
            record = TenantRecord.model_validate_json(entry.value)
        except (ValidationError, ValueError):
            log.warning("a %s record that is not valid was not published", scope)
            return None
        self._names[(scope, entry.key)] = (record.tenant, None)
        state = "over_budget" if record.over_budget else "active"
        return budget_set(record, scope, record.tenant, None, revision, state)

    async def _last_name(self, kv: Any, scope: str, key: str) -> tuple[str, str | None] | None:
        """Whose record a deletion removed: a key's id is its name; a tenant's is decoded."""
        if scope == "tenant":
            with contextlib.suppress(ValueError, UnicodeDecodeError, IndexError):
                return model_id_from_token(key), None
            return None
        with contextlib.suppress(Exception):
            for old in reversed(await kv.history(key)):
                if old.value:
                    record = KeyRecord.model_validate_json(old.value)
                    return record.tenant, record.key_id
        return None
