"""The budget ledger's FastStream consumer: in memory (TestNatsBroker) and on a real nats-server.

In memory, the key store and the spend bucket are test doubles and each usage
event carries the JetStream ack subject a real delivery would have (so its
stream sequence is known). On the real server, the ledger runs on its durable
consumer as the auth service runs it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from decimal import Decimal
from types import SimpleNamespace
from typing import Any, cast

import orjson
import pytest
from faststream.nats import TestNatsBroker
from nats.aio.client import Client as NATS
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from services.auth.ledger import BudgetLedger
from services.auth.metrics import AuthMetrics
from tests.conftest import NatsServer
from tests.lib.streams import read_subject
from tollgate.keys.records import KeyRecord, KeyState, amount_text, budget_window, money_entry
from tollgate.keys.store import KeyStore
from tollgate.models.catalog import load_catalog
from tollgate.wire import bus, codec
from tollgate.wire.asyncapi import document
from tollgate.wire.contracts import SpendAlert, UsageEvent
from tollgate.wire.control import ControlBroker
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology


def usage(key_id: str | None, prompt: int, completion: int) -> UsageEvent:
    return UsageEvent(
        request_id=uuid.uuid4().hex,
        time=time.time(),
        tenant="acme",
        key_id=key_id,
        model="sim/echo-1",
        prompt_tokens=prompt,
        completion_tokens=completion,
        outcome="completed",
        streamed=False,
        total_s=0.1,
        http_status=200,
    )


class FakeSpend:
    """A key-value bucket with revisions, as the ledger uses tg_spend."""

    def __init__(self) -> None:
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = 0

    async def get(self, key: str) -> Any:
        if key not in self.entries:
            raise KeyNotFoundError
        value, revision = self.entries[key]
        return SimpleNamespace(value=value, revision=revision)

    async def create(self, key: str, value: bytes) -> int:
        if key in self.entries:
            raise KeyWrongLastSequenceError
        return self._put(key, value)

    async def update(self, key: str, value: bytes, last: int) -> int:
        if self.entries.get(key, (b"", 0))[1] != last:
            raise KeyWrongLastSequenceError
        return self._put(key, value)

    def _put(self, key: str, value: bytes) -> int:
        self.revision += 1
        self.entries[key] = (value, self.revision)
        return self.revision

    def tokens(self, key: str) -> int:
        return int(orjson.loads(self.entries[key][0])["tokens"])


class FakeKeys:
    """The key store's read and update API over a dict."""

    def __init__(self, *records: KeyRecord) -> None:
        self.records = {r.key_id: r for r in records}

    async def get(self, key_id: str) -> KeyRecord | None:
        return self.records.get(key_id)

    async def all(self) -> list[KeyRecord]:
        return list(self.records.values())

    async def update(
        self, key_id: str, change: Callable[[KeyRecord], dict[str, Any] | None], action: str
    ) -> KeyRecord | None:
        current = self.records[key_id]
        fields = change(current)
        if fields is not None:
            self.records[key_id] = current.model_copy(update=fields)
        return self.records[key_id]


class FakeJetStream:
    """What the ledger asks of JetStream besides the buckets: its consumer's ack floor, and
    publishing spend alerts (kept here)."""

    def __init__(self) -> None:
        self.ack_floor = 0
        self.published: list[tuple[str, bytes]] = []

    async def publish(self, subject: str, body: bytes, headers: Any = None) -> None:
        self.published.append((subject, body))

    async def consumer_info(self, stream: str, durable: str) -> Any:
        return SimpleNamespace(ack_floor=SimpleNamespace(stream_seq=self.ack_floor))


AuthBus = tuple[Topology, Any, KeyStore]


@pytest.fixture
async def auth_bus(nats_server: NatsServer) -> AsyncIterator[AuthBus]:
    """A topology of its own on the real nats-server, its auth streams and buckets, a key store."""
    topology = Topology(Subjects(f"ledger{uuid.uuid4().hex[:6]}"))
    nc = await nats_server.connect(name="test-ledger")
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.AUTH)
        yield topology, js, await KeyStore(js, topology, actor="test").open()
    finally:
        await bus.close(nc)


def ack_subject(seq: int, topology: Topology) -> str:
    """The reply subject of a JetStream delivery of stream sequence ``seq``."""
    consumer = topology.auth_budget
    return f"$JS.ACK.{consumer.stream}.{consumer.durable}.1.{seq}.{seq}.{time.time_ns()}.0"


