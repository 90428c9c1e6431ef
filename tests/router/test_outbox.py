"""Usage events survive a NATS outage and a router restart (the durable outbox)."""

from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

import pytest

from services.router import usage
from services.router.usage import Outbox, UsagePublisher
from tests.conftest import NatsServer, free_port
from tollgate.wire import bus
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects

SUBJECTS = Subjects()


def event(i: int) -> UsageEvent:
    return UsageEvent(
        request_id=f"req-{i}",
        time=time.time(),
        tenant="acme",
        key_id="k",
        model="m",
        prompt_tokens=10,
        completion_tokens=i,
        outcome="completed",
        streamed=True,
        total_s=0.1,
        http_status=200,
    )


async def stream_count(nats: NatsServer) -> int:
    nc = await nats.connect(name="test-count")
    try:
        info = await nc.jetstream().stream_info(SUBJECTS.usage_stream)
        return int(info.state.messages)
    finally:
        await nc.close()


@pytest.fixture
def own_nats(tmp_path: Path) -> NatsServer:
    server = NatsServer(free_port(), tmp_path / "nats")
    server.start()
    yield server
    server.stop()


async def test_outage_delays_events_and_a_restart_replays_them(
    own_nats: NatsServer, tmp_path: Path
) -> None:
    path = tmp_path / "outbox.db"
    nc = await own_nats.connect(name="test-router")
    publisher = UsagePublisher(nc.jetstream(), SUBJECTS, Outbox(path), retry_every_s=0.2)
    await publisher.start()
    for i in range(50):
        publisher.emit(event(i))
    deadline = time.monotonic() + 10
    while len(publisher.outbox) > 0:  # published and acknowledged
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)

    # NATS goes away: the next events can only reach the outbox.
    own_nats.stop()
    for i in range(50, 120):
        publisher.emit(event(i))
    await asyncio.sleep(1)
    assert len(publisher.outbox) == 70
    # The router stops while NATS is still down; its outbox stays on disk.
    await publisher.flush(timeout=1)
    await bus.close(nc)
    assert len(Outbox(path)) == 70

    # NATS comes back and a new router process replays the outbox.
    own_nats.start()
    nc = await own_nats.connect(name="test-router")
    publisher = UsagePublisher(nc.jetstream(), SUBJECTS, Outbox(path), retry_every_s=0.2)
    await publisher.start()
    publisher.emit(event(50))  # the same event again: the stream drops the duplicate
    deadline = time.monotonic() + 20
    while len(publisher.outbox) > 0:
        assert time.monotonic() < deadline, "the outbox was not replayed"
        await asyncio.sleep(0.1)
    await publisher.flush()
    await nc.close()
    assert await stream_count(own_nats) == 120


