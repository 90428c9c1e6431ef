"""Read what a JetStream stream holds on one subject, without guessing when it ends."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg

from tollgate.wire import codec
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects


async def read_subject(
    js: Any, subject: str, stream: str | None = None, timeout: float = 60
) -> list[Msg]:
    """Every message on `subject`, up to the last one stored when the call began.

    The end is the subject's last sequence number, not a pause in delivery, so
    a slow machine cannot cut the read short.
    """
    stream = stream or await js.find_stream_name_by_subject(subject)
    try:
        last = (await js.get_last_msg(stream, subject)).seq
    except nats.js.errors.NotFoundError:
        return []
    sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
    messages: list[Msg] = []
    try:
        async with asyncio.timeout(timeout):
            while not messages or messages[-1].metadata.sequence.stream < last:
                messages.append(await sub.next_msg(timeout=timeout))
    finally:
        await sub.unsubscribe()
    return messages


async def tenant_usage(
    nats_server: Any, tenant: str, ids: set[str], timeout: float = 30
) -> dict[str, UsageEvent]:
    """The usage events of the calls ``ids`` of ``tenant``, by request id.

    Usage events are written just after a response ends: this waits until
    each call has one, or ``timeout`` passes (a test then sees which are
    missing). ``nats_server``: the test's NatsServer.
    """
    nc = await nats_server.connect(name="test-usage")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout
        while True:
            events = {
                e.request_id: e
                for m in await read_subject(js, Subjects().usage_tenant(tenant))
                if (e := codec.decode(UsageEvent, m.data)).request_id in ids
            }
            if len(events) >= len(ids) or time.monotonic() > deadline:
                return events
            await asyncio.sleep(0.2)
    finally:
        await nc.close()