@pytest.fixture
def in_memory() -> tuple[BudgetLedger, FakeKeys, FakeSpend, Topology]:
    topology = Topology(Subjects())
    keys = FakeKeys(
        KeyRecord(key_id="k1", tenant="acme", budget_tokens=100, budget_period="day"),
        KeyRecord(key_id="k2", tenant="acme"),
    )
    spend = FakeSpend()
    ledger = BudgetLedger(FakeJetStream(), cast(KeyStore, keys), topology, 3600, AuthMetrics())
    ledger.spend = spend
    return ledger, keys, spend, topology


async def test_events_counted_out_of_order_are_each_counted_once(
    in_memory: tuple[BudgetLedger, FakeKeys, FakeSpend, Topology],
) -> None:
    """Two replicas sharing the consumer, or a redelivered batch, count out of stream order."""
    ledger, _, spend, _ = in_memory
    key = f"k1.{budget_window('day', time.time())}"
    for seq, tokens in [(5, 1), (3, 2), (9, 4), (4, 8)]:
        await ledger.count(usage("k1", tokens, 0), seq, floor=2)
    assert spend.tokens(key) == 1 + 2 + 4 + 8
    for seq in (3, 4, 5, 9, 1, 2):  # redelivered, or acked before the floor was read
        await ledger.count(usage("k1", 100, 0), seq, floor=2)
    assert spend.tokens(key) == 15
    # Once the ack floor passes them, the sequences need not be kept.
    await ledger.count(usage("k1", 16, 0), 12, floor=5)
    state = orjson.loads(spend.entries[key][0])
    assert state["floor"] == 5 and state["seqs"] == [9, 12] and state["tokens"] == 31
    await ledger.count(usage("k1", 100, 0), 4, floor=5)
    assert spend.tokens(key) == 31


async def test_a_spend_entry_of_the_in_order_format_goes_on_from_its_last_sequence(
    in_memory: tuple[BudgetLedger, FakeKeys, FakeSpend, Topology],
) -> None:
    ledger, _, spend, _ = in_memory
    key = f"k1.{budget_window('day', time.time())}"
    await spend.create(key, orjson.dumps({"tokens": 40, "last_seq": 7}))
    await ledger.count(usage("k1", 100, 0), 7)  # counted before, in order
    await ledger.count(usage("k1", 2, 0), 8)
    assert spend.tokens(key) == 42


async def test_each_stream_sequence_is_counted_once_in_memory(
    in_memory: tuple[BudgetLedger, FakeKeys, FakeSpend, Topology],
) -> None:
    ledger, _, spend, topology = in_memory
    broker = ControlBroker(cast(NATS, None), name="test-auth")
    ledger.subscribe(broker)
    subject = topology.subjects.usage("acme")
    async with TestNatsBroker(broker) as br:
        for seq, (prompt, completion) in enumerate([(5, 7), (3, 4), (10, 1)], start=1):
            body = codec.encode(usage("k1", prompt, completion))
            await br.publish(body, subject, stream="TG_USAGE", reply_to=ack_subject(seq, topology))
        # Sequence 2 delivered again (a redelivery after a lost ack): not counted again.
        again = codec.encode(usage("k1", 3, 4))
        await br.publish(again, subject, stream="TG_USAGE", reply_to=ack_subject(2, topology))
        # A key without a budget has nothing to count.
        body = codec.encode(usage("k2", 50, 50))
        await br.publish(body, subject, stream="TG_USAGE", reply_to=ack_subject(4, topology))
    window = budget_window("day", time.time())
    assert spend.tokens(f"k1.{window}") == 12 + 7 + 11
    assert list(spend.entries) == [f"k1.{window}"]


