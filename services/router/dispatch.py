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
from typing import Any

import orjson
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import APIError, NoStreamResponseError

from services.router.errors import PayloadTooLarge
from services.router.limits import Reservation
from tollgate.runtime import tracing
from tollgate.runtime.settings import SettingError
from tollgate.wire import codec
from tollgate.wire.bus import ENVELOPE_ROOM, MAX_PAYLOAD, subscribe_at_once
from tollgate.wire.contracts import (
    Arrival,
    CancelRequest,
    InferenceRequest,
    ResponseChunk,
    Usage,
)
from tollgate.wire.subjects import QUEUE_HEADER
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.router.dispatch")

# JetStream's refusals of a message that would pass the work queue's limits
# (messages, bytes, messages per lane).
_QUEUE_FULL = frozenset({10077, 10047, 10159})


class QueueFull(Exception):
    """The work queue refused the request: it is at one of its limits."""


class Call:
    """One request in flight: its chunks arrive on ``queue`` in order."""

    __slots__ = (
        "cancelled",
        "captured",
        "delivered",
        "direct_to",
        "end_msg",
        "first_output_at",
        "offer",
        "queue",
        "reconnects",
        "request",
        "reservation",
        "running_on",
        "seq",
        "started_at",
        "submitted_at",
        "token",
        "unjournaled",
        "withdrawal",
        "worker_id",
    )

    def __init__(self, request: InferenceRequest) -> None:
        self.request = request
        # the key its chunks arrive under (the request id, then one per retry)
        self.token = request.request_id
        self.seq: int | None = None  # its message in the work queue, once published
        self.queue: asyncio.Queue[ResponseChunk] = asyncio.Queue()
        self.worker_id: str | None = None
        # the worker whose direct lane it was sent to (cache-aware routing), if any
        self.direct_to: str | None = None
        self.offer = False  # offered to that worker, which claims offers
        self.running_on: str | None = None  # the worker it counts as running on
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
        # The worker's final report (END, a request), acknowledged once the
        # call's usage event is journaled (:meth:`Dispatcher.acknowledge_end`).
        self.end_msg: Msg | None = None
        # the router's NATS reconnects when it was queued: a worker that looks
        # lost after one may only have been out of this router's sight
        self.reconnects = 0
        # whether the router took it back out of the queue (see Dispatcher.withdraw)
        self.withdrawal: asyncio.Future[bool] | None = None
        # its open record could not be written to the outbox: it is stopped at once
        self.unjournaled = False


