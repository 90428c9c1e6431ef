"""The usage writer on a real nats-server and a real ClickHouse engine (chDB)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig

from services.metering.ingest import AckFloor, PoisonEvent, UsageIngest, to_row
from services.metering.metrics import MeteringMetrics
from services.metering.settings import MeteringSettings
from services.metering.store import StoreUnavailable, UsageStore
from tests.conftest import NatsServer
from tollgate.wire.bus import BatchPull
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology


def usage(i: int, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "type": "tg.usage.v1",
        "request_id": f"r{i:05d}",
        "time": time.time(),
        "tenant": "acme",
        "key_id": "k1",
        "model": "m/a",
        "worker_id": "w1",
        "prompt_tokens": 7,
        "completion_tokens": i % 17,
        "outcome": "completed",
        "finish_reason": "length",
        "streamed": True,
        "total_s": 0.5,
        "http_status": 200,
    }
    body.update(fields)
    return body


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not json", "not a tg.usage.v1 event"),
        (b'{"type": "tg.usage.v1"}', "request_id"),
        (
            orjson.dumps(usage(1, completion_tokens=-5)),
            "completion_tokens: Input should be greater",
        ),
        (orjson.dumps(usage(1, prompt_tokens=2**40)), "prompt_tokens: Input should be less"),
        (orjson.dumps(usage(1, http_status=70_000)), "http_status"),
        (orjson.dumps(usage(1, time=12.0)), "time: Input should be greater"),
        (orjson.dumps(usage(1, time=time.time() + 2 * 86_400)), "time: .* ahead of the reader"),
    ],
)
def test_events_that_can_never_be_rows_are_poison(data: bytes, reason: str) -> None:
    with pytest.raises(PoisonEvent, match=reason):
        to_row(data, 1, time.time())


def test_a_valid_event_becomes_a_row() -> None:
    row = to_row(orjson.dumps(usage(3, ttft_s=0.25)), 42, time.time())
    assert row["request_id"] == "r00003" and row["stream_seq"] == 42 and row["ttft_s"] == 0.25
    assert "type" not in row


def test_bad_timings_never_cost_the_row() -> None:
    row = to_row(orjson.dumps(usage(3, queue_s=-0.0001, total_s=-2.0)), 1, time.time())
    assert row["queue_s"] == 0.0 and row["total_s"] == 0.0
    assert row["completion_tokens"] == 3


@dataclass
class Harness:
    nc: NATS
    js: JetStreamContext
    subjects: Subjects
    store: UsageStore
    ingest: UsageIngest
    metrics: MeteringMetrics

    async def publish(self, body: dict[str, Any] | bytes, msg_id: str | None = None) -> None:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await self.js.publish(self.subjects.usage("acme"), data, headers=headers)

    async def until(self, check: Callable[[], bool], timeout: float = 30) -> None:
        async with asyncio.timeout(timeout):
            # Polls ClickHouse and counters: state with no event to await.
            while not check():  # noqa: ASYNC110
                await asyncio.sleep(0.05)

    def count(self, sql: str) -> int:
        return int(self.store.writer.query(sql).result_rows[0][0])


@pytest.fixture
async def harness(nats_server: NatsServer, store: UsageStore) -> AsyncIterator[Harness]:
    nc = await nats_server.connect(name="test-ingest")
    subjects = Subjects(f"t{uuid.uuid4().hex[:8]}")
    metrics = MeteringMetrics()
    settings = MeteringSettings(batch_max_rows=100, batch_max_wait_s=0.2, retry_max_s=0.2)
    ingest = UsageIngest(nc, store, subjects, settings, metrics)
    task = asyncio.create_task(ingest.run())
    h = Harness(nc, nc.jetstream(), subjects, store, ingest, metrics)
    await h.until(lambda: ingest.running)
    yield h
    ingest.stop()
    await asyncio.wait_for(task, 30)
    for stream in (subjects.usage_stream, subjects.dead_letter_stream):
        await h.js.delete_stream(stream)
    await nc.close()


async def test_malformed_and_duplicate_events_never_stop_or_double_the_meter(
    harness: Harness,
) -> None:
    h = harness
    events = [usage(i) for i in range(300)]
    poison = [b"\xff garbage", b"{}", orjson.dumps(usage(9999, completion_tokens=-1))]
    for i, event in enumerate(events):
        await h.publish(event, msg_id=event["request_id"])
        if i in (10, 150, 290):
            await h.publish(poison[(i // 140) % 3])
    # Published twice with the same message id: the stream drops it.
    for event in events[:40]:
        await h.publish(event, msg_id=event["request_id"])
    # Published again as new messages (the stream's window passed): the writer skips them.
    for event in events[40:100]:
        await h.publish(event, msg_id=f"{event['request_id']}-again")
    await h.until(lambda: h.metrics.inserted._value.get() == 300)
    await h.until(lambda: h.metrics.consumed._value.get() == 300 + 3 + 60)
    assert h.count("SELECT count() FROM usage_events") == 300
    assert h.count("SELECT uniqExact(request_id) FROM usage_events") == 300
    assert h.count("SELECT sum(requests) FROM usage_hourly") == 300
    assert h.count("SELECT sum(completion_tokens) FROM usage_daily") == sum(
        e["completion_tokens"] for e in events
    )
    assert h.metrics.duplicates._value.get() == 60
    assert h.metrics.dead_lettered._value.get() == 3
    info = await h.js.stream_info(h.subjects.dead_letter_stream)
    assert info.state.messages == 3
    first = await h.js.get_msg(h.subjects.dead_letter_stream, info.state.first_seq)
    assert first.data == b"\xff garbage"
    assert (
        first.headers is not None and "not a tg.usage.v1 event" in first.headers["Tollgate-Reason"]
    )


async def test_rows_clickhouse_refuses_are_isolated_and_the_rest_stored(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    real_insert = h.store.insert

    def insert(rows: list[dict[str, Any]]) -> None:
        if any(r["request_id"] == "r00013" for r in rows):
            raise DatabaseError("Code: 27. DB::Exception: Cannot parse input (injected)")
        real_insert(rows)

    monkeypatch.setattr(h.store, "insert", insert)
    for i in range(50):
        await h.publish(usage(i), msg_id=f"x{i}")
    await h.until(lambda: h.metrics.dead_lettered._value.get() == 1)
    await h.until(lambda: h.metrics.inserted._value.get() == 49)
    assert h.count("SELECT count() FROM usage_events WHERE request_id = 'r00013'") == 0
    assert h.count("SELECT count() FROM usage_events") == 49


async def test_a_server_side_error_is_retried_not_blamed_on_the_rows(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    real_insert = h.store.insert
    failures = {"left": 3}

    def insert(rows: list[dict[str, Any]]) -> None:
        if failures["left"]:
            failures["left"] -= 1
            raise DatabaseError("Code: 241. DB::Exception: Memory limit exceeded (injected)")
        real_insert(rows)

    monkeypatch.setattr(h.store, "insert", insert)
    for i in range(30):
        await h.publish(usage(i), msg_id=f"z{i}")
    await h.until(lambda: h.metrics.inserted._value.get() == 30)
    assert h.metrics.dead_lettered._value.get() == 0
    assert h.metrics.insert_failures._value.get() == 3
    assert h.count("SELECT count() FROM usage_events") == 30


async def test_an_unavailable_clickhouse_delays_rows_and_loses_none(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = harness
    real_insert = h.store.insert
    failures = {"left": 4}

    def insert(rows: list[dict[str, Any]]) -> None:
        if failures["left"]:
            failures["left"] -= 1
            # An insert that may have reached the server before the link broke.
            if failures["left"] == 1:
                real_insert(rows)
            raise StoreUnavailable("connection refused (injected)")
        real_insert(rows)

    monkeypatch.setattr(h.store, "insert", insert)
    for i in range(120):
        await h.publish(usage(i), msg_id=f"y{i}")
    await h.until(lambda: h.count("SELECT count() FROM usage_events") == 120)
    await h.until(lambda: h.metrics.consumed._value.get() == 120)
    await asyncio.sleep(0.5)
    assert h.metrics.insert_failures._value.get() == 4
    assert h.count("SELECT count() FROM usage_events") == 120
    assert h.count("SELECT sum(requests) FROM usage_hourly") == 120


async def test_events_the_contract_refuses_are_dead_lettered_not_stored(
    harness: Harness,
) -> None:
    """Negative or absurd token counts: the contract's checks, as the ledger applies them."""
    h = harness
    bad = [
        usage(1, prompt_tokens=-1_000_000),
        usage(2, completion_tokens=50_000_000),  # fits a UInt32 column; no request is that long
        usage(3, prompt_tokens=10_000_001),
    ]
    for body in [usage(0), *bad, usage(4)]:
        await h.publish(body, msg_id=str(body["request_id"]))
    await h.until(lambda: h.metrics.dead_lettered._value.get() == 3)
    await h.until(lambda: h.metrics.inserted._value.get() == 2)
    assert h.count("SELECT count() FROM usage_events") == 2
    assert h.count("SELECT count() FROM usage_events WHERE request_id IN ('r00000', 'r00004')") == 2
    info = await h.js.stream_info(h.subjects.dead_letter_stream)
    reasons = []
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        letter = await h.js.get_msg(h.subjects.dead_letter_stream, seq)
        assert letter.headers is not None
        reasons.append(letter.headers["Tollgate-Reason"])
    assert [r.split(":")[1].strip() for r in reasons] == [
        "prompt_tokens",
        "completion_tokens",
        "prompt_tokens",
    ]
    assert all(r.startswith("not a tg.usage.v1 event") for r in reasons)


