"""Hands requests to workers over NATS and collects their chunks.

One subscription per router receives the chunks of all its requests on
``<prefix>.reply.<router-id>.<request-id>``; each chunk goes to its call's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NoStreamResponseError

from services.router.errors import PayloadTooLarge
from services.router.limits import Reservation
from tollgate.runtime import tracing
from tollgate.runtime.settings import SettingError
from tollgate.wire import codec
from tollgate.wire.bus import ENVELOPE_ROOM, MAX_PAYLOAD
from tollgate.wire.contracts import (
    Arrival,
    CancelRequest,
    InferenceRequest,
    ResponseChunk,
    Usage,
)
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.router.dispatch")


class Call:
    """One request in flight: its chunks arrive on ``queue`` in order."""

    __slots__ = (
        "cancelled",
        "captured",
        "delivered",
        "first_output_at",
        "queue",
        "request",
        "reservation",
        "started_at",
        "submitted_at",
        "worker_id",
    )

    def __init__(self, request: InferenceRequest) -> None:
        self.request = request
        self.queue: asyncio.Queue[ResponseChunk] = asyncio.Queue()
        self.worker_id: str | None = None
        self.cancelled = False
        self.submitted_at = time.monotonic()
        self.started_at: float | None = None
        self.first_output_at: float | None = None
        self.reservation: Reservation | None = None
        # Tokens of the output relayed so far (the worker's running count);
        # billed when the worker dies before its final report.
        self.delivered: Usage | None = None
        # The relayed output, kept only when this call's exchange is captured.
        self.captured: list[str] | None = None


class Dispatcher:
    def __init__(self, nc: NATS, topology: Topology, router_id: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.topology = topology
        self.subjects = topology.subjects
        self.router_id = router_id
        self._calls: dict[str, Call] = {}
        self.model_ids: list[str] = []

    async def start(self, model_ids: Iterable[str], body_limit: int | None = None) -> None:
        """Create the work queue and each model's worker consumer, then take chunks.

        Routers create both (workers only bind: they create nothing on the bus).
        With ``body_limit`` (the largest body the edge accepts), refuse to start
        on a bus whose messages cannot carry a body that large.
        """
        if body_limit is not None and body_limit + ENVELOPE_ROOM > self.nc.max_payload:
            raise SettingError(
                f"TOLLGATE_ROUTER_MAX_BODY_BYTES={body_limit}: NATS carries messages of at "
                f"most {self.nc.max_payload} bytes, and a request needs its body plus "
                f"{ENVELOPE_ROOM} bytes. Lower the body limit, or raise the server's "
                f"max_payload (Tollgate's own configurations set {MAX_PAYLOAD})."
            )
        self.model_ids = list(model_ids)
        await self.topology.ensure_workers(self.js, self.model_ids)
        await self.nc.subscribe(
            f"{self.subjects.reply_prefix(self.router_id)}.*", cb=self._on_chunk
        )

    def reply_subject(self, request_id: str) -> str:
        return self.subjects.reply(self.router_id, request_id)

    async def _on_chunk(self, msg: Msg) -> None:
        request_id = msg.subject.rpartition(".")[2]
        call = self._calls.get(request_id)
        if call is None:
            # The call is over (client gone); late chunks are dropped. A final
            # report (END, sent as a request) gets no acknowledgement, so the
            # worker keeps it for whichever run of the router holds the call.
            return
        try:
            chunk = codec.decode(ResponseChunk, msg.data)
        except Exception:
            log.error("malformed chunk dropped", extra={"request_id": request_id})
            return
        call.queue.put_nowait(chunk)
        if msg.reply:  # the END: this router has it, and bills the call
            with contextlib.suppress(Exception):  # not acknowledged: the worker keeps it
                await msg.respond(b"")

    async def submit(self, request: InferenceRequest) -> Call:
        """Register the call, then publish it to the model's work queue."""
        # Encoded before the call is registered: a request that cannot be
        # encoded leaves nothing behind.
        data = codec.encode(request)
        if len(data) + 4096 > self.nc.max_payload:  # 4 KiB: the headers
            raise PayloadTooLarge(
                f"The request is larger than the {self.nc.max_payload} bytes the bus carries."
            )
        call = Call(request)
        self._calls[request.request_id] = call
        subject = self.subjects.infer(request.model)
        headers = tracing.inject(
            {"Nats-Msg-Id": request.request_id, "Tollgate-Request-Id": request.request_id}
        )
        await self._announce(request)
        try:
            try:
                await self.js.publish(subject, data, headers=headers, timeout=5)
            except NoStreamResponseError:
                # The in-memory stream is gone (NATS restarted): recreate it, and
                # the consumers every model's workers wait to bind to, once.
                await self.topology.ensure_workers(self.js, self.model_ids)
                await self.js.publish(subject, data, headers=headers, timeout=5)
        except BaseException:
            self._calls.pop(request.request_id, None)
            # The publish may have reached the queue although its ack did not
            # come back (a timeout): make sure no worker runs it for nobody.
            await self.cancel(call, "not_dispatched")
            raise
        return call

    async def _announce(self, request: InferenceRequest) -> None:
        """Tell the scaler a request arrives (a small event, no body).

        Buffered just before the request itself, so both leave in one write.
        """
        arrival = Arrival(
            request_id=request.request_id, model=request.model, at=request.enqueued_at
        )
        try:
            await self.nc.publish(self.subjects.arrivals(request.model), codec.encode(arrival))
        except Exception as exc:  # the scaler also sees the queue depth: not worth failing for
            log.warning("arrival not announced: %s: %s", type(exc).__name__, str(exc))

    async def cancel(self, call: Call, reason: str) -> None:
        if call.cancelled:
            return
        call.cancelled = True
        cancel = CancelRequest(request_id=call.request.request_id, reason=reason)
        try:
            await self.nc.publish(
                self.subjects.cancel(call.request.request_id), codec.encode(cancel)
            )
        except Exception as exc:
            log.warning("cancel not sent: %s: %s", type(exc).__name__, str(exc))

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    @property
    def queued(self) -> int:
        return sum(1 for call in self._calls.values() if call.worker_id is None)

    def finish(self, call: Call) -> None:
        self._calls.pop(call.request.request_id, None)
