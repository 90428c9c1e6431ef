"""A request routed to one worker's direct lane is offered to that worker, body included.

The router publishes the request to the work queue, then sends the worker an
offer: the same body and trace headers, with the request's sequence in the
queue, its lane, and the queue's creation time, when the worker's heartbeats
say it claims offers. A request in a shared lane, or for a worker that does
not claim offers, gets an arrival (no body) instead.
"""

from __future__ import annotations

import asyncio
import time

import orjson

from services.router.dispatch import Dispatcher
from tests.conftest import NatsServer
from tollgate.wire import codec
from tollgate.wire.contracts import Arrival, Endpoint, InferenceRequest
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SUBJECTS = Subjects("offers")
MODEL = "some/model"


def request(request_id: str, dispatcher: Dispatcher) -> InferenceRequest:
    now = time.time()
    return InferenceRequest(
        request_id=request_id,
        model=MODEL,
        endpoint=Endpoint.CHAT,
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        reply_to=dispatcher.reply_subject(request_id),
        enqueued_at=now,
        start_by=now + 30,
        deadline=now + 60,
        tenant="acme",
        key_id="k1",
    )


async def test_a_direct_request_is_offered_to_its_worker_and_a_shared_one_announced(
    nats_server: NatsServer,
) -> None:
    router_nc = await nats_server.connect(name="test-router")
    worker_nc = await nats_server.connect(name="test-worker")
    offers: asyncio.Queue = asyncio.Queue()
    arrivals: asyncio.Queue = asyncio.Queue()
    try:
        await worker_nc.subscribe(SUBJECTS.offer(MODEL, "w-1"), cb=offers.put)
        await worker_nc.subscribe(SUBJECTS.arrivals(MODEL), cb=arrivals.put)
        await worker_nc.flush()
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])

        direct = await dispatcher.submit(
            request("req-direct", dispatcher), worker_id="w-1", offer=True
        )
        offer = await asyncio.wait_for(offers.get(), 5)
        assert offer.data == codec.encode(direct.request)  # the body as queued
        assert offer.headers["Tollgate-Seq"] == str(direct.seq)
        assert offer.headers["Tollgate-Lane"] == SUBJECTS.infer_lane(
            MODEL, "interactive", "acme", "k1", "w-1"
        )
        info = await router_nc.request(
            f"$JS.API.STREAM.INFO.{SUBJECTS.infer_stream}", b"", timeout=5
        )
        assert offer.headers["Tollgate-Stream"] == orjson.loads(info.data)["created"]
        assert offer.headers["Tollgate-Request-Id"] == "req-direct"
        # the queued message is the offered one: same body at that sequence
        stored = await router_nc.jetstream().get_msg(SUBJECTS.infer_stream, direct.seq)
        assert stored.data == offer.data

        shared = await dispatcher.submit(request("req-shared", dispatcher))
        arrival = codec.decode(Arrival, (await asyncio.wait_for(arrivals.get(), 5)).data)
        assert arrival.request_id == "req-shared"
        assert arrival.lane == SUBJECTS.infer_lane(MODEL, "interactive", "acme", "k1")
        await router_nc.flush()
        await worker_nc.flush()
        assert offers.empty() and arrivals.empty()  # one each: no arrival for the direct one
        assert shared.seq is not None

        # a worker whose beats do not say it claims offers (an older one, or one
        # serving first come, first served) hears of its direct request by an arrival
        await dispatcher.submit(request("req-old-worker", dispatcher), worker_id="w-1")
        arrival = codec.decode(Arrival, (await asyncio.wait_for(arrivals.get(), 5)).data)
        assert arrival.request_id == "req-old-worker"
        assert arrival.lane == SUBJECTS.infer_lane(MODEL, "interactive", "acme", "k1", "w-1")
        await router_nc.flush()
        await worker_nc.flush()
        assert offers.empty()
    finally:
        await router_nc.close()
        await worker_nc.close()


async def test_offers_carry_the_queue_created_again_after_a_restart(
    nats_server: NatsServer,
) -> None:
    """The router reads the queue's creation time again after it reconnects."""
    router_nc = await nats_server.connect(name="test-router")
    worker_nc = await nats_server.connect(name="test-worker")
    offers: asyncio.Queue = asyncio.Queue()
    try:
        await worker_nc.subscribe(SUBJECTS.offer(MODEL, "w-1"), cb=offers.put)
        await worker_nc.flush()
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])
        await dispatcher.submit(request("req-1", dispatcher), worker_id="w-1", offer=True)
        first = (await asyncio.wait_for(offers.get(), 5)).headers["Tollgate-Stream"]

        admin = await nats_server.connect(name="test-admin")
        try:  # the queue is created again by another router (after a restart that lost it)
            await admin.jetstream().delete_stream(SUBJECTS.infer_stream)
            await Topology(SUBJECTS).ensure_work(admin.jetstream())
        finally:
            await admin.close()
        router_nc.stats["reconnects"] += 1  # what the client counts when it reconnects
        await dispatcher.submit(request("req-2", dispatcher), worker_id="w-1", offer=True)
        second = (await asyncio.wait_for(offers.get(), 5)).headers["Tollgate-Stream"]
        assert second != first
    finally:
        await router_nc.close()
        await worker_nc.close()
