"""The live worker view that the router and the scaler share, built from heartbeats."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from tests.conftest import NatsServer
from tollgate.runtime.workers import WorkerView
from tollgate.wire import codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(
    worker_id: str,
    model: str = "org/a",
    state: WorkerState = WorkerState.READY,
    interval_s: float = 2.0,
) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        model=model,
        engine="simulated",
        state=state,
        slots_used=0,
        slots_total=4,
        interval_s=interval_s,
        sent_at=0.0,
    )


@pytest.mark.parametrize("misses", [1, 3, 5])
def test_alive_until_misses_beats_are_missed(misses: int) -> None:
    clock = Clock()
    view = WorkerView(misses, clock=clock)
    view.observe(beat("w1", interval_s=2.0))
    assert view.window("w1") == 2.0 * misses
    clock.now += 2.0 * misses
    assert view.alive("w1")
    clock.now += 0.01
    assert not view.alive("w1")
    view.observe(beat("w1", interval_s=2.0))  # heard from again: alive again
    assert view.alive("w1")


def test_a_worker_never_heard_from_is_not_alive() -> None:
    view = WorkerView(4)
    assert not view.alive("nobody")
    assert view.window("nobody") == 4.0  # a one-second beat is assumed
    assert view.get("nobody") is None


def test_a_stopped_beat_removes_the_worker_at_once() -> None:
    seen: list[WorkerState] = []
    view = WorkerView(3, on_beat=lambda b: seen.append(b.state))
    view.observe(beat("w1"))
    view.observe(beat("w1", state=WorkerState.STOPPED))
    assert not view.alive("w1") and view.live() == []
    assert seen == [WorkerState.READY, WorkerState.STOPPED]  # the callback sees every beat


def test_live_lists_per_model_and_forgets_the_lost() -> None:
    clock = Clock()
    view = WorkerView(3, clock=clock)
    view.observe(beat("a1", "org/a", interval_s=1.0))
    view.observe(beat("a2", "org/a", WorkerState.DRAINING, interval_s=10.0))
    view.observe(beat("b1", "org/b", interval_s=1.0))
    assert {b.worker_id for b in view.live("org/a")} == {"a1", "a2"}
    assert [b.worker_id for b in view.live("org/b")] == ["b1"]
    assert len(view.live()) == 3
    clock.now += 5.0  # past 3 beats of 1 s, within 3 beats of 10 s
    assert [b.worker_id for b in view.live("org/a")] == ["a2"]
    assert view.get("a1") is None and view.get("b1") is None  # forgotten, not only hidden
    assert view.live("org/b") == []


def test_the_latest_beat_is_kept() -> None:
    view = WorkerView()
    view.observe(beat("w1", state=WorkerState.STARTING))
    view.observe(beat("w1", state=WorkerState.READY))
    seen = view.get("w1")
    assert seen is not None and seen.beat.state is WorkerState.READY
    assert view.misses == 3  # the default


def test_misses_must_be_positive() -> None:
    with pytest.raises(ValueError):
        WorkerView(0)


async def test_the_view_follows_heartbeats_on_the_bus(nats_server: NatsServer) -> None:
    subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:8]}")
    got: asyncio.Queue[WorkerHeartbeat] = asyncio.Queue()
    view = WorkerView(3, on_beat=got.put_nowait)
    nc = await nats_server.connect(name="test-worker-view")
    try:
        await view.start(nc, subjects)
        await nc.publish(subjects.heartbeat("org/a"), b"not a heartbeat")
        await nc.publish(subjects.heartbeat("org/a"), codec.encode(beat("a1", "org/a")))
        await nc.publish(subjects.heartbeat("org/b.1"), codec.encode(beat("b1", "org/b.1")))
        first = await asyncio.wait_for(got.get(), 5)
        second = await asyncio.wait_for(got.get(), 5)
        assert (first.worker_id, second.worker_id) == ("a1", "b1")  # the malformed one skipped
        assert view.alive("a1") and view.alive("b1")
        assert [b.worker_id for b in view.live("org/b.1")] == ["b1"]
        await nc.publish(
            subjects.heartbeat("org/a"), codec.encode(beat("a1", "org/a", WorkerState.STOPPED))
        )
        assert (await asyncio.wait_for(got.get(), 5)).state is WorkerState.STOPPED
        assert not view.alive("a1")
        await view.stop()
        probe = await nc.subscribe(subjects.heartbeat_all)
        await nc.publish(subjects.heartbeat("org/a"), codec.encode(beat("a2", "org/a")))
        await probe.next_msg(timeout=5)  # delivered to whoever still listens
        assert got.empty() and view.get("a2") is None
    finally:
        await nc.close()


def test_a_starting_worker_stays_known_through_a_silence_longer_than_its_window() -> None:
    clock = Clock()
    view = WorkerView(misses=3, clock=clock)
    view.observe(beat("w1", state=WorkerState.STARTING, interval_s=1.0))
    view.observe(beat("w2", model="org/b", state=WorkerState.STARTING, interval_s=1.0))
    clock.now += 10  # an engine import held the worker's interpreter: no beat for 10 s
    assert view.live("org/a") == []  # lost for serving calls
    assert [b.worker_id for b in view.starting("org/a")] == ["w1"]  # still on its way
    view.observe(beat("w1", state=WorkerState.READY, interval_s=1.0))
    assert view.starting("org/a") == []  # ready: no longer starting
    clock.now += 31
    assert view.starting("org/b") == []  # silent past the bound: forgotten


def test_a_starting_worker_that_said_it_falls_silent_is_held_for_through_its_silence() -> None:
    clock = Clock()
    view = WorkerView(misses=3, clock=clock)
    # vLLM's engine start holds the worker's event loop: its last beat says so
    view.observe(beat("w1", state=WorkerState.STARTING, interval_s=120.0))
    view.observe(beat("w2", state=WorkerState.STARTING, interval_s=1.0))
    clock.now += 90  # past the 30 s bound, inside w1's own window (3 x 120 s)
    assert [b.worker_id for b in view.starting("org/a")] == ["w1"]
    clock.now += 300
    assert view.starting("org/a") == []  # silent past its own window too: forgotten


def test_a_beat_cannot_keep_a_silent_worker_counted_for_more_than_an_hour() -> None:
    """A worker (or anything that can publish beats) saying its next beat may be a day late
    is refused as malformed, not kept as starting or alive for that day."""
    wire = beat("w1", state=WorkerState.STARTING).model_dump(mode="json")
    with pytest.raises(ValueError):
        WorkerHeartbeat.model_validate({**wire, "interval_s": 86_400.0})
    WorkerHeartbeat.model_validate({**wire, "interval_s": 3_600.0})  # an hour: accepted
