"""What a router counts as waiting in a model's queue (its admission's limit reads it).

The queue's per-lane counts are read at most every half second and the
router's own calls stored since are added; a call acknowledged while a read
was on its way must be counted once, not twice (a burst into a busy model
was refused below its limit when it counted twice).
"""

from __future__ import annotations

import asyncio

from services.router.dispatch import Dispatcher
from tests.conftest import NatsServer
from tests.router.test_offers import PREFIX, SUBJECTS, request
from tollgate.wire.contracts import InferenceRequest
from tollgate.wire.topology import Role, Topology

MODEL = "depth/model"  # its lanes hold this test's calls only


def depth_request(request_id: str, dispatcher: Dispatcher) -> InferenceRequest:
    base = request(request_id, dispatcher)
    return base.model_copy(update={"model": MODEL, "body": {**base.body, "model": MODEL}})


async def test_calls_stored_while_the_counts_are_read_are_counted_once(
    nats_server: NatsServer,
) -> None:
    router_nc = await nats_server.connect(Role.ROUTER, "test-router", PREFIX)
    try:
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "depth")
        await dispatcher.start([MODEL])
        sent = 0
        over: list[tuple[int, int]] = []

        async def submit(i: int) -> None:
            nonlocal sent
            sent += 1
            await dispatcher.submit(depth_request(f"depth-{i}", dispatcher))

        async def read() -> None:
            # at most the calls sent so far, whatever order the answers come in
            counted = await dispatcher.waiting(MODEL, max_age_s=0)
            if counted > sent:
                over.append((counted, sent))

        for burst in range(20):
            tasks = []
            for i in range(8):
                tasks.append(submit(burst * 8 + i))
                tasks.append(read())
            await asyncio.gather(*tasks)
        assert over == []
        # every call is counted once it is stored, from the counts or as this router's
        assert await dispatcher.waiting(MODEL, max_age_s=0) == sent == 160
        assert await dispatcher.waiting(MODEL) == 160  # and from the counts kept
        await dispatcher.submit(depth_request("depth-last", dispatcher))
        assert await dispatcher.waiting(MODEL) == 161  # added to the counts kept
    finally:
        admin = await nats_server.connect(Role.ADMIN, "test-admin", PREFIX)
        try:
            await admin.jetstream().purge_stream(
                SUBJECTS.infer_stream, subject=SUBJECTS.infer_lanes(MODEL)
            )
        finally:
            await admin.close()
        await router_nc.close()


async def test_calls_workers_took_before_their_start_reached_the_router_leave_a_fresh_count(
    nats_server: NatsServer,
) -> None:
    """A call a worker claimed counts as waiting in the kept counts until its START
    reaches the router; admission reads the counts afresh before it refuses."""
    router_nc = await nats_server.connect(Role.ROUTER, "test-router", PREFIX)
    admin = await nats_server.connect(Role.ADMIN, "test-admin", PREFIX)
    try:
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "depth-fresh")
        await dispatcher.start([MODEL])
        assert await dispatcher.waiting(MODEL, max_age_s=0) == 0
        calls = [await dispatcher.submit(depth_request(f"taken-{i}", dispatcher)) for i in range(3)]
        for call in calls:  # claimed: a worker deleted each (no START yet)
            assert call.seq is not None
            await admin.jetstream().delete_msg(SUBJECTS.infer_stream, call.seq)
        assert await dispatcher.waiting(MODEL) == 3  # the counts kept, plus this router's
        assert await dispatcher.waiting(MODEL, max_age_s=0) == 0
    finally:
        await admin.jetstream().purge_stream(
            SUBJECTS.infer_stream, subject=SUBJECTS.infer_lanes(MODEL)
        )
        await admin.close()
        await router_nc.close()