# -- one ack per batch (the consumer acks all) --------------------------------


class FakeMsg:
    """A delivered message as AckFloor sees it: its stream sequence."""

    def __init__(self, seq: int) -> None:
        self.metadata = type("M", (), {"sequence": type("S", (), {"stream": seq})()})()


def seqs(*numbers: int) -> list[Any]:
    return [FakeMsg(n) for n in numbers]


def acked(msg: Any) -> int | None:
    return None if msg is None else int(msg.metadata.sequence.stream)


def test_a_batch_is_acked_by_its_last_event() -> None:
    floor = AckFloor(10)
    assert acked(floor.stored(seqs(11, 12, 13))) == 13
    assert floor.floor == 13 and floor.waiting == 0 and floor.acks == 1


def test_no_ack_passes_an_event_not_stored() -> None:
    """14 was delivered to a writer that died (or lost on the way): nothing past it is acked."""
    floor = AckFloor(13)
    assert floor.stored(seqs(15, 16)) is None
    assert floor.stored(seqs(17)) is None
    assert floor.waiting == 3 and floor.floor == 13
    # The server delivers 14 again after its ack wait: one ack covers all four.
    assert acked(floor.stored(seqs(14))) == 17
    assert floor.waiting == 0


def test_an_event_delivered_again_below_the_floor_is_acked_again() -> None:
    """Its ack was lost in a reconnect; without a new ack it would come back forever."""
    floor = AckFloor(20)
    assert acked(floor.stored(seqs(18, 19))) == 19
    assert acked(floor.stored(seqs(19, 21))) == 21


