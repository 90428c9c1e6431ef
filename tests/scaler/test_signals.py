"""The scaler's per-model view: live workers from the shared view, misses from settings."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from services.scaler.settings import ScalerSettings
from services.scaler.signals import BusSignals, ModelView
from tests.conftest import NatsServer
from tollgate.runtime.workers import WorkerView
from tollgate.wire import codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects


def beat(worker_id: str, state: WorkerState, startup_s: float | None = None) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=worker_id,
        model="org/m",
        engine="simulated",
        state=state,
        slots_used=1,
        slots_total=6,
        interval_s=1.0,
        sent_at=time.time(),
        startup_s=startup_s,
    )


def test_heartbeat_misses_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert ScalerSettings().heartbeat_misses == 3
    monkeypatch.setenv("TOLLGATE_SCALER_HEARTBEAT_MISSES", "5")
    assert ScalerSettings().heartbeat_misses == 5


async def test_model_view_from_heartbeats_on_the_bus(nats_server: NatsServer) -> None:
    subjects = Subjects(prefix=f"t{uuid.uuid4().hex[:8]}")
    nc = await nats_server.connect(name="test-scaler-signals")
    try:
        signals = BusSignals(nc, subjects, heartbeat_misses=2)
        seen = asyncio.Event()
        observe = signals.workers.on_beat
        assert observe is not None

        def on_beat(b: WorkerHeartbeat) -> None:
            observe(b)
            if b.worker_id == "w2":
                seen.set()

        signals.workers.on_beat = on_beat
        await signals.start()
        await nc.publish(subjects.heartbeat("org/m"), codec.encode(beat("w1", WorkerState.READY)))
        await nc.publish(
            subjects.heartbeat("org/m"), codec.encode(beat("w2", WorkerState.STARTING, 7.5))
        )
        await asyncio.wait_for(seen.wait(), 5)
        view = signals.view("org/m")
        now = time.monotonic()
        assert {b.worker_id for b in view.live(now)} == {"w1", "w2"}
        assert view.slots_per_worker == 6 and view.startup_s == 7.5
        assert view.live(now + 2.5) == []  # two missed one-second beats: gone
        assert signals.view("org/other").live(now) == []
    finally:
        await nc.close()


def test_tokens_per_second_from_the_workers_token_counters() -> None:
    """Each beat's growth of tokens_total counts; a first sight or a stop counts nothing."""
    workers = WorkerView(3)
    view = ModelView("org/m", workers)

    def seen(worker_id: str, tokens: int | None, state: WorkerState = WorkerState.READY) -> None:
        b = beat(worker_id, state).model_copy(update={"tokens_total": tokens})
        workers.observe(b)
        BusSignals._count_tokens(view, b)

    seen("w1", 50_000)  # first sight (the scaler just started): where w1 counts from
    seen("w2", 0)
    assert view.tokens_per_s(time.monotonic()) == 0
    seen("w1", 50_600)
    seen("w2", 600)
    seen("w2", 600)  # no growth
    assert view.tokens_per_s(time.monotonic()) == pytest.approx(1200 / 60)
    seen("w2", None, WorkerState.STOPPED)
    assert "w2" not in view.served
    seen("w2", 900)  # a worker id seen again starts over
    assert view.tokens_per_s(time.monotonic()) == pytest.approx(1200 / 60)
