"""The auth service's Prometheus metrics (served on ``/metrics``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter as Tally
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from tollgate.keys.records import KeyRecord, KeyState

log = logging.getLogger("tollgate.auth.metrics")


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.keys = Gauge(
            "tollgate_auth_keys", "API keys on the whitelist, by state.", ["state"], registry=r
        )
        self.state_changes = Counter(
            "tollgate_auth_key_state_changes",
            "Keys the budget ledger moved to a state (over_budget: a spent budget).",
            ["state"],
            registry=r,
        )
        self.events = Counter(
            "tollgate_auth_usage_events", "Usage events the budget ledger counted.", registry=r
        )
        self.webhook_calls = Counter(
            "tollgate_auth_webhook_calls",
            "Calls of webhook endpoints with spend alerts, by result (delivered: a 2xx; failed: "
            "anything else, retried).",
            ["result"],
            registry=r,
        )
        self.alerts = Counter(
            "tollgate_auth_spend_alerts",
            "Spend alerts the budget ledger sent (a budget passed a threshold), by whose budget.",
            ["scope"],
            registry=r,
        )
        self.invalid_events = Counter(
            "tollgate_auth_usage_events_invalid",
            "Usage messages the budget ledger skipped: not a valid tg.usage.v1 event "
            "(malformed, or token counts, time or status out of range).",
            registry=r,
        )
        self.key_counts = KeyCounts(self.keys)


class KeyCounts:
    """Keys by state, and which have no budget, kept current from a watch of the keys bucket.

    The ``tollgate_auth_keys`` gauge follows every create, change and
    revocation as the bucket announces it, so a scrape reads nothing from
    NATS, however many keys there are. The budget ledger skips the usage
    events of keys known to have no budget without reading their record.
    """

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self.states: dict[str, KeyState] = {}
        self.unbudgeted: set[str] = set()  # keys whose record sets no budget
        self.synced = asyncio.Event()  # the bucket's current keys are all counted
        self._show()

    def apply(self, key_id: str, value: bytes | None) -> None:
        """One bucket entry: a record (its state), or None for a removed key."""
        self.unbudgeted.discard(key_id)
        if value is None:
            self.states.pop(key_id, None)
        else:
            try:
                record = KeyRecord.model_validate_json(value)
            except ValueError:
                log.error("malformed key record not counted", extra={"key_id": key_id})
                self.states.pop(key_id, None)
            else:
                self.states[key_id] = record.state
                if not record.budgeted:
                    self.unbudgeted.add(key_id)
        self._show()

    def _show(self) -> None:
        counts = Tally(self.states.values())
        for state in KeyState:
            self.gauge.labels(state.value).set(counts.get(state, 0))

    async def follow(self, kv: Any, reconnects: Callable[[], int] = lambda: 0) -> None:
        """Watch ``kv`` (the keys bucket) until cancelled; again after every reconnect.

        A watch is an ephemeral consumer that a NATS restart deletes, so a
        new one is started after a reconnect; each new watch replays the
        bucket and its snapshot replaces the counts at once.
        """
        while True:
            seen = reconnects()
            watch = asyncio.create_task(self._watch(kv))
            try:
                while not watch.done() and reconnects() == seen:
                    await asyncio.wait({watch}, timeout=0.5)
            finally:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    async def _watch(self, kv: Any) -> None:
        while True:
            try:
                watcher = await kv.watchall()
                snapshot: dict[str, KeyRecord] | None = {}
                async for entry in watcher:
                    if entry is None:  # the bucket's current keys are all in
                        if snapshot is not None:
                            self.states = {k: r.state for k, r in snapshot.items()}
                            self.unbudgeted = {k for k, r in snapshot.items() if not r.budgeted}
                            snapshot = None
                            self._show()
                            self.synced.set()
                        continue
                    value = None if entry.operation in ("DEL", "PURGE") else entry.value
                    if snapshot is None:
                        self.apply(entry.key, value)
                        continue
                    if value is None:
                        snapshot.pop(entry.key, None)
                    else:
                        with contextlib.suppress(ValueError):
                            snapshot[entry.key] = KeyRecord.model_validate_json(value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS restarting: watch again from the start
                log.warning("watch of the keys bucket failed: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(0.5)
