"""The NATS side of a worker.

It pulls requests from its model's work-queue stream only while it has free
slots, runs each in the engine, sends the output as ordered chunks to the
request's reply subject, aborts on cancel, and heartbeats its load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import Error as NatsError
from nats.errors import NoRespondersError
from nats.js import JetStreamContext

from services.worker.adapters import Adapters
from services.worker.claims import Claimed, WorkClaims
from services.worker.engine import (
    Engine,
    EngineResult,
    ErrorResult,
    FullResult,
    StreamResult,
    TokenTally,
    current_tally,
)
from services.worker.metrics import WorkerMetrics
from services.worker.settings import WorkerSettings
from tollgate.models.catalog import AdapterEntry
from tollgate.runtime import tracing
from tollgate.runtime.logs import request_id_var
from tollgate.wire import codec
from tollgate.wire.bus import subscribe_at_once
from tollgate.wire.contracts import (
    ENGINE_PRIORITY,
    MAX_BEAT_INTERVAL_S,
    START_HOLD_S,
    Arrival,
    CancelRequest,
    ChunkKind,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
    WorkerHeartbeat,
    WorkerState,
)
from tollgate.wire.errors import error_json
from tollgate.wire.subjects import QUEUE_HEADER, Subjects
from tollgate.wire.topology import Topology

log = logging.getLogger("tollgate.worker")

# How many cancelled-before-start request ids a worker remembers.
_CANCELLED_KEPT = 10_000


# How long the router that holds a call has to acknowledge its END chunk.
END_ACK_TIMEOUT_S = 3.0
# How long a drain waits for final reports at least, however long the
# in-flight requests took.
REPORTS_WAIT_S = END_ACK_TIMEOUT_S + 5
# A final report nobody listens for is sent again every END_RESEND_EVERY_S for
# END_RESEND_FOR_S before it is kept in the orphans bucket (the router waits at
# least this long for a report after its client left: TOLLGATE_ROUTER_LATE_USAGE_WAIT_S).
END_RESEND_EVERY_S = 0.25
END_RESEND_FOR_S = 2.0
# How long a final report no router acknowledged is offered to the orphans
# bucket while NATS cannot take it (a restart), the wait doubling up to 5 s.
ORPHAN_RETRY_S = 120.0


class ClaimLost(Exception):
    """An offer claimed ahead turned out to be another worker's: nothing of it is sent."""


def _won(claim: asyncio.Future[bool]) -> bool:
    """Whether a finished claim ahead made the request this worker's."""
    return not claim.cancelled() and claim.result()


class Delivery(StrEnum):
    """Where a request's final report went (the "report" of its "request done" log)."""

    ACKNOWLEDGED = "acknowledged"  # the router holding the call has it
    KEPT = "kept"  # in the orphans bucket, for that router's next run
    LOST = "lost"  # not confirmed (NATS away past the retries, or the worker stopped first)


