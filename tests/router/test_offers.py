"""A request routed to one worker's direct lane reaches that worker from the queue itself.

The work queue republishes every request it stores in a direct lane to
``<prefix>.queued.<model>.<worker>``: the same body and headers, with its
sequence and lane (``Nats-Sequence``, ``Nats-Subject``). The router then
announces no arrival for it when the worker's heartbeats say it claims those
copies. A request in a shared lane, for a worker that does not claim them,
or in a queue an earlier version made without the republish, gets an
arrival (no body).
"""

from __future__ import annotations

import asyncio
import time

import orjson
from nats.aio.client import Client as NATS

from services.router.dispatch import Dispatcher
from tests.conftest import NatsServer
from tollgate.wire import codec
from tollgate.wire.contracts import Arrival, Endpoint, InferenceRequest
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

PREFIX = "offers"
SUBJECTS = Subjects(PREFIX)
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


async def listen(nc: NATS, subject: str) -> asyncio.Queue:
    got: asyncio.Queue = asyncio.Queue()
    await nc.subscribe(subject, cb=got.put)
    await nc.flush()
    return got


async def settled(*connections: NATS) -> None:
    """Whatever was on its way to these connections has arrived."""
    for nc in connections:
        await nc.flush()
    await asyncio.sleep(0.2)


async def test_the_queue_sends_a_direct_request_to_its_worker_and_a_shared_one_is_announced(
    nats_server: NatsServer,
) -> None:
    router_nc = await nats_server.connect(Role.ROUTER, "test-router", PREFIX)
    worker_nc = await nats_server.connect(Role.WORKER, "test-worker", PREFIX)
    try:
        offers = await listen(worker_nc, SUBJECTS.offer(MODEL, "w-1"))
        arrivals = await listen(worker_nc, SUBJECTS.arrivals(MODEL))
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])

        direct = await dispatcher.submit(
            request("req-direct", dispatcher), worker_id="w-1", offer=True
        )
        offer = await asyncio.wait_for(offers.get(), 5)
        assert offer.data == codec.encode(direct.request)  # the body as queued
        assert offer.headers["Nats-Sequence"] == str(direct.seq)
        assert offer.headers["Nats-Subject"] == SUBJECTS.infer_lane(
            MODEL, "interactive", "acme", "k1", "w-1"
        )
        assert offer.headers["Tollgate-Request-Id"] == "req-direct"
        # the queue it came from, as the router read it (a worker claims by the
        # sequence only in that queue)
        info = await router_nc.request(f"$JS.API.STREAM.INFO.{SUBJECTS.infer_stream}", b"")
        assert offer.headers["Tollgate-Queue"] == orjson.loads(info.data)["created"]
        # the queued message is the one sent: same body at that sequence
        admin = await nats_server.connect(Role.ADMIN, "test-admin", PREFIX)
        try:
            stored = await admin.jetstream().get_msg(SUBJECTS.infer_stream, direct.seq)
        finally:
            await admin.close()
        assert stored.data == offer.data

        shared = await dispatcher.submit(request("req-shared", dispatcher))
        arrival = codec.decode(Arrival, (await asyncio.wait_for(arrivals.get(), 5)).data)
        assert arrival.request_id == "req-shared"
        assert arrival.lane == SUBJECTS.infer_lane(MODEL, "interactive", "acme", "k1")
        await settled(router_nc, worker_nc)
        # one each: no arrival for the direct one, no copy of the shared one
        assert offers.empty() and arrivals.empty()
        assert shared.seq is not None

        # a worker whose beats do not say it claims the copies (an older one, or
        # one serving first come, first served) hears of its direct request by an
        # arrival (the queue still sends the copy; such a worker does not listen)
        await dispatcher.submit(request("req-old-worker", dispatcher), worker_id="w-1")
        arrival = codec.decode(Arrival, (await asyncio.wait_for(arrivals.get(), 5)).data)
        assert arrival.request_id == "req-old-worker"
        assert arrival.lane == SUBJECTS.infer_lane(MODEL, "interactive", "acme", "k1", "w-1")
    finally:
        await router_nc.close()
        await worker_nc.close()