async def test_published_events_leave_with_the_next_event_or_soon_after(
    own_nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two commits per call: an acknowledged event is removed in the next event's
    transaction, or by a batch shortly after; one acknowledged but still in the
    outbox when the router dies is published again, and the stream drops the copy."""
    path = tmp_path / "outbox.db"
    nc = await own_nats.connect(name="test-router")
    publisher = UsagePublisher(nc.jetstream(), SUBJECTS, Outbox(path), retry_every_s=60)
    await publisher.start()
    # the batch's delay, as long as this test's checks of what waits for it need
    monkeypatch.setattr(usage, "REMOVE_AFTER_S", 60.0)

    async def acknowledged(request_id: str) -> None:
        deadline = time.monotonic() + 10
        while request_id not in publisher._published:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.005)

    publisher.emit(event(0))
    await acknowledged("req-0")
    assert [row[0] for row in publisher.outbox.pending()] == ["req-0"]  # not removed yet
    monkeypatch.setattr(usage, "REMOVE_AFTER_S", 0.05)
    publisher.emit(event(1))  # its transaction takes req-0 out
    assert [row[0] for row in publisher.outbox.pending()] == ["req-1"]
    assert publisher._removal is None  # nothing left for the batch: its timer is gone
    deadline = time.monotonic() + 5
    while len(publisher.outbox) > 0:  # nothing follows: the batch removes req-1
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)

    monkeypatch.setattr(usage, "REMOVE_AFTER_S", 60.0)
    publisher.emit(event(2))
    await acknowledged("req-2")
    # killed before the removal: nothing flushed, the journal stays as it is
    assert publisher._replayer is not None
    publisher._replayer.cancel()
    assert publisher._removal is not None
    publisher._removal.cancel()
    publisher.outbox.close()
    await nc.close()
    assert [row[0] for row in Outbox(path).pending()] == ["req-2"]

    monkeypatch.setattr(usage, "REMOVE_AFTER_S", 0.05)
    nc = await own_nats.connect(name="test-router")
    publisher = UsagePublisher(nc.jetstream(), SUBJECTS, Outbox(path), retry_every_s=0.1)
    await publisher.start()
    deadline = time.monotonic() + 10
    while len(publisher.outbox) > 0:  # replayed, acknowledged (as a duplicate), removed
        assert time.monotonic() < deadline
        await asyncio.sleep(0.05)
    await publisher.flush()
    await nc.close()
    assert await stream_count(own_nats) == 3


def test_events_come_back_in_the_order_they_were_written(tmp_path: Path) -> None:
    """Also once the newest were removed (a new row's seq is above every row left)."""
    outbox = Outbox(tmp_path / "outbox.db")
    for name in ("a", "b", "c"):
        outbox.open(name, {"model": "m"})
        outbox.add(name, "tg.usage.t", name.encode())
    outbox.remove(["c"])
    outbox.open("d", {"model": "m"})
    outbox.open("e", {"model": "m"})
    outbox.add("d", "tg.usage.t", b"d", published=["a"])
    assert [row[0] for row in outbox.pending()] == ["b", "d"]
    assert outbox.opened() == [("e", {"model": "m"})]  # the others' events replaced theirs
    outbox.remove(["b", "d"])
    outbox.add("e", "tg.usage.t", b"e")
    assert outbox.pending() == [("e", "tg.usage.t", b"e")]
    assert (len(outbox), outbox.open_count()) == (1, 0)
    # a new outbox's tables: no AUTOINCREMENT (no sqlite_sequence written per
    # event), and open records in one B-tree
    tables = dict(outbox.db.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'"))
    assert "sqlite_sequence" not in tables
    assert tables["open_calls"].endswith("WITHOUT ROWID")


def test_an_outbox_written_with_the_earlier_schema_is_read_and_written(tmp_path: Path) -> None:
    """A router upgraded in place keeps the tables its outbox has (AUTOINCREMENT, rowid)."""
    path = tmp_path / "outbox.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(
        "CREATE TABLE events (seq INTEGER PRIMARY KEY AUTOINCREMENT,"
        " request_id TEXT UNIQUE NOT NULL, subject TEXT NOT NULL, data BLOB NOT NULL)"
    )
    db.execute("CREATE TABLE open_calls (request_id TEXT PRIMARY KEY, data BLOB NOT NULL)")
    db.execute("INSERT INTO events (request_id, subject, data) VALUES ('old', 'tg.usage.t', x'01')")
    db.execute("INSERT INTO open_calls (request_id, data) VALUES ('open', '{\"model\":\"m\"}')")
    db.close()

    outbox = Outbox(path)
    assert outbox.pending() == [("old", "tg.usage.t", b"\x01")]
    assert outbox.opened() == [("open", {"model": "m"})]
    outbox.add("open", "tg.usage.t", b"\x02", published=["old"])
    outbox.open("next", {"model": "m"})
    assert outbox.pending() == [("open", "tg.usage.t", b"\x02")]
    assert outbox.opened() == [("next", {"model": "m"})]
    outbox.close()
    schema = sqlite3.connect(path).execute("SELECT sql FROM sqlite_master").fetchall()
    assert any("AUTOINCREMENT" in (sql or "") for (sql,) in schema)  # kept as it was