class _Reply:
    """Publishes one request's chunks in order.

    ``claim``: for a request claimed ahead (:attr:`Claimed.confirm`), whether
    it is this worker's; nothing is published before it says so, and every
    send raises :class:`ClaimLost` when it says no.
    """

    def __init__(
        self,
        nc: NATS,
        request: InferenceRequest,
        worker_id: str | None = None,
        claim: asyncio.Future[bool] | None = None,
    ) -> None:
        self.nc = nc
        self.request = request
        self.worker_id = worker_id
        self.seq = 0
        self.claim = claim

    async def claimed(self) -> None:
        """Wait until the request is this worker's; raise :class:`ClaimLost` if it is not."""
        if self.claim is not None:
            # shielded: a cancel of this request must not abandon the delete
            if not await asyncio.shield(self.claim):
                raise ClaimLost(self.request.request_id)
            self.claim = None

    def _chunk(self, kind: ChunkKind, **fields: object) -> bytes:
        if self.seq == 0 and self.worker_id is not None:
            # START, or the first chunk of a compact reply that had none
            fields.setdefault("worker_id", self.worker_id)
        chunk = ResponseChunk(
            request_id=self.request.request_id,
            seq=self.seq,
            kind=kind,
            **fields,
        )
        self.seq += 1
        return codec.encode(chunk)

    async def send(self, kind: ChunkKind, **fields: object) -> None:
        await self.claimed()
        await self.nc.publish(self.request.reply_to, self._chunk(kind, **fields))

    async def end(self, orphans: Callable[..., Awaitable[Any]], **fields: object) -> Delivery:
        """The final report, which the router that holds the call acknowledges.

        Without an acknowledgement (that router was killed, or cut off from
        the bus) the report is kept in the orphans bucket under the request
        id, where the router's next run finds it and bills the call.
        """
        await self.claimed()
        data = self._chunk(ChunkKind.END, **fields)
        # Sent again while nobody listens for a short while: after NATS comes
        # back, this worker may reconnect before the router has subscribed again.
        # Time cut off from NATS does not count (until the request's deadline,
        # when its router stops waiting): the report goes again once back.
        give_up = time.monotonic() + END_RESEND_FOR_S
        while not self.nc.is_closed:
            reconnects = self.nc.stats["reconnects"]
            if self.nc.is_connected:
                try:
                    await self.nc.request(self.request.reply_to, data, timeout=END_ACK_TIMEOUT_S)
                    return Delivery.ACKNOWLEDGED
                except NoRespondersError:
                    pass
                except TimeoutError:
                    if self.nc.is_connected and self.nc.stats["reconnects"] == reconnects:
                        break  # heard by nobody with the connection up all along
                except NatsError as exc:  # not sent (the connection went meanwhile)
                    log.warning("final report not sent: %s: %s", type(exc).__name__, exc)
            cut_off = not self.nc.is_connected or self.nc.stats["reconnects"] != reconnects
            if cut_off and time.time() < self.request.deadline:
                # the router may be reconnecting too: the wait for it to listen
                # again starts once this worker is back
                give_up = time.monotonic() + END_RESEND_FOR_S
            if time.monotonic() >= give_up:
                break
            await asyncio.sleep(END_RESEND_EVERY_S)  # a back-off between tries
        if self.nc.is_closed:
            log.error("final report lost: the connection to NATS is closed")
            return Delivery.LOST
        kept = await keep_orphan(orphans, self.request.request_id, data, ORPHAN_RETRY_S)
        return Delivery.KEPT if kept else Delivery.LOST


