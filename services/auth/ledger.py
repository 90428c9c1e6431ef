"""Budget accounting from usage events.

A durable consumer reads every usage event of a key with a token budget once
and adds its tokens to the key's spend for the period (KV ``tg_spend``); when
the key's tenant has a budget of its own (``tg_tenants``), to the tenant's
spend as well (``t.<tenant>.<period>``), and a tenant that reaches it is
marked over budget in its record. Most keys have no budget: routers publish
their events on ``…usage.<tenant>.plain``, which this consumer does not read
(``….budget`` is what it reads: the key's or its tenant's budget held part of
the call). A budget
set on a key while its calls run counts from its next call; the watch of the
keys bucket that keeps the key counts also knows which keys have none, and an
event of such a key is acked without reading the key's record.

Each spend entry remembers the stream sequences of the events it counted that
the consumer may still deliver again: those above the consumer's ack floor
(below it, every event is acked and never comes back). So a redelivered event
is not counted twice, and events counted out of order (two auth replicas
sharing the consumer, or a batch redelivered after later ones were counted)
are each counted once. A key whose spend reaches its budget is marked over budget in
its record (every router then refuses it at once); when a new period starts,
or its budget is raised, it becomes active again. Routers already refuse a
request whose worst case does not fit the budget; the ledger is the
authoritative count from usage events, and its mark also covers budgets an
admin lowers below what was spent.

Usage events arrive through a FastStream batch subscriber (typed: each message
read as a :class:`UsageEvent`, whose own validation refuses negative or absurd
token counts; such an event is acked, logged and counted as invalid, never
added to spend) on the durable ``auth-budget`` consumer. A
batch is counted in stream order and each message is acked right after it is
counted; :meth:`BudgetLedger.reconcile` runs between batches, never during one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from faststream import Context
from faststream.middlewares import AckPolicy
from faststream.nats import PullSub
from faststream.nats.message import NatsBatchMessage
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.auth.metrics import AuthMetrics
from tollgate.keys.records import (
    KeyRecord,
    KeyState,
    Limits,
    TenantRecord,
    amount_text,
    budget_window,
    money_entry,
)
from tollgate.keys.store import KeyStore
from tollgate.keys.tenants import TenantStore, tenant_scope
from tollgate.models.catalog import Catalog
from tollgate.wire import codec, control
from tollgate.wire.contracts import SpendAlert, UsageEvent
from tollgate.wire.permissions import inbox_prefix
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.auth.ledger")

BATCH = 200


@dataclass(frozen=True)
class _Budget:
    """One budget of a key or tenant: in tokens, or in billionths of a currency."""

    unit: str  # "tokens" or the currency
    limit: int

    def entry(self, name: str, window: str) -> str:
        if self.unit == "tokens":
            return f"{name}.{window}"
        return money_entry(name, window, self.unit)

    def show(self, amount: int) -> str:
        """An amount as people read it: tokens, or a decimal in the currency."""
        if self.unit == "tokens":
            return str(amount)
        return amount_text(amount)


def _budgets(limits: Limits) -> list[_Budget]:
    budgets = []
    if limits.budget_tokens is not None:
        budgets.append(_Budget("tokens", limits.budget_tokens))
    if limits.budget_nanos is not None:
        budgets.append(_Budget(limits.budget_currency, limits.budget_nanos))
    return budgets


# A batch is handed over when full or after this long: how late the ledger may
# count an event when traffic is light.
BATCH_WINDOW_S = 0.25


class BudgetLedger:
    def __init__(
        self,
        js: Any,
        store: KeyStore,
        topology: Topology,
        reactivate_every_s: float,
        metrics: AuthMetrics | None = None,
        catalog: Catalog | None = None,
    ):
        self.metrics = metrics
        self.catalog = catalog  # prices for budgets in money
        self._sent: set[str] = set()  # spend alerts known to be sent (their markers exist)
        self.js = js
        self.store = store
        self.topology = topology
        self.reactivate_every_s = reactivate_every_s
        self.spend: Any = None
        self.tenants: TenantStore | None = None  # opened by :meth:`open`
        self._stopping = asyncio.Event()
        # Counting and reconciling never interleave: a reconcile that read the
        # spend before a batch was counted must not reactivate what it marked.
        self._one_at_a_time = asyncio.Lock()

    def stop(self) -> None:
        """Leave :meth:`run` (the broker's stop finishes the batch in hand)."""
        self._stopping.set()

    async def open(self) -> None:
        await self.topology.ensure_stream(self.js, self.topology.usage, Role.AUTH)
        self.spend = await self.topology.bucket(self.js, self.topology.spend)
        self.tenants = await TenantStore(
            self.js, self.topology, actor="budget-ledger", role=Role.AUTH
        ).open()
        # Created here, or brought to this shape: a consumer made before the
        # usage subjects told budget keys' events apart read every event.
        consumer = self.topology.auth_budget
        await self.js.add_consumer(consumer.stream, self._consumer_config())

    def _consumer_config(self) -> Any:
        return self.topology.auth_budget.config(max_ack_pending=10_000)

    async def spent(self, key_id: str, window: str) -> int:
        """Tokens a key (or ``t.<tenant>``) has spent in a budget period."""
        return await self.spent_entry(f"{key_id}.{window}")

    async def spent_entry(self, entry: str) -> int:
        """What a spend entry has counted (tokens, or billionths of a currency)."""
        with contextlib.suppress(KeyNotFoundError):
            found = await self.spend.get(entry)
            return int(orjson.loads(found.value or b"{}").get("tokens", 0))
        return 0

    def subscribe(self, broker: control.ControlBroker) -> None:
        """Count usage events from the durable ``auth-budget`` consumer on ``broker``."""
        consumer = self.topology.auth_budget
        broker.subscriber(
            consumer.filter_subject,
            stream=control.stream(self.topology.usage),
            durable=consumer.durable,
            config=self._consumer_config(),
            pull_sub=PullSub(batch_size=BATCH, timeout=BATCH_WINDOW_S, batch=True),
            # pulled batches arrive in this identity's own inbox namespace
            inbox_prefix=f"{inbox_prefix(self.topology, Role.AUTH)}.".encode(),
            ack_policy=AckPolicy.MANUAL,  # each message once it is counted
            decoder=control.contracts(UsageEvent),
            title="auth-budget",
            description=consumer.what,
        )(self.count_batch)

    async def count_batch(
        self,
        events: list[UsageEvent | None],
        batch: Annotated[NatsBatchMessage, Context("message")],
    ) -> None:
        """Count a batch in stream order, acking each event once it is counted.

        An event that fails to count stays unacked with the rest of the batch
        and comes again after the consumer's ack wait; its stream sequence
        keeps it from being counted twice.
        """
        async with self._one_at_a_time:
            floor = await self._ack_floor()
            for event, msg in zip(events, batch.raw_message, strict=True):
                if event is None:
                    # Not a valid tg.usage.v1 event (the contract's checks: token
                    # counts, time, status): acked and skipped, never spend.
                    log.error(
                        "invalid usage event skipped",
                        extra={"stream_seq": msg.metadata.sequence.stream, "subject": msg.subject},
                    )
                    await msg.ack()
                    if self.metrics is not None:
                        self.metrics.invalid_events.inc()
                    continue
                await self.count(event, msg.metadata.sequence.stream, floor)
                await msg.ack()
                if self.metrics is not None:
                    self.metrics.events.inc()

    async def run(self) -> None:
        """Reconcile every ``reactivate_every_s`` until :meth:`stop`.

        Meanwhile the key counts of ``metrics`` follow a watch of the keys
        bucket (a ``/metrics`` scrape reads nothing from NATS).
        """
        follow = self._follow_keys()
        try:
            while not self._stopping.is_set():
                try:
                    async with self._one_at_a_time:
                        await self.reconcile()
                except Exception as exc:  # NATS away: the next round tries again
                    log.warning("reconcile failed: %s: %s", type(exc).__name__, exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.reactivate_every_s):
                        await self._stopping.wait()
        finally:
            if follow is not None:
                follow.cancel()
                await asyncio.gather(follow, return_exceptions=True)

    def _follow_keys(self) -> asyncio.Task[None] | None:
        """Keep ``metrics``' key counts from a watch of the (opened) store's keys bucket."""
        kv = getattr(self.store, "keys", None)
        if self.metrics is None or kv is None:
            return None
        nc = getattr(self.js, "_nc", None)  # the connection: a new watch after a reconnect

        def reconnects() -> int:
            return int(nc.stats["reconnects"]) if nc is not None else 0

        return asyncio.create_task(
            self.metrics.key_counts.follow(kv, reconnects), name="auth-key-counts"
        )

    async def _ack_floor(self) -> int:
        """The consumer's ack floor: every event at or below it is acked for good."""
        consumer = self.topology.auth_budget
        try:
            info = await self.js.consumer_info(consumer.stream, consumer.durable)
        except Exception as exc:  # counting goes on; the entries keep what they hold
            log.warning("reading the ack floor failed: %s: %s", type(exc).__name__, exc)
            return 0
        return int(info.ack_floor.stream_seq or 0) if info.ack_floor is not None else 0

    async def count(self, event: UsageEvent, seq: int, floor: int = 0) -> None:
        """Add ``event`` (stream sequence ``seq``) to its key's spend and its tenant's, once.

        ``floor`` is an ack floor of the consumer read before the event was
        delivered: sequences at or below it need not be remembered any more.
        """
        if event.key_id is None:
            return
        await self._count_key(event, seq, floor)
        await self._count_tenant(event, seq, floor)

    async def _count_tenant(self, event: UsageEvent, seq: int, floor: int) -> None:
        """Add the event to its tenant's spend when the tenant has a budget."""
        if self.tenants is None:
            return
        record = await self.tenants.get(event.tenant)
        if record is not None and await self._spend(
            record, tenant_scope(record.tenant), event, seq, floor
        ):
            await self._set_tenant(record, True)

    async def _count_key(self, event: UsageEvent, seq: int, floor: int) -> None:
        assert event.key_id is not None
        if self.metrics is not None and event.key_id in self.metrics.key_counts.unbudgeted:
            # Known from the watch to have no budget: nothing to count, nothing
            # to read. A budget set meanwhile counts from the moment the watch
            # shows it, as it counts from the moment the record has it.
            return
        record = await self.store.get(event.key_id)
        if record is not None and await self._spend(record, record.key_id, event, seq, floor):
            await self._set_state(record, KeyState.OVER_BUDGET, "over_budget")

    async def _spend(
        self, limits: Limits, name: str, event: UsageEvent, seq: int, floor: int
    ) -> bool:
        """Add the event to the spend entries of a key's or tenant's budgets (``name``).

        Tokens go to ``<name>.<window>``; with a budget in money, their cost at
        the catalog's price to ``money.<name>.<window>.<currency>`` (billionths).
        A total that passes an alert threshold of the current period sends
        its spend alert. True when that spends a budget of the current period
        (the event is new, of this period, and a total reaches its budget).
        """
        if limits.budget_period is None:
            return False
        window = budget_window(limits.budget_period, event.time)
        current = window == budget_window(limits.budget_period, time.time())
        spent = False
        for budget in _budgets(limits):
            amount = (
                event.prompt_tokens + event.completion_tokens
                if budget.unit == "tokens"
                else self._cost(event, budget.unit)
            )
            total = await self._add(budget.entry(name, window), amount, seq, floor)
            if total is None or not current:
                continue
            spent = spent or total >= budget.limit
            await self._alert(limits, name, event.tenant, event.key_id, window, budget, total)
        return spent

    async def _alert(
        self,
        limits: Limits,
        name: str,
        tenant: str,
        key_id: str | None,
        window: str,
        budget: _Budget,
        total: int,
    ) -> None:
        """Send the spend alert of each threshold ``total`` has reached, once.

        A marker in ``tg_spend`` records each alert sent; the alert goes out
        before its marker is written, with its id as ``Nats-Msg-Id``, so a
        ledger stopped between the two sends it again (the next count or
        reconcile) and the stream drops the copy. A failure is logged and
        retried at the next reconcile; counting goes on.
        """
        assert limits.budget_period is not None
        scope = "tenant" if name.startswith("t.") else "key"
        for pct in limits.thresholds:
            if total * 100 < pct * budget.limit:
                break
            alert_id = f"{budget.entry(name, window)}.{budget.limit}.{pct}"
            if alert_id in self._sent:
                continue
            marker = f"alert.{alert_id}"
            try:
                with contextlib.suppress(KeyNotFoundError):
                    await self.spend.get(marker)
                    self._sent.add(alert_id)
                    continue
                alert = SpendAlert(
                    alert_id=alert_id,
                    at=time.time(),
                    scope=scope,
                    tenant=tenant,
                    key_id=key_id if scope == "key" else None,
                    period=limits.budget_period,
                    window=window,
                    unit=budget.unit,
                    threshold_pct=pct,
                    budget=budget.show(budget.limit),
                    spent=budget.show(total),
                )
                await self.js.publish(
                    self.topology.subjects.spend_alert(tenant),
                    codec.encode(alert),
                    headers={"Nats-Msg-Id": alert_id},
                )
                with contextlib.suppress(KeyWrongLastSequenceError):
                    await self.spend.create(marker, b"1")
                self._sent.add(alert_id)
                log.info("spend alert sent", extra={"alert_id": alert_id, "tenant": tenant})
                if self.metrics is not None:
                    self.metrics.alerts.labels(scope).inc()
            except Exception as exc:  # the next reconcile sends it
                log.warning("spend alert not sent: %s: %s", type(exc).__name__, exc)
                return

    def _cost(self, event: UsageEvent, currency: str) -> int:
        """The event's cost in billionths of ``currency`` at the catalog's price (0: unpriced).

        Routers refuse a call of a model without a price in the budget's
        currency, so an unpriced event is one whose price ended mid-call.
        """
        price = self.catalog.price_at(event.model, event.time) if self.catalog else None
        if price is None or price.currency != currency:
            log.warning(
                "usage of a model without a price counted as 0 against a money budget",
                extra={"model": event.model, "currency": currency},
            )
            return 0
        return price.cost_nanos(event.prompt_tokens, event.completion_tokens)

    async def _add(self, key: str, amount: int, seq: int, floor: int) -> int | None:
        """Add once per stream sequence; the new total, or None if already counted.

        The entry keeps ``seqs``, the sequences it counted above ``floor``
        (the highest ack floor it has seen); anything at or below ``floor`` was
        acked, so it is either counted or not this key's.
        """
        while True:
            try:
                entry = await self.spend.get(key)
                state = orjson.loads(entry.value or b"{}")
                revision = entry.revision
            except KeyNotFoundError:
                state, revision = {}, 0
            # An entry written before ``seqs`` existed counted in order up to ``last_seq``.
            known_floor = int(state.get("floor", state.get("last_seq", 0)))
            counted = [int(s) for s in state.get("seqs", [])]
            if seq <= known_floor or seq in counted:
                return None
            new_floor = max(known_floor, floor)
            total = int(state.get("tokens", 0)) + amount
            seqs = sorted([s for s in counted if s > new_floor] + [seq])
            new = {
                "tokens": total,
                "floor": new_floor,
                "seqs": seqs,
                # what a ledger of the in-order format reads (a rolling update)
                "last_seq": max(seqs[-1], new_floor),
            }
            try:
                if revision:
                    await self.spend.update(key, orjson.dumps(new), last=revision)
                else:
                    await self.spend.create(key, orjson.dumps(new))
                return total
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

    async def _set_tenant(self, record: TenantRecord, over: bool) -> None:
        """Mark the tenant over budget (every router refuses its keys) or clear the mark."""
        if record.over_budget is over:
            return

        def change(current: TenantRecord) -> dict[str, Any] | None:
            return None if current.over_budget is over else {"over_budget": over}

        assert self.tenants is not None
        action = "tenant_over_budget" if over else "tenant_reactivate"
        updated = await self.tenants.update(record.tenant, change, action, create=False)
        if updated is not None and updated.over_budget is over:
            log.info("tenant budget state changed", extra={"tenant": record.tenant, "over": over})

    async def over_budget(
        self, limits: Limits, name: str, tenant: str, key_id: str | None = None
    ) -> bool:
        """Whether a budget of a key or tenant (``name``) is spent in the current period."""
        if limits.budget_period is None:
            return False
        window = budget_window(limits.budget_period, time.time())
        over = False
        for budget in _budgets(limits):
            total = await self.spent_entry(budget.entry(name, window))
            over = over or total >= budget.limit
            # an alert a stopped ledger did not send goes now
            await self._alert(limits, name, tenant, key_id, window, budget, total)
        return over

    async def reconcile_tenants(self) -> None:
        """Match every tenant's over-budget mark to its spend in the current period."""
        if self.tenants is None:
            return
        for record in await self.tenants.all():
            await self._set_tenant(
                record, await self.over_budget(record, tenant_scope(record.tenant), record.tenant)
            )

    async def reconcile(self) -> None:
        """Match every key's state, and every tenant's mark, to its spend in the current period.

        Catches budgets changed by an admin (lowered: over budget; raised, or a
        new period begun: active again).
        """
        await self.reconcile_tenants()
        for record in await self.store.all():
            if record.state is KeyState.REVOKED:
                continue
            if await self.over_budget(record, record.key_id, record.tenant, record.key_id):
                await self._set_state(record, KeyState.OVER_BUDGET, "over_budget")
            else:
                await self._set_state(record, KeyState.ACTIVE, "reactivate")