async def test_a_queue_made_again_sends_its_copies_with_its_own_sequences(
    nats_server: NatsServer,
) -> None:
    """After the queue is lost (a restart) and made again, its copies name its new sequences."""
    router_nc = await nats_server.connect(Role.ROUTER, "test-router", PREFIX)
    worker_nc = await nats_server.connect(Role.WORKER, "test-worker", PREFIX)
    try:
        offers = await listen(worker_nc, SUBJECTS.offer(MODEL, "w-1"))
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])
        for n in range(3):
            await dispatcher.submit(request(f"req-{n}", dispatcher), worker_id="w-1", offer=True)
        first = await asyncio.wait_for(offers.get(), 5)
        assert first.headers["Tollgate-Request-Id"] == "req-0"

        admin = await nats_server.connect(Role.ADMIN, "test-admin", PREFIX)
        try:
            await admin.jetstream().delete_stream(SUBJECTS.infer_stream)
        finally:
            await admin.close()
        while not offers.empty():
            offers.get_nowait()
        # the router makes it again when its publish finds no stream
        again = await dispatcher.submit(
            request("req-again", dispatcher), worker_id="w-1", offer=True
        )
        offer = await asyncio.wait_for(offers.get(), 5)
        assert again.seq == 1
        assert offer.headers["Nats-Sequence"] == "1"
        assert offer.headers["Tollgate-Request-Id"] == "req-again"
        # not the old queue's identity: read again once the queue was made again
        assert offer.headers.get("Tollgate-Queue") != first.headers["Tollgate-Queue"]
        await dispatcher.waiting(MODEL, max_age_s=0)  # what the next call's admission reads
        await dispatcher.submit(request("req-next", dispatcher), worker_id="w-1", offer=True)
        info = await router_nc.request(f"$JS.API.STREAM.INFO.{SUBJECTS.infer_stream}", b"")
        offer = await asyncio.wait_for(offers.get(), 5)
        assert offer.headers["Tollgate-Queue"] == orjson.loads(info.data)["created"]
    finally:
        await router_nc.close()
        await worker_nc.close()


async def test_a_queue_without_the_copies_gets_arrivals_and_a_router_adds_them(
    nats_server: NatsServer,
) -> None:
    """A router of an earlier version may have updated the queue without its republish.

    Routers read the queue's shape with its counts (every half second at
    most) and announce arrivals for direct requests while it sends no
    copies; a router of this version that starts brings the shape back.
    """
    router_nc = await nats_server.connect(Role.ROUTER, "test-router", PREFIX)
    worker_nc = await nats_server.connect(Role.WORKER, "test-worker", PREFIX)
    topology = Topology(SUBJECTS)
    try:
        offers = await listen(worker_nc, SUBJECTS.offer(MODEL, "w-1"))
        arrivals = await listen(worker_nc, SUBJECTS.arrivals(MODEL))
        dispatcher = Dispatcher(router_nc, topology, "r1")
        await dispatcher.start([MODEL])
        js = router_nc.jetstream()
        old_shape = topology.work.config(topology.replicas)
        old_shape.republish = None
        await js.update_stream(old_shape)

        await dispatcher.waiting(MODEL, max_age_s=0)  # what every call's admission reads
        assert not dispatcher.queue_offers
        await dispatcher.submit(request("req-1", dispatcher), worker_id="w-1", offer=True)
        arrival = codec.decode(Arrival, (await asyncio.wait_for(arrivals.get(), 5)).data)
        assert arrival.request_id == "req-1"
        await settled(router_nc, worker_nc)
        assert offers.empty()

        restarted = Dispatcher(router_nc, topology, "r2")
        await restarted.start([MODEL])
        info = await js.stream_info(SUBJECTS.infer_stream)
        assert info.config.republish is not None
        assert info.config.republish.dest == SUBJECTS.offers_by_lane
        await dispatcher.waiting(MODEL, max_age_s=0)
        assert dispatcher.queue_offers
        await dispatcher.submit(request("req-2", dispatcher), worker_id="w-1", offer=True)
        offer = await asyncio.wait_for(offers.get(), 5)
        assert offer.headers["Tollgate-Request-Id"] == "req-2"
        await settled(router_nc, worker_nc)
        assert arrivals.empty()
    finally:
        await router_nc.close()
        await worker_nc.close()
