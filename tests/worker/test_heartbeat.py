"""What a worker beats: its engine's numbers, read by heartbeat() (no bus needed)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from services.worker.consumer import WorkerConsumer
from services.worker.engine import EngineStats
from services.worker.settings import WorkerSettings
from tests.conftest import NatsServer
from tollgate.runtime.tasks import stop_tasks
from tollgate.wire.contracts import WorkerHeartbeat
from tollgate.wire.subjects import Subjects


class _Bus:
    """What a consumer's constructor touches of a NATS connection; heartbeat() sends nothing."""

    def jetstream(self) -> object:
        return object()


class _CountingEngine:
    name = "simulated"
    slots_total = 4
    model_path = Path("/m")

    def stats(self) -> EngineStats:
        return EngineStats(
            running=1,
            prefix_cache_queries=1200,
            prefix_cache_hits=900,
            prefix_cache_hit_rate=0.8,
        )


def test_the_heartbeat_carries_the_prefix_cache() -> None:
    consumer = WorkerConsumer(
        _Bus(),  # type: ignore[arg-type]
        _CountingEngine(),  # type: ignore[arg-type]
        WorkerSettings(worker_id="w1"),
        Subjects("tg"),
        "org/m",
    )
    beat = consumer.heartbeat()
    assert (beat.prefix_cache_queries, beat.prefix_cache_hits) == (1200, 900)
    assert beat.prefix_cache_hit_rate == 0.8
    decoded = WorkerHeartbeat.model_validate_json(beat.model_dump_json())
    assert decoded.prefix_cache_hits == 900
    # a heartbeat from a worker that predates the fields still reads
    older = beat.model_dump(exclude={"prefix_cache_queries", "prefix_cache_hits"})
    assert WorkerHeartbeat.model_validate(older).prefix_cache_hits is None


def test_a_worker_whose_engine_start_holds_its_loop_says_how_long_it_may_be_silent() -> None:
    consumer = WorkerConsumer(
        _Bus(),  # type: ignore[arg-type]
        _CountingEngine(),  # type: ignore[arg-type]
        WorkerSettings(worker_id="w1", heartbeat_interval_s=1.0),
        Subjects("tg"),
        "org/m",
    )
    assert consumer.heartbeat().interval_s == 1.0
    consumer.silent_for_s = 120.0  # what fall_silent sets before the engine starts
    assert consumer.heartbeat().interval_s == 120.0
    consumer.silent_for_s = None  # ready: beats every second again
    assert consumer.heartbeat().interval_s == 1.0


async def test_a_silence_longer_than_a_beat_may_announce_is_announced_as_the_longest() -> None:
    class _Sink(_Bus):
        def __init__(self) -> None:
            self.sent: list[bytes] = []

        async def publish(self, subject: str, data: bytes) -> None:
            self.sent.append(data)

        async def flush(self, timeout: float) -> None:
            return None

    bus = _Sink()
    consumer = WorkerConsumer(
        bus,  # type: ignore[arg-type]
        _CountingEngine(),  # type: ignore[arg-type]
        WorkerSettings(worker_id="w1"),
        Subjects("tg"),
        "org/m",
    )
    await consumer.fall_silent(7_200.0)  # a catalog expecting a two-hour start
    (sent,) = bus.sent
    assert WorkerHeartbeat.model_validate_json(sent).interval_s == 3_600.0


@pytest.mark.parametrize("fair", [True, False], ids=["fair", "fifo"])
async def test_a_worker_says_it_claims_offers_while_it_listens_for_them(
    nats_server: NatsServer, fair: bool
) -> None:
    """Routers offer a direct request only to a worker whose beats say so: one that
    listens for offers and serves by fair share (first come, first served reads
    the lanes' oldest requests, so it gets arrivals instead)."""
    nc = await nats_server.connect(name="test-worker")
    try:
        consumer = WorkerConsumer(
            nc,
            _CountingEngine(),  # type: ignore[arg-type]
            WorkerSettings(worker_id="w1", fair_share=fair),
            Subjects("tg"),
            "org/offers",
        )
        assert not consumer.heartbeat().takes_queued  # not listening yet
        pulling = asyncio.create_task(consumer._pull_loop())
        deadline = time.monotonic() + 10
        while consumer.claims._read_at == 0.0:  # it has subscribed, then read the queue
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        assert consumer.heartbeat().takes_queued is fair
        consumer._stopping.set()
        await stop_tasks(pulling)
        assert not consumer.heartbeat().takes_queued
    finally:
        await nc.close()
