"""A worker's final report is acknowledged only once the router has billed the call.

The worker keeps a report no router acknowledged in the orphans bucket, where
the router's next run bills the call with the engine's counts. So the router
must not acknowledge it before the call's usage event is in its outbox: a
router killed in between (the client may already have its whole answer) would
otherwise leave neither an event nor an orphan, and the call would be billed
at zero once its deadline passed.
"""

from __future__ import annotations

import asyncio
import time

from services.router.dispatch import Dispatcher
from tests.conftest import NatsServer
from tollgate.wire import codec
from tollgate.wire.contracts import (
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
)
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SUBJECTS = Subjects("endack")
MODEL = "some/model"


async def test_the_end_is_acknowledged_once_billed_not_on_arrival(
    nats_server: NatsServer,
) -> None:
    router_nc = await nats_server.connect(name="test-router")
    worker_nc = await nats_server.connect(name="test-worker")
    try:
        dispatcher = Dispatcher(router_nc, Topology(SUBJECTS), "r1")
        await dispatcher.start([MODEL])
        now = time.time()
        call = await dispatcher.submit(
            InferenceRequest(
                request_id="req-1",
                model=MODEL,
                endpoint=Endpoint.CHAT,
                body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
                reply_to=dispatcher.reply_subject("req-1"),
                enqueued_at=now,
                start_by=now + 30,
                deadline=now + 60,
            )
        )
        end = ResponseChunk(
            request_id="req-1",
            seq=0,
            kind=ChunkKind.END,
            worker_id="w1",
            usage=Usage(prompt_tokens=7, completion_tokens=3),
            outcome=Outcome.COMPLETED,
        )
        # the worker sends its report as a request and waits for the answer
        ask = asyncio.create_task(
            worker_nc.request(call.request.reply_to, codec.encode(end), timeout=10)
        )
        got = await asyncio.wait_for(call.queue.get(), 5)
        assert got.kind is ChunkKind.END and got.usage == end.usage  # the router has it
        await asyncio.sleep(0.3)
        assert not ask.done()  # not billed yet: not acknowledged
        await dispatcher.acknowledge_end(call)  # what finishing does once the event is journaled
        await asyncio.wait_for(ask, 5)
        assert call.end_msg is None
        await dispatcher.acknowledge_end(call)  # once only: a second call sends nothing
    finally:
        await router_nc.close()
        await worker_nc.close()