async def test_a_key_the_watch_shows_without_a_budget_is_not_read(
    in_memory: tuple[BudgetLedger, FakeKeys, FakeSpend, Topology],
) -> None:
    """Its events cost no key lookup; a key given a budget is read and counted again."""
    ledger, keys, spend, _ = in_memory
    assert ledger.metrics is not None
    counts = ledger.metrics.key_counts
    for record in keys.records.values():  # as the keys bucket's watch delivers them
        counts.apply(record.key_id, record.model_dump_json().encode())
    assert counts.unbudgeted == {"k2"}
    reads: list[str] = []
    get = keys.get

    async def counted_get(key_id: str) -> KeyRecord | None:
        reads.append(key_id)
        return await get(key_id)

    keys.get = counted_get  # type: ignore[method-assign]
    window = budget_window("day", time.time())
    await ledger.count(usage("k2", 50, 50), 1)
    await ledger.count(usage("k1", 5, 5), 2)
    assert reads == ["k1"] and list(spend.entries) == [f"k1.{window}"]
    # k2 gets a budget: the watch shows it, and its events count from then on
    budgeted = keys.records["k2"].model_copy(update={"budget_tokens": 10, "budget_period": "day"})
    keys.records["k2"] = budgeted
    counts.apply("k2", budgeted.model_dump_json().encode())
    assert counts.unbudgeted == set()
    await ledger.count(usage("k2", 3, 4), 3)
    assert reads == ["k1", "k2"] and spend.tokens(f"k2.{window}") == 7


async def test_a_malformed_event_is_skipped_and_the_budget_marked_in_memory(
    in_memory: tuple[BudgetLedger, FakeKeys, FakeSpend, Topology],
) -> None:
    ledger, keys, spend, topology = in_memory
    broker = ControlBroker(cast(NATS, None), name="test-auth")
    ledger.subscribe(broker)
    subject = topology.subjects.usage("acme")
    async with TestNatsBroker(broker) as br:
        await br.publish(
            b"{not json", subject, stream="TG_USAGE", reply_to=ack_subject(1, topology)
        )
        await br.publish(
            b'{"type": "tg.usage.v1"}',
            subject,
            stream="TG_USAGE",
            reply_to=ack_subject(2, topology),
        )
        body = codec.encode(usage("k1", 60, 40))
        await br.publish(body, subject, stream="TG_USAGE", reply_to=ack_subject(3, topology))
    assert spend.tokens(f"k1.{budget_window('day', time.time())}") == 100
    assert keys.records["k1"].state is KeyState.OVER_BUDGET
    assert ledger.metrics is not None
    counted = ledger.metrics.registry.get_sample_value("tollgate_auth_usage_events_total")
    assert counted == 1  # the two malformed ones are not events


def test_the_ledgers_faststream_channel_is_in_the_bus_document() -> None:
    """FastStream's own AsyncAPI of the auth broker names a channel the topology's document has."""
    from faststream.specification import AsyncAPI

    topology = Topology(Subjects())
    broker = ControlBroker(cast(NATS, None), name="auth")
    BudgetLedger(None, cast(KeyStore, FakeKeys()), topology, 3600).subscribe(broker)
    theirs = AsyncAPI(broker, schema_version="3.0.0").to_specification().to_jsonable()
    subjects = {c["address"] for c in theirs["channels"].values()}
    assert subjects == {"tg.usage.*.budget"}
    ours = document(topology)
    assert ours["channels"]["usage"]["x-tollgate"]["stream"] == "TG_USAGE"
    consumer = ours["operations"]["auth.receives.usage"]["x-tollgate-consumer"]
    assert consumer["durable"] == topology.auth_budget.durable


# -- on a real nats-server ------------------------------------------------------


async def spend_of(spend: Any, key: str) -> int:
    try:
        entry = await spend.get(key)
    except KeyNotFoundError:
        return 0
    return int(orjson.loads(entry.value)["tokens"])


