"""Capture: the request and response bodies of chosen keys and tenants, for analysis.

A key record with ``capture = true``, or a tenant in
``TOLLGATE_ROUTER_CAPTURE_TENANTS``, has each call's JSON body and its answer
published on ``tg.capture.<tenant>`` when the call ends; the metering service
stores them in ClickHouse's ``exchanges`` table. A streamed answer is
reassembled from its chunks into the text and one JSON body shaped like the
non-streamed response. Bodies are cut at ``capture_max_bytes``. Capture never
delays or fails a call: a lost capture is counted and logged, nothing more.

Replays (``tollgate replay``) are not captured again, but only a replay
identity may say so: a call is left out of capture when its key record has
``replay = true`` (set by the operator when the key is created, ``tollgate
keys create --replay``; no update changes it) *and* the call carries
``X-Tollgate-Replay``. From any other key, or on a router without auth, the
header is ignored and the call is captured as its key and tenant say. The
flag lives in the key record, so it is signed off by whoever may write the
whitelist, travels to every router with the record, and dies with the key.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import orjson
from nats.js import JetStreamContext

from services.router.endpoints import SPECS
from tollgate.keys.records import KeyRecord
from tollgate.wire import codec
from tollgate.wire.contracts import CaptureEvent, Endpoint, UsageEvent
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.router.capture")

REPLAY_HEADER = "X-Tollgate-Replay"


def replay_exempt(record: KeyRecord | None, headers: Mapping[str, str]) -> bool:
    """Whether a call is a replay that is not captured again: a replay key's, marked so."""
    return record is not None and record.replay and REPLAY_HEADER in headers


def reassemble(endpoint: Endpoint, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
    """(generated text, response JSON) from the relayed data (SSE events or one body)."""
    return SPECS[endpoint].reassemble(streamed, pieces)


def _cut(text: str, limit: int) -> tuple[str, bool]:
    data = text.encode()
    if len(data) <= limit:
        return text, False
    return data[:limit].decode(errors="ignore"), True


class Capturer:
    def __init__(
        self, js: JetStreamContext, subjects: Subjects, tenants: list[str], max_bytes: int
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.tenants = set(tenants)
        self.max_bytes = max_bytes
        self.failed = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def wanted(self, record: KeyRecord | None, tenant: str) -> bool:
        if record is not None and record.capture:
            return True
        return "*" in self.tenants or tenant in self.tenants

    def emit(
        self,
        event: UsageEvent,
        endpoint: Endpoint,
        request_body: dict[str, Any],
        pieces: list[str],
        finish_reason: str | None,
    ) -> None:
        request_text, request_cut = _cut(orjson.dumps(request_body).decode(), self.max_bytes)
        text, body = reassemble(endpoint, event.streamed, pieces)
        text, text_cut = _cut(text, self.max_bytes)
        response, body_cut = _cut(orjson.dumps(body).decode() if body else "", self.max_bytes)
        capture = CaptureEvent.from_usage(
            event,
            endpoint=endpoint.value,
            request_body=request_text,
            request_truncated=request_cut,
            response_text=text,
            response_body=response,
            response_truncated=text_cut or body_cut,
            finish_reason=finish_reason,
        )
        task = asyncio.create_task(self._publish(capture))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(self, capture: CaptureEvent) -> None:
        try:
            await self.js.publish(
                self.subjects.capture(capture.tenant),
                codec.encode(capture),
                headers={"Nats-Msg-Id": capture.request_id},
                timeout=5,
            )
        except Exception as exc:
            self.failed += 1
            log.warning(
                "capture not published: %s: %s",
                type(exc).__name__,
                exc,
                extra={"request_id": capture.request_id},
            )

    async def drain(self, timeout: float = 10) -> None:
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=timeout)