async def keep_orphan(
    orphans: Callable[..., Awaitable[Any]],
    request_id: str,
    data: bytes,
    retry_s: float = ORPHAN_RETRY_S,
) -> bool:
    """Put a final report in the orphans bucket, retrying while NATS cannot take it.

    The router that held the call died, or NATS went down with it (a whole
    host restarting): the router's next run bills the call from this report
    once it is there, so a failed put is tried again, with the bucket opened
    anew (a restarted server may have lost it), for ``retry_s``. True once kept.
    """
    give_up = time.monotonic() + retry_s
    wait = 0.5
    fresh = False
    while True:
        try:
            kv = await orphans(fresh)
            await kv.put(request_id, data)
        except Exception as exc:
            if time.monotonic() + wait > give_up:
                log.error("final report lost: %s: %s", type(exc).__name__, exc)
                return False
            log.warning("final report not kept yet, retrying: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(wait)  # a back-off between tries, not a wait for an event
            wait, fresh = min(wait * 2, 5.0), True
            continue
        log.warning("no router took the final report; kept for its next run")
        return True


def _no_adapter_files(adapter: AdapterEntry) -> Path:
    raise LookupError(f"no adapter files for {adapter.id}")


class WorkerConsumer:
    def __init__(
        self,
        nc: NATS,
        engine: Engine,
        settings: WorkerSettings,
        subjects: Subjects,
        model_id: str,
        metrics: WorkerMetrics | None = None,
    ) -> None:
        self.nc = nc
        self.metrics = metrics
        self.js: JetStreamContext = nc.jetstream()
        self.engine = engine
        self.adapters = Adapters(model_id, [], _no_adapter_files)  # the app sets the catalog's
        self.settings = settings
        self.subjects = subjects
        self.topology = Topology(subjects)
        self._orphan_kv: Any = None
        self.model_id = model_id
        self.state = WorkerState.STARTING
        self.startup_s: float | None = None  # process start to ready, set once ready
        # its parts: process (interpreter, imports), fetch and convert (weights),
        # engine (load), warmup (a first short request)
        self.startup_parts: dict[str, float] = {}
        self.inflight: dict[str, asyncio.Task[None]] = {}
        # each running request's attempt and its claim ahead (None: claimed already)
        self._runs: dict[str, tuple[int, asyncio.Future[bool] | None]] = {}
        # The tasks of requests still in the engine: only these may be cancelled,
        # so a late cancel cannot cut off the final chunk that carries the usage
        # (tasks, not ids: an older copy of a request, still stopping, leaves
        # the newer one cancellable).
        self._generating: set[asyncio.Task[Any]] = set()
        # Final reports waiting for the router's acknowledgement: the request's
        # slot is free meanwhile, and a drain waits for them.
        self._reporting: set[asyncio.Task[Any]] = set()
        # Ids cancelled while not running here, newest last (bounded).
        self._cancelled: dict[str, float] = {}
        self._slot_freed = asyncio.Event()
        self._arrival = asyncio.Event()
        self._parked = False  # the pull loop sleeps until an arrival
        # subscribed to its offers (and under fair share, which uses them): its beats say so
        self._takes_offers = False
        self.claims = WorkClaims(
            nc,
            subjects,
            model_id,
            settings.worker_id,
            fair=settings.fair_share,
            spill_after_s=settings.spill_after_s,
        )
        self.started_at = time.time()  # the process start, when the app knows it
        self.tokens_total = 0  # prompt + completion tokens of the requests it has finished
        # Set while the engine's start holds the event loop: the beat sent before
        # says the next one may be this late, so routers keep holding calls for it.
        self.silent_for_s: float | None = None
        self._stopping = asyncio.Event()
        self.drained = asyncio.Event()  # set once a drain has finished every request
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def worker_id(self) -> str:
        return self.settings.worker_id

    # -- lifecycle ---------------------------------------------------------

    async def announce(self) -> None:
        """Start heartbeats (state ``starting``) while the engine loads."""
        await self.nc.subscribe(self.subjects.drain(self.worker_id), cb=self._on_drain)
        self._tasks.append(asyncio.create_task(self._heartbeat_loop(), name="heartbeat"))
        await self._send_heartbeat()

    async def start(self) -> None:
        """Subscribe to cancels and start the pull loop: the worker is ready."""
        await self.nc.subscribe(self.subjects.cancel_all, cb=self._on_cancel)
        self.state = WorkerState.READY
        await self._send_heartbeat()
        self._start_pulling()
        log.info(
            "worker ready",
            extra={
                "worker_id": self.worker_id,
                "model": self.model_id,
                "startup_s": self.startup_s,
                "startup_parts": self.startup_parts,
            },
        )

    async def drain(self) -> None:
        """Stop fetching, let in-flight requests finish (bounded), then stop beating.

        The final reports still on their way are waited for as well, until
        the drain's time (``drain_timeout_s``) is spent, and at least
        :data:`REPORTS_WAIT_S`: a report retrying while NATS is away (a
        restart as the worker is scaled down) is how its call is billed.
        """
        if self.state is WorkerState.DRAINING:
            return
        give_up = time.monotonic() + self.settings.drain_timeout_s
        self.state = WorkerState.DRAINING
        self._stopping.set()
        await self._send_heartbeat()
        log.info("draining", extra={"inflight": len(self.inflight)})
        # The pull loop first: it sees _stopping within a second, and a request
        # it has just claimed joins the in-flight ones below.
        pulls = [t for t in self._tasks if t.get_name() == "pull"]
        if pulls:
            await asyncio.wait(pulls, timeout=10)
        if self.inflight:
            _, pending = await asyncio.wait(
                list(self.inflight.values()), timeout=self.settings.drain_timeout_s
            )
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
        if self._reporting:
            wait = max(REPORTS_WAIT_S, give_up - time.monotonic())
            _, unsent = await asyncio.wait(list(self._reporting), timeout=wait)
            if unsent:
                log.error("stopping with %d final report(s) unsent", len(unsent))
        self.drained.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.state = WorkerState.STOPPED
        await self._send_heartbeat()

    @property
    def stopped(self) -> asyncio.Event:
        return self._stopping

    # -- heartbeats --------------------------------------------------------

    def heartbeat(self) -> WorkerHeartbeat:
        """This worker's state and load now: what it beats, and what its /metrics show."""
        stats = self.engine.stats()
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            model=self.model_id,
            engine=self.engine.name,
            state=self.state,
            slots_used=len(self.inflight),
            slots_total=self.engine.slots_total,
            queue=stats.waiting,
            kv_cache_usage=stats.kv_cache_usage,
            interval_s=max(self.settings.heartbeat_interval_s, self.silent_for_s or 0.0),
            sent_at=time.time(),
            startup_s=self.startup_s,
            startup_parts=self.startup_parts or None,
            started_at=self.started_at,
            prefix_cache_queries=stats.prefix_cache_queries,
            prefix_cache_hits=stats.prefix_cache_hits,
            prefix_cache_hit_rate=stats.prefix_cache_hit_rate,
            tokens_total=self.tokens_total,
            takes_queued=self._takes_offers,
        )

    async def fall_silent(self, seconds: float) -> None:
        """Say that the next beat may come ``seconds`` late (until ``silent_for_s`` is reset)."""
        self.silent_for_s = min(seconds, MAX_BEAT_INTERVAL_S)
        await self._send_heartbeat()
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=2)  # out before the event loop stops

    async def _send_heartbeat(self) -> None:
        beat = self.heartbeat()
        with contextlib.suppress(Exception):  # a beat lost to a reconnect is not fatal
            await self.nc.publish(self.subjects.heartbeat(self.model_id), codec.encode(beat))

    async def _heartbeat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            await self._send_heartbeat()

    # -- control -----------------------------------------------------------

    async def _on_cancel(self, msg: Msg) -> None:
        try:
            cancel = codec.decode(CancelRequest, msg.data)
        except Exception:
            log.warning("malformed cancel message ignored")
            return
        task = self.inflight.get(cancel.request_id)
        if task is not None and task in self._generating:
            log.info("cancel", extra={"request_id": cancel.request_id, "reason": cancel.reason})
            task.cancel()
            return
        # Remembered, so that nothing runs it for nobody: perhaps still in the
        # queue (its client left while it waited), or its task has not run yet
        # (the cancel was read in the same turn as the request) and looks here
        # as it starts; a task already reporting has nothing left to stop.
        self._cancelled[cancel.request_id] = time.monotonic()
        while len(self._cancelled) > _CANCELLED_KEPT:
            del self._cancelled[next(iter(self._cancelled))]

    async def _on_drain(self, msg: Msg) -> None:
        log.info("drain requested over NATS")
        self._stopping.set()

    # -- the pull loop -----------------------------------------------------

    def _on_arrival(self, msg: Msg) -> None:
        try:
            lane = codec.decode(Arrival, msg.data).lane
        except Exception:
            lane = None
        self.claims.arrived(lane)
        self._arrival.set()

    def _on_offer(self, msg: Msg) -> None:
        """The queue's copy of a request it stored in one of this worker's direct lanes."""
        headers = dict(msg.headers or {})
        lane = headers.pop("Nats-Subject", "")
        queue = headers.pop(QUEUE_HEADER, None)
        for name in ("Nats-Stream", "Nats-Time-Stamp", "Nats-Last-Sequence"):
            headers.pop(name, None)
        try:
            seq = int(headers.pop("Nats-Sequence", ""))
        except ValueError:
            log.warning("offer without a sequence ignored")
            return
        if self.claims.offered(lane, seq, msg.data, headers, queue) and self._start_offered():
            return
        self._arrival.set()

    def _start_offered(self) -> bool:
        """Start an offer as it is read, when the pull loop sleeps with a slot free.

        The pull loop would take the same request once it wakes
        (:meth:`WorkClaims.take_offered` is what its take returns first);
        taken here, it starts one turn of the event loop sooner. False: the
        pull loop decides.
        """
        if (
            not self._parked
            or self._stopping.is_set()
            or len(self.inflight) >= self.engine.slots_total
        ):
            return False
        claimed = self.claims.take_offered()
        if claimed is None:
            return False
        self._count_claim(claimed)
        self._accept(claimed)
        return True

    def _start_pulling(self) -> None:
        task = asyncio.create_task(self._pull_loop(), name="pull")
        self._tasks.append(task)
        task.add_done_callback(self._pull_ended)

    def _pull_ended(self, task: asyncio.Task[None]) -> None:
        """A pull loop that failed is started again: the worker must not beat on idle."""
        if task.cancelled() or self._stopping.is_set() or task.exception() is None:
            return
        log.error("the pull loop failed; starting it again", exc_info=task.exception())
        self._tasks.remove(task)
        asyncio.get_running_loop().call_later(1.0, self._start_pulling)

    async def _pull_loop(self) -> None:
        """Take a request whenever a slot is free (see :mod:`services.worker.claims`)."""
        sub = await subscribe_at_once(
            self.nc, self.subjects.arrivals(self.model_id), self._on_arrival
        )
        subscriptions = [sub]
        try:
            if self.claims.fair:  # first come, first served claims by reading only
                subscriptions.append(
                    await subscribe_at_once(
                        self.nc, self.subjects.offer(self.model_id, self.worker_id), self._on_offer
                    )
                )
                # the server has the subscription before beats say so
                await self._subscribed()
            self._takes_offers = self.claims.fair
            await self._pull()
        finally:
            self._takes_offers = False
            for subscription in subscriptions:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
        log.info("stopped taking requests")

    async def _subscribed(self) -> None:
        """Wait until the server has this connection's subscriptions, however long NATS
        takes to answer (a flush that times out is tried again)."""
        while not self._stopping.is_set():
            try:
                await self.nc.flush()
                return
            except NatsError as exc:
                log.warning("NATS has not confirmed the subscriptions yet: %s", type(exc).__name__)
                await asyncio.sleep(1.0)  # a back-off between tries

    async def _pull(self) -> None:
        while not self._stopping.is_set():
            if len(self.inflight) >= self.engine.slots_total:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._slot_freed.wait()
                continue
            self._arrival.clear()
            try:
                claimed = await self.claims.take()
            except Exception as exc:  # NATS reconnecting, or the queue gone with a restart
                log.warning("taking a request failed: %s: %s", type(exc).__name__, exc)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5):
                        await self._stopping.wait()
                continue
            if claimed is None and self.claims.contended:
                continue  # other workers won every race: requests still wait
            if claimed is None:
                # Nothing this worker may take: sleep until a router announces a
                # request (or a second passes: an announcement can be lost), or
                # until a request in another worker's direct lane spills.
                ripe_in = self.claims.ripe_in()
                self._parked = True  # offers may start meanwhile (_start_offered)
                try:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(1.0 if ripe_in is None else min(1.0, ripe_in)):
                            await self._arrival.wait()
                finally:
                    self._parked = False
                continue
            self._count_claim(claimed)
            self._accept(claimed)

    def _count_claim(self, claimed: Claimed) -> None:
        if self.metrics is None:
            return
        counter = self.metrics.claims.labels(self.model_id, claimed.source)
        if claimed.confirm is None:
            counter.inc()
        else:  # claimed ahead: counted once it is this worker's
            claimed.confirm.add_done_callback(lambda done: counter.inc() if _won(done) else None)

    def _accept(self, claimed: Claimed) -> None:
        try:
            request = codec.decode(InferenceRequest, claimed.data)
        except Exception:
            log.error("malformed inference request dropped", extra={"subject": claimed.subject})
            return
        self.claims.share.learn(claimed.subject, request.tenant_weight, request.key_weight)
        claim = claimed.confirm
        if self._runs_already(request, claim):
            log.info("already running here", extra={"request_id": request.request_id})
            return
        if self._cancelled.pop(request.request_id, None) is not None:
            log.info("cancelled before start", extra={"request_id": request.request_id})
            self._answer_now(request, Outcome.CANCELLED, claim)
            return
        if time.time() > request.start_by:
            log.info("expired before start", extra={"request_id": request.request_id})
            self._answer_now(request, Outcome.EXPIRED, claim)
            return
        task = asyncio.create_task(
            self._traced(request, claimed.headers, claim), name=request.request_id
        )
        self.inflight[request.request_id] = task
        self._runs[request.request_id] = (request.attempt, claim)
        task.add_done_callback(lambda done: self._release(request.request_id, done))
        if claim is not None:
            # another worker's after all: stop the work started for it, and wake a
            # pull loop asleep meanwhile (the queue is read again before the next take)
            claim.add_done_callback(lambda done: None if _won(done) else self._claim_lost(task))

    def _runs_already(self, request: InferenceRequest, claim: asyncio.Future[bool] | None) -> bool:
        """Whether this copy of a request is dropped for the one already running here.

        A copy comes again when its offer is delivered twice, when this
        worker reads the request while its claim ahead is on its way, or when
        the router queued it again as a new attempt (its worker seemed lost).
        A newer attempt replaces the running one, which is stopped: its router
        reads only the newer one's replies. Of two copies of the same attempt
        the one whose claim is this worker's runs: the running one, unless
        its claim ahead is lost or still on its way while the new copy is
        claimed already.
        """
        running = self.inflight.get(request.request_id)
        if running is None:
            return False
        attempt, ahead = self._runs[request.request_id]
        if request.attempt != attempt:
            if request.attempt < attempt:
                return True
            running.cancel()
            return False
        if ahead is None or (ahead.done() and _won(ahead)):
            return True  # the running copy is this worker's
        if ahead.done():
            return False  # its claim was lost: it is being stopped
        return claim is not None  # both ahead: the first delete sent decides

    def _claim_lost(self, task: asyncio.Task[None]) -> None:
        """An offer claimed ahead was another worker's: stop its task, wake the pull loop."""
        task.cancel()
        self._arrival.set()

    def _answer_now(
        self, request: InferenceRequest, outcome: Outcome, claim: asyncio.Future[bool] | None
    ) -> None:
        """End a request that will not run (cancelled or expired before it started)."""

        async def answer() -> None:
            with contextlib.suppress(ClaimLost):  # another worker's: it answers
                await _Reply(self.nc, request, claim=claim).send(
                    ChunkKind.END, outcome=outcome, usage=Usage()
                )

        task = asyncio.create_task(answer())
        self._reporting.add(task)
        task.add_done_callback(self._reporting.discard)

    def _release(self, request_id: str, task: asyncio.Task[None]) -> None:
        if self.inflight.get(request_id) is task:  # not a later claim of the same request
            del self.inflight[request_id]
            del self._runs[request_id]
        self._slot_freed.set()

    async def _orphans(self, fresh: bool = False) -> Any:
        """The orphans bucket (created on first need, or again when ``fresh``)."""
        if self._orphan_kv is None or fresh:
            self._orphan_kv = await self.topology.bucket(self.js, self.topology.orphans)
        return self._orphan_kv

    # -- one request -------------------------------------------------------

    async def _traced(
        self,
        request: InferenceRequest,
        headers: dict[str, str],
        claim: asyncio.Future[bool] | None = None,
    ) -> None:
        """Serve in a span that continues the router's trace (when tracing is on)."""
        attributes = {
            "tollgate.request_id": request.request_id,
            "gen_ai.request.model": request.model,
            "tollgate.worker_id": self.worker_id,
        }
        with tracing.span("worker.serve", attributes, parent=headers):
            try:
                await self._serve(request, claim)
            except ClaimLost:
                # claimed ahead, and another worker had it: it runs there, and
                # nothing of it was sent or counted here
                log.info("offer taken elsewhere", extra={"request_id": request.request_id})

    async def _serve(
        self, request: InferenceRequest, claim: asyncio.Future[bool] | None = None
    ) -> None:
        request_id_var.set(request.request_id)
        tally = TokenTally()
        current_tally.set(tally)
        reply = _Reply(self.nc, request, self.worker_id, claim)
        started = time.monotonic()
        this = asyncio.current_task()
        if this is not None:
            self._generating.add(this)
        outcome = Outcome.COMPLETED
        usage: Usage | None = None
        finish: str | None = None
        # A compact reply (non-stream, and the router reads it): START only if
        # the engine has not answered within START_HOLD_S, the body on END.
        compact = request.compact_reply and not request.body.get("stream")
        body_on_end: str | None = None
        try:
            if self._cancelled.pop(request.request_id, None) is not None:
                log.info("cancelled before start", extra={"request_id": request.request_id})
                raise asyncio.CancelledError  # ends as a cancel would: reported, nothing run
            if not compact:
                await reply.send(ChunkKind.START)
            timeout = max(0.0, request.deadline - time.time())
            async with asyncio.timeout(timeout):
                # The class reaches the engine as its own request priority,
                # whatever priority the client put in the body.
                body = {**request.body, "priority": ENGINE_PRIORITY[request.priority]}
                if compact and reply.claim is not None and not reply.claim.done():
                    # One turn of the loop first, so the delete that claims the
                    # request leaves now: an engine may work a while before it
                    # first yields, and the reply waits for the delete's answer.
                    await asyncio.sleep(0)
                running = self._run(request, body)
                result = await (self._started(reply, running) if compact else running)
                if isinstance(result, ErrorResult):
                    outcome = Outcome.ERROR
                    await reply.send(ChunkKind.ERROR, data=result.body, status=result.status)
                elif isinstance(result, FullResult):
                    usage, finish = result.usage, result.finish_reason
                    if compact:
                        body_on_end = result.body
                    else:
                        await reply.send(ChunkKind.DATA, data=result.body)
                else:
                    await self._relay_stream(reply, result, tally)
                    usage, finish = result.usage, result.finish_reason
        except (asyncio.CancelledError, TimeoutError):
            outcome = Outcome.CANCELLED
        except ClaimLost:
            raise
        except NatsError as exc:
            # A chunk could not be sent (NATS away long enough to fill the
            # client's buffer, or the connection closed): the engine's work is
            # stopped, and the final report below still tells what it generated.
            log.warning("reply not sent: %s: %s", type(exc).__name__, exc)
            outcome = Outcome.ERROR
        except Exception:
            log.exception("engine failure")
            outcome = Outcome.ERROR
            failure = error_json(
                "The engine failed while serving the request.", "InternalServerError", code=500
            ).decode()
            try:
                await reply.send(ChunkKind.ERROR, data=failure, status=500)
            except NatsError as exc:
                log.warning("error response not sent: %s: %s", type(exc).__name__, exc)
        finally:
            self._generating.discard(this)
        # Nothing is counted or reported for a request claimed ahead until it
        # is this worker's (ClaimLost otherwise).
        await reply.claimed()
        if usage is None:
            usage = tally.usage()
        self.tokens_total += usage.prompt_tokens + usage.completion_tokens
        # Counted first: the router has answered the client once it has the
        # END, before its acknowledgement comes back.
        if self.metrics is not None:
            self.metrics.requests.labels(self.model_id, outcome.value).inc()
            self.metrics.tokens.labels(self.model_id, "prompt").inc(usage.prompt_tokens)
            self.metrics.tokens.labels(self.model_id, "completion").inc(usage.completion_tokens)
        done = {
            "outcome": outcome.value,
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "seconds": round(time.monotonic() - started, 4),
        }

        async def report_then_log() -> None:
            # Logged once the report is answered, kept or given up: not on the
            # call's path. The log says where the report went. One "lost" was
            # neither acknowledged nor kept: its router bills what it relayed
            # (zero for a call it lost too), unless the report reached it and
            # only the acknowledgement was lost.
            delivery = Delivery.LOST
            try:
                delivery = await reply.end(
                    self._orphans,
                    usage=usage,
                    outcome=outcome,
                    finish_reason=finish,
                    worker_id=self.worker_id,
                    data=body_on_end,
                )
            except asyncio.CancelledError:
                log.error("final report lost: the worker stopped before it was delivered or kept")
                raise
            finally:
                log.info("request done", extra={**done, "report": delivery.value})

        report = asyncio.create_task(report_then_log())
        self._reporting.add(report)
        report.add_done_callback(self._reporting.discard)

    async def _run(self, request: InferenceRequest, body: dict[str, Any]) -> EngineResult:
        """Run the call on the engine; an adapter it names is loaded first, if need be."""
        if request.adapter is not None:
            refused = await self.adapters.ready(request.adapter, self.engine.load_adapter)
            if refused is not None:
                return refused
            body["model"] = request.adapter  # the engine knows it by its id, not an alias
        return await self.engine.run(request.endpoint, body, request.request_id)

    @staticmethod
    async def _started(reply: _Reply, running: Awaitable[EngineResult]) -> EngineResult:
        """The engine's result; the call's START goes out once START_HOLD_S passes without it.

        The engine runs in this task, START from a timer beside it; nothing
        else of the call is sent before START has gone out.
        """
        start: asyncio.Future[None] | None = None

        def due() -> None:
            nonlocal start
            start = asyncio.ensure_future(reply.send(ChunkKind.START))
            # retrieved here too: a call cancelled while it waits for START
            # (its claim lost) leaves the ClaimLost unawaited
            start.add_done_callback(lambda sent: sent.cancelled() or sent.exception())

        timer = asyncio.get_running_loop().call_later(START_HOLD_S, due)
        try:
            return await running
        finally:
            timer.cancel()
            if start is not None:
                await start

    async def _relay_stream(self, reply: _Reply, result: StreamResult, tally: TokenTally) -> None:
        events = result.events
        try:
            async for event in events:
                if event.is_usage:
                    await reply.send(ChunkKind.USAGE, data=event.text)
                else:
                    # The running count goes with each chunk: if this worker dies,
                    # the router bills what it relayed.
                    await reply.send(ChunkKind.DATA, data=event.text, usage=tally.usage())
        finally:
            aclose = getattr(events, "aclose", None)
            if aclose is not None:
                await aclose()
