"""A model without a ready worker wakes the scaler on each arrival (no body); others do not."""

from __future__ import annotations

import asyncio
import time

from services.router.dispatch import Dispatcher
from services.scaler.signals import BusSignals
from tests.conftest import NatsServer
from tollgate.wire.contracts import Endpoint, InferenceRequest
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SUBJECTS = Subjects("arrivals")
MODEL = "some/model"
PROMPT = "x" * 1_000_000  # a 1 MB prompt that the scaler must not receive


def request(i: int, reply_to: str) -> InferenceRequest:
    now = time.time()
    return InferenceRequest(
        request_id=f"req-{i}",
        model=MODEL,
        endpoint=Endpoint.CHAT,
        body={"model": MODEL, "messages": [{"role": "user", "content": PROMPT}]},
        reply_to=reply_to,
        enqueued_at=now,
        start_by=now + 30,
        deadline=now + 60,
    )


async def test_arrivals_wake_the_scaler_without_request_bodies(nats_server: NatsServer) -> None:
    router_nc = await nats_server.connect(name="test-router")
    scaler_nc = await nats_server.connect(name="test-scaler")
    try:
        signals = BusSignals(scaler_nc, SUBJECTS)
        await signals.start()
        await signals.follow_arrivals(MODEL, True)  # as for a model with no ready worker
        await scaler_nc.flush()
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])
        before = scaler_nc.stats["in_bytes"]
        for i in range(3):
            await dispatcher.submit(request(i, dispatcher.reply_subject(f"req-{i}")))
        async with asyncio.timeout(10):
            while signals.view(MODEL).arrivals < 3:
                await signals.arrived.wait()
                signals.arrived.clear()  # the count is read again after this
        assert signals.view(MODEL).last_arrival_at is not None
        # three prompts of 1 MB each went to the work queue; the scaler got kilobytes
        assert scaler_nc.stats["in_bytes"] - before < 10_000
        assert await signals.queued(MODEL) == 3
    finally:
        await router_nc.close()
        await scaler_nc.close()


async def test_a_model_with_ready_workers_costs_the_scaler_nothing_per_request(
    nats_server: NatsServer,
) -> None:
    """Not followed: its arrivals never reach the scaler; the queue is read on the tick."""
    subjects = Subjects("arrivals-off")
    router_nc = await nats_server.connect(name="test-router")
    scaler_nc = await nats_server.connect(name="test-scaler")
    try:
        signals = BusSignals(scaler_nc, subjects)
        await signals.start()
        await signals.follow_arrivals(MODEL, True)
        await signals.follow_arrivals(MODEL, False)  # a worker became ready
        assert not signals.following(MODEL)
        await scaler_nc.flush()
        dispatcher = Dispatcher(router_nc, Topology(subjects), "r1")
        await dispatcher.start([MODEL])
        received = scaler_nc.stats["in_msgs"]
        for i in range(5):
            await dispatcher.submit(request(i, dispatcher.reply_subject(f"req-{i}")))
        await router_nc.flush()
        assert await signals.queued(MODEL) == 5  # what the tick reads instead
        await scaler_nc.flush()
        # the five arrivals were published, and none of them reached the scaler
        assert router_nc.stats["out_msgs"] >= 5
        assert signals.view(MODEL).arrivals == 0
        assert scaler_nc.stats["in_msgs"] - received <= 2  # the queue query's own reply
    finally:
        await router_nc.close()
        await scaler_nc.close()