def test_a_gap_pending_nowhere_is_passed_on_the_servers_word() -> None:
    floor = AckFloor(5)
    floor.stored(seqs(7, 8, 9))  # 6 is gone from the stream
    stored, acks = floor.waiting, floor.acks
    # The server still has one more event pending than are stored: 6 may be on its way.
    assert floor.server_says(5, 11, 4, stored, acks) is None
    # Something was stored meanwhile: the reading may be older than the store.
    floor.stored(seqs(11))
    assert floor.server_says(5, 11, 4, stored, acks) is None
    # A reading taken with nothing stored or acked since: exactly the stored ones pend.
    stored, acks = floor.waiting, floor.acks
    # A server restarted from older state, which no longer knows it delivered 11:
    # its pending events are not the stored ones, whatever their number.
    assert floor.server_says(5, 10, 4, stored, acks) is None
    assert acked(floor.server_says(5, 11, 4, stored, acks)) == 11
    assert floor.floor == 11 and floor.waiting == 0


def test_the_servers_ack_floor_is_taken() -> None:
    floor = AckFloor(5)
    floor.stored(seqs(7, 9, 10))
    assert acked(floor.server_says(8, 10, 10, 3, 0)) == 10
    assert floor.waiting == 0


@dataclass
class Bus:
    """An operator's connection to a stack of its own prefix, and the usage writers run on it."""

    server: NatsServer
    store: UsageStore
    nc: NATS
    subjects: Subjects
    running: list[tuple[NATS, UsageIngest, asyncio.Task[None]]]

    @property
    def js(self) -> JetStreamContext:
        return self.nc.jetstream()

    @property
    def spec(self) -> Any:
        return Topology(self.subjects).metering_usage

    async def writer(self, **settings: Any) -> UsageIngest:
        """A usage writer with the metering service's own identity, running."""
        nc = await self.server.connect(
            Role.METERING, name="test-metering", prefix=self.subjects.prefix
        )
        tuning = {"batch_max_rows": 100, "batch_max_wait_s": 0.2, "retry_max_s": 0.2} | settings
        ingest = UsageIngest(
            nc, self.store, self.subjects, MeteringSettings(**tuning), MeteringMetrics()
        )
        task = asyncio.create_task(ingest.run())
        self.running.append((nc, ingest, task))
        async with asyncio.timeout(30):
            # Polls a flag the service sets: state with no event to await.
            while not ingest.running:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        return ingest

    async def stop_writers(self) -> None:
        while self.running:
            nc, ingest, task = self.running.pop()
            ingest.stop()
            await asyncio.wait_for(task, 30)
            await nc.close()

    async def publish(self, ids: range) -> None:
        for i in ids:
            await self.js.publish(
                self.subjects.usage("acme"),
                orjson.dumps(usage(i)),
                headers={"Nats-Msg-Id": f"e{i}"},
            )

    async def dies_holding(self, n: int) -> list[int]:
        """A writer takes ``n`` events and dies before storing them: their sequences."""
        dead = await BatchPull(self.nc, self.spec.stream, self.spec.durable).start()
        held = await dead.fetch(n, timeout=5, window=0.5)
        await dead.stop()
        return [m.metadata.sequence.stream for m in held]

    def stored(self) -> set[str]:
        rows = self.store.writer.query("SELECT request_id FROM usage_events").result_rows
        return {r[0] for r in rows}

    async def until_stored(self, n: int, timeout: float = 60) -> None:
        async with asyncio.timeout(timeout):
            # Polls ClickHouse: state with no event to await.
            while len(self.stored()) < n:  # noqa: ASYNC110
                await asyncio.sleep(0.1)

    async def settled(self, last: int) -> Any:
        """The consumer once it has acked everything up to ``last``."""
        async with asyncio.timeout(30):
            while True:
                info = await self.js.consumer_info(self.spec.stream, self.spec.durable)
                if info.ack_floor.stream_seq == last and info.num_ack_pending == 0:
                    return info
                await asyncio.sleep(0.1)


