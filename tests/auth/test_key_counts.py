"""The auth service's key counts on ``/metrics`` follow a watch: a scrape reads no key."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.auth.ledger import BudgetLedger
from services.auth.metrics import AuthMetrics
from tests.conftest import NatsServer
from tollgate.keys.records import KeyRecord, KeyState
from tollgate.keys.store import KeyStore
from tollgate.wire import bus
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

KEYS = 120


def scrape(metrics: AuthMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    return {
        s.labels["state"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "tollgate_auth_keys"
    }


async def until(check: Any, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_a_scrape_reads_no_key_and_the_counts_follow_changes(
    nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    topology = Topology(Subjects(f"counts{uuid.uuid4().hex[:6]}"))
    nc = await nats_server.connect(name="test-key-counts")
    js = nc.jetstream()
    ledger: BudgetLedger | None = None
    task: asyncio.Task[None] | None = None
    try:
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="test").open()
        records = [KeyRecord(key_id=f"k{i:03d}", tenant="acme") for i in range(KEYS)]
        for record in records:
            await store.keys.put(record.key_id, record.model_dump_json().encode())
        for record in records[:10]:
            await store.revoke(record.key_id)

        metrics = AuthMetrics()
        ledger = BudgetLedger(js, store, topology, 3600, metrics)
        await ledger.open()
        task = asyncio.create_task(ledger.run())

        def counted(expected: dict[str, float]) -> bool:
            return scrape(metrics) == expected

        first = {"active": KEYS - 10.0, "revoked": 10.0, "over_budget": 0.0}
        await until(lambda: counted(first), f"the counts never reached {first}")

        # Every way of reading the bucket or the store, counted during scrapes.
        reads: Counter[str] = Counter()

        def spy(owner: Any, name: str) -> None:
            real = getattr(owner, name)

            async def counting(*args: Any, **kwargs: Any) -> Any:
                reads[name] += 1
                return await real(*args, **kwargs)

            monkeypatch.setattr(owner, name, counting)

        # (the ledger's hourly reconcile, which reads every key, held off meanwhile)
        async with ledger._one_at_a_time:
            for name in ("get", "keys", "history", "watch", "watchall"):
                spy(store.keys, name)
            for name in ("get", "all", "_entry"):
                spy(store, name)
            spy(js, "get_msg")
            for _ in range(5):
                assert scrape(metrics) == first
                await asyncio.sleep(0.05)  # the watch runs between scrapes, reading nothing
        assert sum(reads.values()) == 0, f"a scrape read the bucket: {dict(reads)}"
        monkeypatch.undo()

        # Creates, revocations and state changes reach the counts with no scrape-time read.
        for record in records[10:15]:
            await store.revoke(record.key_id)
        await store.update(records[20].key_id, lambda _: {"state": KeyState.OVER_BUDGET})
        for i in range(3):
            new = KeyRecord(key_id=f"new{i}", tenant="acme")
            await store.keys.put(new.key_id, new.model_dump_json().encode())
        later = {"active": KEYS - 16.0 + 3, "revoked": 15.0, "over_budget": 1.0}
        await until(lambda: counted(later), f"the counts never followed to {later}")
        await store.keys.delete("new0")
        gone = {**later, "active": later["active"] - 1}
        await until(lambda: counted(gone), "a removed key is still counted")
    finally:
        if ledger is not None and task is not None:
            ledger.stop()
            await asyncio.wait_for(task, 10)
        await bus.close(nc)
