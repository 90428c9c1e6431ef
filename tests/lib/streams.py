"""Read what a JetStream stream holds on one subject, without guessing when it ends."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors
from nats.aio.msg import Msg


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