@pytest.fixture
async def bus(nats_server: NatsServer, store: UsageStore) -> AsyncIterator[Bus]:
    nc = await nats_server.connect(name="test-operator")
    b = Bus(nats_server, store, nc, Subjects(f"t{uuid.uuid4().hex[:8]}"), [])
    yield b
    await b.stop_writers()
    with contextlib.suppress(Exception):
        await b.js.delete_stream(b.subjects.usage_stream)
    await nc.close()


async def test_events_a_dead_writer_held_are_stored_though_later_ones_are_acked(
    bus: Bus,
) -> None:
    """An ack of a later batch acks every earlier event: never one still pending unstored."""
    await bus.writer(ack_wait_s=15)  # makes the consumer
    await bus.stop_writers()
    await bus.publish(range(10))
    assert await bus.dies_holding(5) == [1, 2, 3, 4, 5]
    await bus.writer(ack_wait_s=15)
    await bus.publish(range(10, 20))
    await bus.until_stored(15)
    # The later events are stored, yet the five held ones are not acked (they
    # come again 15 s after they were taken).
    info = await bus.js.consumer_info(bus.spec.stream, bus.spec.durable)
    assert len(bus.stored()) == 15 and info.ack_floor.stream_seq == 0
    # Delivered again after the ack wait, they are stored, and one ack covers all.
    await bus.until_stored(20)
    info = await bus.settled(20)
    assert info.config.ack_policy == AckPolicy.ALL
    assert bus.stored() == {f"r{i:05d}" for i in range(20)}