async def wait_for(check: Callable[[], Any], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


async def test_the_ledger_counts_acks_and_stops_cleanly_on_nats(nats_server: NatsServer) -> None:
    topology = Topology(Subjects(f"ledger{uuid.uuid4().hex[:6]}"))
    nc = await nats_server.connect(name="test-ledger")
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="test").open()
        record = KeyRecord(key_id="k1", tenant="acme", budget_tokens=10**9, budget_period="day")
        await store.keys.put(record.key_id, record.model_dump_json().encode())
        subject = topology.subjects.usage("acme")
        key = f"k1.{budget_window('day', time.time())}"

        async def publish(*bodies: bytes) -> None:
            for body in bodies:
                await js.publish(subject, body, headers={"Nats-Msg-Id": uuid.uuid4().hex})

        await publish(b"{not json", *(codec.encode(usage("k1", 10, i)) for i in range(20)))
        expected = sum(10 + i for i in range(20))

        ledger = BudgetLedger(js, store, topology, 3600)
        await ledger.open()
        broker = ControlBroker(nc, name="test-auth", graceful_timeout=10)
        ledger.subscribe(broker)
        await broker.start()

        async def counted() -> bool:
            return await spend_of(ledger.spend, key) == expected

        await wait_for(counted, "the ledger did not count the events")

        # Stopping waits for the batch in hand: counted and acked, not cut off.
        # The three events may come in one batch or, when a pull's window ends
        # between their publishes, the first in a batch of its own; the events
        # not in hand at the stop wait in the stream.
        gate, began = asyncio.Event(), asyncio.Event()
        count = ledger.count
        in_hand = 0

        async def held(event: UsageEvent, seq: int, floor: int = 0) -> None:
            nonlocal in_hand
            in_hand += 1
            began.set()
            await gate.wait()
            await count(event, seq, floor)

        ledger.count = held  # type: ignore[method-assign]
        await publish(*(codec.encode(usage("k1", 1, 0)) for _ in range(3)))
        await asyncio.wait_for(began.wait(), 10)
        stopping = asyncio.create_task(broker.stop())
        done, _ = await asyncio.wait({stopping}, timeout=0.3)
        assert not done, "stop did not wait for the batch in hand"
        gate.set()
        await stopping
        assert 1 <= in_hand <= 3
        assert await spend_of(ledger.spend, key) == expected + in_hand
        info = await js.consumer_info(topology.usage.name, topology.auth_budget.durable)
        assert info.num_ack_pending == 0 and info.num_pending == 3 - in_hand
        assert not nc.is_closed  # the connection is the service's to drain

        # Events published while it was stopped are counted once it runs again.
        ledger.count = count  # type: ignore[method-assign]
        await publish(*(codec.encode(usage("k1", 2, 0)) for _ in range(4)))
        broker = ControlBroker(nc, name="test-auth")
        ledger.subscribe(broker)
        await broker.start()

        async def all_counted() -> bool:
            return await spend_of(ledger.spend, key) == expected + 3 + 8

        await wait_for(all_counted, "the ledger did not resume from its durable consumer")
        await broker.stop()
    finally:
        await bus.close(nc)


async def test_an_invalid_usage_event_is_never_spend_on_nats(nats_server: NatsServer) -> None:
    """Negative or absurd token counts on the usage stream: acked, logged, counted, not spent."""
    topology = Topology(Subjects(f"ledger{uuid.uuid4().hex[:6]}"))
    nc = await nats_server.connect(name="test-ledger-invalid")  # the operator
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="test").open()
        record = KeyRecord(key_id="k1", tenant="acme", budget_tokens=10**9, budget_period="day")
        await store.keys.put(record.key_id, record.model_dump_json().encode())
        key = f"k1.{budget_window('day', time.time())}"

        def forged(**fields: Any) -> bytes:
            return orjson.dumps({**orjson.loads(codec.encode(usage("k1", 10, 10))), **fields})

        bodies = [
            codec.encode(usage("k1", 5, 5)),
            forged(prompt_tokens=-1_000_000),  # a credit
            forged(completion_tokens=-5),
            forged(prompt_tokens=2**40),  # no request is that long
            codec.encode(usage("k1", 7, 3)),
        ]
        for body in bodies:
            await js.publish(
                topology.subjects.usage("acme"), body, headers={"Nats-Msg-Id": uuid.uuid4().hex}
            )

        metrics = AuthMetrics()
        ledger = BudgetLedger(js, store, topology, 3600, metrics)
        await ledger.open()
        broker = ControlBroker(nc, name="test-auth", graceful_timeout=10)
        ledger.subscribe(broker)
        await broker.start()

        async def all_acked() -> bool:
            info = await js.consumer_info(topology.usage.name, topology.auth_budget.durable)
            return (
                info.num_ack_pending == 0
                and info.num_pending == 0
                and info.delivered.stream_seq == 5
            )

        await wait_for(all_acked, "the ledger did not ack every message")
        await broker.stop()
        assert await spend_of(ledger.spend, key) == 10 + 10
        assert metrics.registry.get_sample_value("tollgate_auth_usage_events_total") == 2
        assert metrics.registry.get_sample_value("tollgate_auth_usage_events_invalid_total") == 3
    finally:
        await bus.close(nc)


def test_the_pull_loop_survives_every_timeout_a_fetch_raises() -> None:
    """A fetch whose window ran out raises asyncio's TimeoutError, not nats.py's:
    the control plane's pull loop must treat both as an empty pull."""
    from faststream.nats.subscriber.usecases import stream_pull_subscriber
    from nats.errors import TimeoutError as NatsTimeoutError

    import tollgate.wire.control  # noqa: F401 - the module that fixes the loop

    caught = stream_pull_subscriber.TimeoutError
    assert issubclass(asyncio.TimeoutError, caught)
    assert issubclass(NatsTimeoutError, caught)