class Dispatcher:
    def __init__(self, nc: NATS, topology: Topology, router_id: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.topology = topology
        self.subjects = topology.subjects
        self.router_id = router_id
        self._calls: dict[str, Call] = {}  # by token
        self.model_ids: list[str] = []
        # model -> (read at, count, the queue's last sequence then)
        self._waiting: dict[str, tuple[float, int, int]] = {}
        # this router's calls no worker has taken yet: model -> token -> (acked at, sequence)
        self._unstarted: dict[str, dict[str, tuple[float, int]]] = {}
        # calls sent to a worker's direct lane, not started yet: worker -> tokens
        self._direct: dict[str, set[str]] = {}
        # this router's calls running on each worker, now and when its latest beat came
        self._running: dict[str, int] = {}
        self._running_at_beat: dict[str, int] = {}
        # The work queue as last read with its counts (:meth:`waiting`):
        # whether it sends workers the requests of their direct lanes (its
        # republish as this version declares it: a router of an earlier
        # version may have updated the queue without it), and its creation
        # time (its identity), with this connection's reconnects then.
        self.queue_offers = True
        self._republish: dict[str, object] | None = None
        self._created: tuple[str, int] | None = None

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
        republish = self.topology.work.config(self.topology.replicas).republish
        self._republish = republish.as_dict() if republish is not None else None
        await self.topology.ensure_work(self.js)
        try:  # unread, offers count as arrivals until the first call's admission reads it
            await self._read_queue()
        except Exception as exc:
            log.warning("work queue unread: %s: %s", type(exc).__name__, str(exc))
        await subscribe_at_once(
            self.nc, f"{self.subjects.reply_prefix(self.router_id)}.*", self._on_chunk
        )

    def reply_subject(self, token: str) -> str:
        return self.subjects.reply(self.router_id, token)

    def _on_chunk(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        call = self._calls.get(token)
        if call is None:
            # The call is over (client gone); late chunks are dropped. A final
            # report (END, sent as a request) gets no acknowledgement, so the
            # worker keeps it for whichever run of the router holds the call.
            return
        try:
            chunk = codec.decode(ResponseChunk, msg.data)
        except Exception:
            log.error("malformed chunk dropped", extra={"request_id": token})
            return
        if msg.reply:  # the END: acknowledged once this router has billed the call
            call.end_msg = msg
        call.queue.put_nowait(chunk)

    async def acknowledge_end(self, call: Call) -> None:
        """Tell the worker its final report is billed (the call's event is in the outbox).

        Until then the worker keeps waiting for this, and without it (this
        router died first) keeps the report in the orphans bucket, from which
        this router's next run bills the call with the engine's own counts.
        """
        msg, call.end_msg = call.end_msg, None
        if msg is not None:
            with contextlib.suppress(Exception):  # not acknowledged: the worker keeps it
                await msg.respond(b"")

    async def submit(
        self, request: InferenceRequest, worker_id: str | None = None, offer: bool = False
    ) -> Call:
        """Register the call, then publish it to its lane of the model's work queue.

        With ``worker_id``, to that worker's direct lane (cache-aware routing),
        and ``offer``: that worker claims offers (its heartbeats say so). The
        work queue itself offers it: as it stores a request in a direct lane,
        it sends a copy to the lane's worker with its sequence (a republish,
        :attr:`Subjects.offers_by_lane`), so the worker may start it before
        this router has the queue's acknowledgement; the request carries the
        queue's creation time as this router last read it
        (:data:`~tollgate.wire.subjects.QUEUE_HEADER`), which tells the worker
        which queue that sequence is in. Any other request is announced (an
        arrival) once the queue has it.
        """
        call = Call(request)
        call.reconnects = int(self.nc.stats["reconnects"])
        call.direct_to = worker_id
        call.offer = offer and worker_id is not None
        await self._publish(call)
        return call

    def started(self, call: Call) -> None:
        """A worker took the call: it no longer waits in the queue."""
        self._unstarted.get(call.request.model, {}).pop(call.token, None)
        if call.direct_to is not None:
            waiting = self._direct.get(call.direct_to)
            if waiting is not None:
                waiting.discard(call.token)
                if not waiting:
                    del self._direct[call.direct_to]
        if call.running_on is None and call.worker_id is not None and call.token in self._calls:
            call.running_on = call.worker_id
            self._running[call.worker_id] = self._running.get(call.worker_id, 0) + 1

    def _stopped(self, call: Call) -> None:
        """The call no longer runs on its worker (over, or queued again)."""
        worker_id, call.running_on = call.running_on, None
        if worker_id is not None:
            left = self._running.get(worker_id, 0) - 1
            if left > 0:
                self._running[worker_id] = left
            else:
                self._running.pop(worker_id, None)

    def heard(self, worker_id: str) -> None:
        """A heartbeat of ``worker_id`` arrived: its slots_used counts this router's calls now."""
        self._running_at_beat[worker_id] = self._running.get(worker_id, 0)
        if len(self._running_at_beat) > 10_000:  # workers come and go: keep the busy ones
            self._running_at_beat = {w: n for w, n in self._running_at_beat.items() if n}

    def busy(self, worker_id: str, slots_used: int) -> int:
        """A worker's requests as far as this router can tell, from its latest ``slots_used``.

        Other routers' calls as the beat counted them, plus this router's
        running there now and sent to its direct lane and not started yet.
        """
        others = max(0, slots_used - self._running_at_beat.get(worker_id, 0))
        return others + self._running.get(worker_id, 0) + len(self._direct.get(worker_id, ()))

    async def requeue(self, call: Call) -> None:
        """Queue a call again for another worker (its worker was lost before any output).

        The new attempt has its own reply subject, so chunks that the lost
        worker may still send are dropped.
        """
        self.started(call)
        self._stopped(call)
        self._calls.pop(call.token, None)
        call.direct_to = None  # to the shared queue: any worker
        call.offer = False
        attempt = call.request.attempt + 1
        call.token = f"{call.request.request_id}~{attempt}"
        call.request = call.request.model_copy(
            update={"attempt": attempt, "reply_to": self.reply_subject(call.token)}
        )
        call.queue = asyncio.Queue()
        call.worker_id = None
        call.started_at = None
        call.seq = None
        call.withdrawal = None
        await self._publish(call)

    async def _publish(self, call: Call) -> None:
        request = call.request
        # Encoded before the call is registered: a request that cannot be
        # encoded leaves nothing behind.
        data = codec.encode(request)
        if len(data) + 4096 > self.nc.max_payload:  # 4 KiB: the headers
            raise PayloadTooLarge(
                f"The request is larger than the {self.nc.max_payload} bytes the bus carries."
            )
        self._calls[call.token] = call
        if call.direct_to is not None:  # counted at once: the next call's choice sees it
            self._direct.setdefault(call.direct_to, set()).add(call.token)
        subject = self.subjects.infer_lane(
            request.model,
            request.priority.value,
            request.tenant or "anonymous",
            request.key_id,
            call.direct_to,
        )
        msg_id = call.token
        headers = tracing.inject({"Nats-Msg-Id": msg_id, "Tollgate-Request-Id": request.request_id})
        queue = self._queue_identity() if call.offer else None
        if queue is not None:
            # which queue the worker's copy comes from: its sequence names a
            # request in that queue only (one made again counts from 1)
            headers[QUEUE_HEADER] = queue
        try:
            try:
                ack = await self.js.publish(subject, data, headers=headers, timeout=5)
            except NoStreamResponseError:
                # The in-memory stream is gone (NATS restarted): recreate it once.
                self._created = None
                headers.pop(QUEUE_HEADER, None)  # the new queue's is not read yet
                await self.topology.ensure_work(self.js)
                ack = await self.js.publish(subject, data, headers=headers, timeout=5)
        except BaseException as exc:
            self.started(call)  # no longer waits for its worker
            self._calls.pop(call.token, None)
            if isinstance(exc, APIError) and exc.err_code in _QUEUE_FULL:
                raise QueueFull(str(exc.description)) from None
            # The publish may have reached the queue although its ack did not
            # come back (a timeout): make sure no worker runs it for nobody.
            await self.cancel(call, "not_dispatched")
            raise
        call.seq = ack.seq
        self._unstarted.setdefault(request.model, {})[call.token] = (time.monotonic(), ack.seq)
        if not (call.offer and self.queue_offers):
            await self._announce(request, subject)  # else the queue sent it to its worker

    async def _announce(self, request: InferenceRequest, lane: str) -> None:
        """Tell the scaler and the model's idle workers that a request waits (no body).

        Sent once the request is in the queue, so a worker woken by it finds it.
        """
        arrival = Arrival(
            request_id=request.request_id, model=request.model, at=request.enqueued_at, lane=lane
        )
        try:
            await self.nc.publish(self.subjects.arrivals(request.model), codec.encode(arrival))
        except Exception as exc:  # workers also look every second: not worth failing for
            log.warning("arrival not announced: %s: %s", type(exc).__name__, str(exc))

    async def cancel(self, call: Call, reason: str) -> None:
        if call.cancelled:
            return
        call.cancelled = True
        if call.worker_id is None and call.seq is not None:
            await self.withdraw(call)
        cancel = CancelRequest(request_id=call.request.request_id, reason=reason)
        try:
            await self.nc.publish(
                self.subjects.cancel(call.request.request_id), codec.encode(cancel)
            )
        except Exception as exc:
            log.warning("cancel not sent: %s: %s", type(exc).__name__, str(exc))

    async def withdraw(self, call: Call) -> bool:
        """Delete a request no worker has taken yet from the queue (best effort, once).

        True when this router deleted it: no worker runs it. False when a
        worker took it meanwhile (it gets the cancel message instead, and its
        final report tells what it did), or when the queue could not say. A
        second call has the first one's answer.
        """
        if call.withdrawal is not None:
            return await asyncio.shield(call.withdrawal)
        call.withdrawal = asyncio.get_running_loop().create_future()
        withdrawn = False
        request = orjson.dumps({"seq": call.seq, "no_erase": True})
        try:
            reply = await self.nc.request(
                f"$JS.API.STREAM.MSG.DELETE.{self.subjects.infer_stream}", request, timeout=2
            )
            withdrawn = bool(orjson.loads(reply.data).get("success"))
        except Exception as exc:
            log.debug("withdraw failed: %s: %s", type(exc).__name__, exc)
        finally:
            call.withdrawal.set_result(withdrawn)
        return withdrawn

    async def waiting(self, model: str, max_age_s: float = 0.5) -> int:
        """Requests of ``model`` waiting in the work queue, from every router.

        The queue's per-lane counts are read at most every ``max_age_s``; this
        router's calls acknowledged since and not yet taken are added. Calls
        acknowledged while the counts were on their way may be in them or not
        (the server reads its state, then the counts): they are not added, so
        none counts twice (a call counted twice refuses another one below the
        limit; one left out lets one more wait, within the queue's own
        limits), nor are calls the queue had stored when it read its state.
        """
        seen = self._waiting.get(model)
        if seen is None or time.monotonic() - seen[0] > max_age_s:
            info = await self._read_queue(self.subjects.infer_lanes(model))
            state = info.get("state") or {}
            count = sum(int(n) for n in (state.get("subjects") or {}).values())
            last_seq = int(state.get("last_seq") or 0)
            seen = self._waiting[model] = (time.monotonic(), count, last_seq)
        read_at, count, last_seq = seen
        mine = self._unstarted.get(model)
        if not mine:
            return count
        return count + sum(1 for at, seq in mine.values() if at > read_at and seq > last_seq)

    async def _read_queue(self, lanes: str | None = None) -> dict[str, Any]:
        """The work queue's info (with the counts of ``lanes``): its republish and identity."""
        reconnects = int(self.nc.stats["reconnects"])
        request = orjson.dumps({"subjects_filter": lanes} if lanes else {})
        reply = await self.nc.request(
            f"$JS.API.STREAM.INFO.{self.subjects.infer_stream}", request, timeout=5
        )
        info: dict[str, Any] = orjson.loads(reply.data)
        if "error" in info:
            raise RuntimeError(f"work queue: {info['error'].get('description')}")
        self.queue_offers = (info.get("config") or {}).get("republish") == self._republish
        created = info.get("created")
        self._created = (created, reconnects) if isinstance(created, str) else None
        return info

    def _queue_identity(self) -> str | None:
        """The work queue's creation time as last read; None if not read since a reconnect."""
        if self._created is None or self._created[1] != self.nc.stats["reconnects"]:
            return None
        return self._created[0]

    @property
    def in_flight(self) -> int:
        return len(self._calls)

    @property
    def queued(self) -> int:
        return sum(1 for call in self._calls.values() if call.worker_id is None)

    def finish(self, call: Call) -> None:
        self.started(call)
        self._stopped(call)
        self._calls.pop(call.token, None)
