"""Budget accounting from usage events.

A durable consumer reads every usage event once and adds its tokens to the
key's spend for the period (KV ``tg_spend``). Each spend entry remembers the
stream sequence of the last event it counted, so a redelivered event is not
counted twice. A key whose spend reaches its budget is marked over budget in
its record (every router then refuses it at once); when a new period starts,
or its budget is raised, it becomes active again. Routers already refuse a
request whose worst case does not fit the budget; the ledger is the
authoritative count from usage events, and its mark also covers budgets an
admin lowers below what was spent.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import orjson
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.auth.metrics import AuthMetrics
from tollgate.keys.records import KeyRecord, KeyState, budget_window
from tollgate.keys.store import KeyStore
from tollgate.wire import codec
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.auth.ledger")


class BudgetLedger:
    def __init__(
        self,
        js: Any,
        store: KeyStore,
        topology: Topology,
        reactivate_every_s: float,
        metrics: AuthMetrics | None = None,
    ):
        self.metrics = metrics
        self.js = js
        self.store = store
        self.topology = topology
        self.reactivate_every_s = reactivate_every_s
        self.spend: Any = None
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        """Finish the current batch, then leave :meth:`run`."""
        self._stopping.set()

    async def open(self) -> None:
        await self.topology.ensure_stream(self.js, self.topology.usage)
        self.spend = await self.topology.bucket(self.js, self.topology.spend)

    async def spent(self, key_id: str, window: str) -> int:
        with contextlib.suppress(KeyNotFoundError):
            entry = await self.spend.get(f"{key_id}.{window}")
            return int(orjson.loads(entry.value or b"{}").get("tokens", 0))
        return 0

    async def run(self) -> None:
        consumer = self.topology.auth_budget
        sub = await self.js.pull_subscribe(
            consumer.filter_subject,
            durable=consumer.durable,
            stream=consumer.stream,
            config=consumer.config(max_ack_pending=10_000),
        )
        next_check = 0.0
        while not self._stopping.is_set():
            if time.monotonic() >= next_check:
                await self.reconcile()
                next_check = time.monotonic() + self.reactivate_every_s
            try:
                msgs = await sub.fetch(200, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as exc:
                log.warning("usage fetch failed: %s", type(exc).__name__)
                await asyncio.sleep(0.5)
                continue
            for msg in msgs:
                try:
                    event = codec.decode(UsageEvent, msg.data)
                except Exception:
                    log.error("malformed usage event skipped")
                    await msg.ack()
                    continue
                await self.count(event, msg.metadata.sequence.stream)
                await msg.ack()
                if self.metrics is not None:
                    self.metrics.events.inc()
        # A pull subscription left mid-fetch would hold up the connection's drain.
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

    async def count(self, event: UsageEvent, seq: int) -> None:
        if event.key_id is None:
            return
        record = await self.store.get(event.key_id)
        if record is None or record.budget_tokens is None or record.budget_period is None:
            return
        tokens = event.prompt_tokens + event.completion_tokens
        window = budget_window(record.budget_period, event.time)
        total = await self._add(f"{record.key_id}.{window}", tokens, seq)
        current = budget_window(record.budget_period, time.time())
        if total is not None and window == current and total >= record.budget_tokens:
            await self._set_state(record, KeyState.OVER_BUDGET, "over_budget")

    async def _add(self, key: str, tokens: int, seq: int) -> int | None:
        """Add once per stream sequence; the new total, or None if already counted."""
        while True:
            try:
                entry = await self.spend.get(key)
                state = orjson.loads(entry.value or b"{}")
                revision = entry.revision
            except KeyNotFoundError:
                state, revision = {"tokens": 0, "last_seq": 0}, 0
            if seq <= state.get("last_seq", 0):
                return None
            new = {"tokens": state.get("tokens", 0) + tokens, "last_seq": seq}
            try:
                if revision:
                    await self.spend.update(key, orjson.dumps(new), last=revision)
                else:
                    await self.spend.create(key, orjson.dumps(new))
                return int(new["tokens"])
            except KeyWrongLastSequenceError:
                continue

    async def _set_state(self, record: KeyRecord, state: KeyState, action: str) -> None:
        def change(current: KeyRecord) -> dict[str, Any] | None:
            # A revoked key stays revoked; an unchanged state is not written again.
            if current.state is state or current.state is KeyState.REVOKED:
                return None
            return {"state": state}

        if record.state is state or record.state is KeyState.REVOKED:
            return
        updated = await self.store.update(record.key_id, change, action)
        if updated is None or updated.state is not state:
            return
        if self.metrics is not None:
            self.metrics.state_changes.labels(state.value).inc()
        log.info("key state changed", extra={"key_id": record.key_id, "state": state.value})

    async def reconcile(self) -> None:
        """Match every key's state to its spend in the current period.

        Catches budgets changed by an admin (lowered: over budget; raised, or a
        new period begun: active again).
        """
        for record in await self.store.all():
            if record.state is KeyState.REVOKED:
                continue
            if record.budget_tokens is None or record.budget_period is None:
                await self._set_state(record, KeyState.ACTIVE, "reactivate")
                continue
            window = budget_window(record.budget_period, time.time())
            over = await self.spent(record.key_id, window) >= record.budget_tokens
            if over:
                await self._set_state(record, KeyState.OVER_BUDGET, "over_budget")
            else:
                await self._set_state(record, KeyState.ACTIVE, "reactivate")