async def test_the_ledger_reads_only_budget_keys_events_and_updates_an_older_consumer(
    nats_server: NatsServer,
) -> None:
    """Events of keys without a budget never reach the ledger's consumer.

    A consumer made when the ledger read every usage event (filter
    ``…usage.*``) is brought to the budget-only filter when the ledger opens.
    """
    topology = Topology(Subjects(f"ledger{uuid.uuid4().hex[:6]}"))
    subjects = topology.subjects
    nc = await nats_server.connect(name="test-ledger-split")
    js = nc.jetstream()
    try:
        await topology.ensure(js, Role.AUTH)
        consumer = topology.auth_budget
        older = consumer.config(max_ack_pending=10_000)
        older.filter_subject = f"{subjects.prefix}.usage.*"
        await js.add_consumer(consumer.stream, older)
        store = await KeyStore(js, topology, actor="test").open()
        record = KeyRecord(key_id="k1", tenant="acme", budget_tokens=10**9, budget_period="day")
        await store.keys.put(record.key_id, record.model_dump_json().encode())
        key = f"k1.{budget_window('day', time.time())}"

        ledger = BudgetLedger(js, store, topology, 3600)
        await ledger.open()
        info = await js.consumer_info(consumer.stream, consumer.durable)
        assert info.config.filter_subject == subjects.usage_budget

        async def publish(subject: str, event: UsageEvent) -> None:
            await js.publish(
                subject, codec.encode(event), headers={"Nats-Msg-Id": uuid.uuid4().hex}
            )

        for _ in range(5):  # routers sent these as the events of a key without a budget
            await publish(subjects.usage("acme", budget=False), usage("k1", 100, 100))
        await publish(subjects.usage("acme", budget=True), usage("k1", 10, 5))
        info = await js.consumer_info(consumer.stream, consumer.durable)
        assert info.num_pending == 1  # only the budget key's event waits for the ledger
        stream = await js.stream_info(topology.usage.name)
        assert stream.state.messages == 6  # metering has them all

        broker = ControlBroker(nc, name="test-auth", graceful_timeout=10)
        ledger.subscribe(broker)
        await broker.start()

        async def counted() -> bool:
            return await spend_of(ledger.spend, key) == 15

        await wait_for(counted, "the ledger did not count the budget key's event")
        await broker.stop()
        assert await spend_of(ledger.spend, key) == 15
    finally:
        await bus.close(nc)


async def test_two_ledgers_sharing_the_consumer_count_every_event_once(
    nats_server: NatsServer,
) -> None:
    """Two auth replicas (or an old and a new one in a rolling update) on one durable consumer."""
    topology = Topology(Subjects(f"ledger{uuid.uuid4().hex[:6]}"))
    nc = await nats_server.connect(name="test-ledger-pair")
    js = nc.jetstream()
    brokers: list[ControlBroker] = []
    try:
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="test").open()
        record = KeyRecord(key_id="k1", tenant="acme", budget_tokens=10**9, budget_period="day")
        await store.keys.put(record.key_id, record.model_dump_json().encode())
        key = f"k1.{budget_window('day', time.time())}"
        ledgers = [BudgetLedger(js, store, topology, 3600) for _ in range(2)]
        for ledger in ledgers:
            await ledger.open()
            broker = ControlBroker(nc, name="test-auth", graceful_timeout=10)
            ledger.subscribe(broker)
            await broker.start()
            brokers.append(broker)
        subject = topology.subjects.usage("acme", budget=True)
        expected = 0
        for burst in range(20):  # bursts, so both replicas pull batches meanwhile
            for i in range(10):
                tokens = burst * 10 + i + 1
                expected += tokens
                await js.publish(
                    subject,
                    codec.encode(usage("k1", tokens, 0)),
                    headers={"Nats-Msg-Id": uuid.uuid4().hex},
                )
            await asyncio.sleep(0.05)

        async def counted() -> bool:
            info = await js.consumer_info(topology.usage.name, topology.auth_budget.durable)
            return (info.num_pending, info.num_ack_pending) == (0, 0)

        await wait_for(counted, "the ledgers did not count every event", timeout=60)
        assert await spend_of(ledgers[0].spend, key) == expected
    finally:
        for broker in brokers:
            await broker.stop()
        await bus.close(nc)


