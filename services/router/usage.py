"""Publishes one usage event per accepted request to the usage stream.

Events are published after the response, off the request's path, with
``Nats-Msg-Id`` = request id so a retry never counts twice.
"""

from __future__ import annotations

import asyncio
import logging

from nats.js import JetStreamContext

from tollgate import codec
from tollgate.bus import ensure_usage_stream
from tollgate.contracts import UsageEvent
from tollgate.subjects import Subjects

log = logging.getLogger("tollgate.router.usage")


class UsagePublisher:
    def __init__(self, js: JetStreamContext, subjects: Subjects) -> None:
        self.js = js
        self.subjects = subjects
        self._pending: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await ensure_usage_stream(self.js, self.subjects)

    def emit(self, event: UsageEvent) -> None:
        task = asyncio.create_task(self._publish(event))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, event: UsageEvent) -> None:
        headers = {"Nats-Msg-Id": event.request_id}
        for attempt in range(5):
            try:
                await self.js.publish(
                    self.subjects.usage(event.tenant), codec.encode(event), headers=headers
                )
                return
            except Exception as exc:
                log.warning(
                    "usage event not yet published: %s",
                    type(exc).__name__,
                    extra={"request_id": event.request_id, "attempt": attempt},
                )
                await asyncio.sleep(0.2 * 2**attempt)
        log.error("usage event dropped after retries", extra={"request_id": event.request_id})

    async def flush(self, timeout: float = 10) -> None:
        if self._pending:
            await asyncio.wait(self._pending, timeout=timeout)