async def test_a_consumer_made_to_ack_each_event_is_kept_and_acked_so(bus: Bus) -> None:
    """A consumer from an earlier version: its ack policy cannot change, and
    making it again would deliver every event above its floor once more."""
    topology = Topology(bus.subjects)
    await topology.ensure_stream(bus.js, topology.usage)
    await bus.js.add_consumer(
        bus.spec.stream,
        ConsumerConfig(
            durable_name=bus.spec.durable,
            filter_subject=bus.spec.filter_subject,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=2,
        ),
    )
    await bus.publish(range(8))
    old = await BatchPull(bus.nc, bus.spec.stream, bus.spec.durable).start()
    taken = await old.fetch(8, timeout=5, window=0.5)
    await old.stop()
    for msg in taken:  # stored and acked before the upgrade: 1-3 and 5
        if msg.metadata.sequence.stream in (1, 2, 3, 5):
            await msg.ack_sync()
    await bus.writer(ack_wait_s=2)
    await bus.until_stored(4)
    info = await bus.settled(8)
    assert info.config.ack_policy == AckPolicy.EXPLICIT
    assert bus.stored() == {f"r{i:05d}" for i in (3, 5, 6, 7)}  # the four never acked


async def test_a_gap_the_stream_no_longer_holds_does_not_stop_the_acks(bus: Bus) -> None:
    await bus.writer(ack_wait_s=2)  # makes the consumer
    await bus.stop_writers()
    await bus.publish(range(6))
    # The second event is deleted from the stream; a writer takes the first and dies.
    await bus.js.delete_msg(bus.subjects.usage_stream, 2)
    assert await bus.dies_holding(1) == [1]
    await bus.writer(ack_wait_s=2)
    # 1 comes again after the ack wait; 2 never will: the server's word passes it.
    await bus.until_stored(5)
    await bus.settled(6)


async def test_a_batch_that_failed_comes_again_within_seconds(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not after the minute's ack wait: no later event may be acked past it meanwhile."""
    ingest = await bus.writer()
    assert ingest.settings.ack_wait_s == 60
    real = ingest._fresh_rows
    failures = {"left": 1}

    async def fresh_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("an unexpected failure (injected)")
        return await real(rows)

    monkeypatch.setattr(ingest, "_fresh_rows", fresh_rows)
    await bus.publish(range(10))
    await bus.until_stored(10, timeout=20)
    await bus.publish(range(10, 12))
    await bus.until_stored(12, timeout=20)
    await bus.settled(12)
    assert failures["left"] == 0


async def test_events_that_trickle_in_stay_on_the_server_until_the_window_ends(bus: Bus) -> None:
    """One pull for the first event, one for the rest once the window is over: a
    trickle of events reaches the consumer as one batch, not one message each."""
    await bus.writer()  # makes the consumer
    await bus.stop_writers()
    pull = await BatchPull(bus.nc, bus.spec.stream, bus.spec.durable).start()
    try:
        fetch = asyncio.create_task(pull.fetch(100, timeout=5, window=3.0))
        await bus.publish(range(1))
        for i in range(1, 6):  # during the window
            await asyncio.sleep(0.05)
            await bus.publish(range(i, i + 1))
        info = await bus.js.consumer_info(bus.spec.stream, bus.spec.durable)
        assert not fetch.done()
        # the first event is delivered; the five after it still wait on the server
        assert (info.num_ack_pending, info.num_pending) == (1, 5)
        got = await asyncio.wait_for(fetch, 10)
        assert [m.metadata.sequence.stream for m in got] == [1, 2, 3, 4, 5, 6]
    finally:
        await pull.stop()


async def test_a_consumer_behind_takes_whole_batches_without_waiting(bus: Bus) -> None:
    await bus.writer()
    await bus.stop_writers()
    await bus.publish(range(250))
    pull = await BatchPull(bus.nc, bus.spec.stream, bus.spec.durable).start()
    try:
        sizes = []
        async with asyncio.timeout(30):
            # A window of a minute, waited for by neither: the first event says
            # more than a batch waits behind it, and the first batch came back full.
            sizes.append(len(await pull.fetch(100, timeout=5, window=60)))
            sizes.append(len(await pull.fetch(100, timeout=5, window=60)))
        assert sizes == [100, 100]
    finally:
        await pull.stop()
