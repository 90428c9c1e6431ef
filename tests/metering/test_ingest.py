"""The usage writer on a real nats-server and a real ClickHouse engine (chDB)."""

from __future__ import annotations

import asyncio
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

from services.metering.ingest import PoisonEvent, UsageIngest, to_row
from services.metering.metrics import MeteringMetrics
from services.metering.settings import MeteringSettings
from services.metering.store import StoreUnavailable, UsageStore
from tests.conftest import NatsServer
from tollgate.wire.subjects import Subjects


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