async def test_a_tenants_budget_counts_every_key_once_and_marks_the_tenant(
    auth_bus: AuthBus,
) -> None:
    topology, js, store = auth_bus
    budgeted = KeyRecord(key_id="k1", tenant="acme", budget_tokens=10**9, budget_period="day")
    plain = KeyRecord(key_id="k2", tenant="acme")
    for record in (budgeted, plain):
        await store.keys.put(record.key_id, record.model_dump_json().encode())
    metrics = AuthMetrics()
    metrics.key_counts.unbudgeted.add("k2")  # as the watch shows it: no budget of its own
    ledger = BudgetLedger(js, store, topology, 3600, metrics)
    await ledger.open()
    assert ledger.tenants is not None
    await ledger.tenants.set_limits("acme", {"budget_tokens": 100, "budget_period": "day"})
    window = budget_window("day", time.time())
    for seq, key in enumerate(["k1", "k2", "k2", "k1"], start=1):
        await ledger.count(usage(key, 10, 10), seq)
    await ledger.count(usage("k2", 10, 10), 2)  # redelivered: counted once
    assert await ledger.spent("t.acme", window) == 80
    assert await ledger.spent("k1", window) == 40  # the key's own budget: its events only
    tenant = await ledger.tenants.get("acme")
    assert tenant is not None and not tenant.over_budget
    await ledger.count(usage("k2", 15, 5), 5)
    tenant = await ledger.tenants.get("acme")
    assert tenant is not None and tenant.over_budget
    # an admin raises the budget: the next reconcile clears the mark
    await ledger.tenants.set_limits("acme", {"budget_tokens": 1000, "budget_period": "day"})
    assert (await ledger.tenants.get("acme")).over_budget  # type: ignore[union-attr]
    await ledger.reconcile()
    tenant = await ledger.tenants.get("acme")
    assert tenant is not None and not tenant.over_budget
    # lowered below the spend: the reconcile marks it again
    await ledger.tenants.set_limits("acme", {"budget_tokens": 50, "budget_period": "day"})
    await ledger.reconcile()
    assert (await ledger.tenants.get("acme")).over_budget  # type: ignore[union-attr]
    # a tenant whose limits are cleared has no record to mark
    await ledger.tenants.clear("acme")
    await ledger.count(usage("k2", 1, 1), 6)
    await ledger.reconcile()
    assert await ledger.tenants.get("acme") is None


async def test_budgets_in_money_count_each_event_at_its_price_and_mark_when_spent(
    auth_bus: AuthBus,
) -> None:
    """The packaged catalog prices SmolLM2 at 0.02 and 0.04 USD per million tokens."""
    catalog = load_catalog()
    model = "SmolLM2-135M-Instruct"
    topology, js, store = auth_bus
    # 0.00001 USD = 10,000 billionths
    key = KeyRecord(
        key_id="k1", tenant="acme", budget_amount=Decimal("0.00001"), budget_period="month"
    )
    await store.keys.put(key.key_id, key.model_dump_json().encode())
    ledger = BudgetLedger(js, store, topology, 3600, AuthMetrics(), catalog)
    await ledger.open()
    assert ledger.tenants is not None
    await ledger.tenants.set_limits("acme", {"budget_amount": "0.000005", "budget_period": "day"})
    month, day = budget_window("month", time.time()), budget_window("day", time.time())

    def event(prompt: int, completion: int, on: str = model) -> UsageEvent:
        return usage("k1", prompt, completion).model_copy(update={"model": on})

    await ledger.count(event(100, 25), 1)  # 100 * 20 + 25 * 40 = 3,000
    await ledger.count(event(100, 25), 1)  # redelivered
    await ledger.count(event(7, 0, "sim/unpriced"), 2)  # no price: counts nothing
    assert await ledger.spent_entry(money_entry("k1", month, "USD")) == 3_000
    assert await ledger.spent_entry(money_entry("t.acme", day, "USD")) == 3_000
    assert await ledger.spent("k1", month) == 0  # no token budget: no token entry
    tenant = await ledger.tenants.get("acme")
    assert tenant is not None and not tenant.over_budget
    await ledger.count(event(50, 25), 3)  # 2,000: the tenant's 5,000 is spent
    tenant = await ledger.tenants.get("acme")
    assert tenant is not None and tenant.over_budget
    tenant_alerts = [a for a in await alerts_on(js, topology) if a.scope == "tenant"]
    assert [(a.threshold_pct, a.unit, a.budget, a.spent) for a in tenant_alerts] == [
        (80, "USD", "0.000005", "0.000005"),
        (95, "USD", "0.000005", "0.000005"),
        (100, "USD", "0.000005", "0.000005"),
    ]
    assert (await store.get("k1")).state is KeyState.ACTIVE  # type: ignore[union-attr]
    await ledger.count(event(0, 125), 4)  # 5,000 more: the key's 10,000 is spent
    assert (await store.get("k1")).state is KeyState.OVER_BUDGET  # type: ignore[union-attr]
    # the key's budget raised: the reconcile makes it active again; the tenant stays over
    await store.update("k1", lambda _: {"budget_amount": Decimal("1")})
    await ledger.reconcile()
    assert (await store.get("k1")).state is KeyState.ACTIVE  # type: ignore[union-attr]
    assert (await ledger.tenants.get("acme")).over_budget  # type: ignore[union-attr]


async def alerts_on(js: Any, topology: Topology) -> list[SpendAlert]:
    messages = await read_subject(
        js, topology.subjects.spend_alerts_all, topology.subjects.alerts_stream, timeout=10
    )
    return [codec.decode(SpendAlert, m.data) for m in messages]


async def test_spend_alerts_go_once_per_threshold_and_period_across_restarts(
    auth_bus: AuthBus,
) -> None:
    topology, js, store = auth_bus
    key = KeyRecord(key_id="k1", tenant="acme", budget_tokens=100, budget_period="day")
    await store.keys.put(key.key_id, key.model_dump_json().encode())
    ledger = BudgetLedger(js, store, topology, 3600, AuthMetrics())
    await ledger.open()
    assert ledger.tenants is not None
    await ledger.tenants.set_limits(
        "acme", {"budget_tokens": 1000, "budget_period": "day", "alert_thresholds": [8]}
    )
    await ledger.count(usage("k1", 50, 0), 1)  # 50%: none for the key; 5% of the tenant's
    assert await alerts_on(js, topology) == []
    await ledger.count(usage("k1", 30, 5), 2)  # 85%: 80; the tenant's 8% (85 of 1000)
    await ledger.count(usage("k1", 30, 5), 2)  # redelivered: nothing more
    await ledger.count(usage("k1", 20, 0), 3)  # 105%: 95 and 100 at once
    sent = await alerts_on(js, topology)
    assert [(a.scope, a.threshold_pct, a.spent) for a in sent] == [
        ("key", 80, "85"),
        ("tenant", 8, "85"),
        ("key", 95, "105"),
        ("key", 100, "105"),
    ]
    first = sent[0]
    window = budget_window("day", time.time())
    assert first.key_id == "k1" and first.tenant == "acme" and first.unit == "tokens"
    assert first.budget == "100" and first.period == "day" and first.window == window
    assert first.alert_id == f"k1.{window}.100.80"
    assert sent[1].key_id is None and sent[1].alert_id == f"t.acme.{window}.1000.8"

    # A ledger that stopped after sending the 100% alert and before writing its
    # marker: a new one sends it again at its reconcile, and the stream drops the copy.
    await ledger.spend.delete(f"alert.k1.{window}.100.100")
    again = BudgetLedger(js, store, topology, 3600, AuthMetrics())
    await again.open()
    await again.reconcile()
    await again.count(usage("k1", 1, 0), 4)
    assert len(await alerts_on(js, topology)) == 4
    assert (await again.spend.get(f"alert.k1.{window}.100.100")).value == b"1"
    # A raised budget is a new budget: its thresholds alert again as spend passes them.
    await store.update("k1", lambda _: {"budget_tokens": 120})
    await again.count(usage("k1", 0, 1), 5)  # 107 of 120: 80% (96)
    latest = (await alerts_on(js, topology))[-1]
    assert (latest.threshold_pct, latest.budget, latest.spent) == (80, "120", "107")


def test_money_reads_as_a_plain_decimal_whatever_its_size() -> None:
    assert amount_text(0) == "0"
    assert amount_text(1) == "0.000000001"
    assert amount_text(5_000) == "0.000005"
    assert amount_text(100_000_000_000) == "100"
    assert amount_text(2_500_000_000) == "2.5"
