"""Serving logic of the edge: validate, dispatch, and follow a call to its end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from services.router.affinity import Affinity, affinity_key
from services.router.auth import Principal
from services.router.capture import Capturer
from services.router.dispatch import Call, Dispatcher, QueueFull
from services.router.endpoints import SPECS, worst_case_tokens
from services.router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RateLimited,
    ServiceUnavailable,
    TollgateError,
    UsageUnrecorded,
    WorkerLost,
)
from services.router.lifecycle import KEEPALIVE, CallLife, Ending, Keepalive
from services.router.limits import Change, Limiter, journaled
from services.router.metrics import RouterMetrics
from services.router.overload import DrainMeter, hold_until
from services.router.protocol import normalise
from services.router.settings import RouterSettings
from services.router.settlement import Settler
from services.router.usage import UsagePublisher
from tollgate.models.catalog import AdapterEntry, Catalog, ModelEntry, Target
from tollgate.runtime import tracing
from tollgate.runtime.jsonbody import dotted, integer_beyond_64_bits, integer_message
from tollgate.runtime.workers import WorkerView
from tollgate.wire.contracts import (
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    Priority,
    ResponseChunk,
    Usage,
    UsageEvent,
    WorkerState,
)

log = logging.getLogger("tollgate.router")


# How deep JSON values may nest in a body. The bus carries the body inside the
# request's envelope, and the encoder stops at 255 levels; no OpenAI request
# needs more than a few dozen (a tool's JSON schema).
MAX_JSON_DEPTH = 128


def _check_depth(raw: bytes, body: dict[str, Any]) -> None:
    """Refuse a body nested deeper than :data:`MAX_JSON_DEPTH`.

    Counting brackets in the raw bytes (fast, in C) rules out almost every
    body; only one with that many brackets is walked.
    """
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH:
        return
    stack: list[tuple[Any, int]] = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(
                f"The request body nests JSON values more than {MAX_JSON_DEPTH} levels deep."
            )
        children = value.values() if isinstance(value, dict) else value
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))


@dataclass(frozen=True)
class Prepared:
    endpoint: Endpoint
    entry: ModelEntry  # the model whose workers run it
    body: dict[str, Any]
    stream: bool
    wants_usage: bool
    adapter: AdapterEntry | None = None  # the LoRA adapter the call names, if any

    @property
    def target(self) -> Target:
        return Target(self.entry, self.adapter)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple[int | str, ...]) -> str:
    """The client-facing path of a pydantic error location.

    Pydantic adds a tag per union member (``str``, ``list[int]``,
    ``constrained-str``); a client only knows field names and indexes.
    """
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p not in _TYPE_TAGS and not any(c in p for c in "[-"))
    ]
    return ".".join(parts)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    loc = _param_path(error["loc"])
    if error["type"] == "missing":
        return f"Missing required parameter: '{loc}'.", loc or None
    return f"Invalid value for '{loc}': {error['msg']}.", loc or None


# How an error names a model of each task.
_TASK_NAMES = {"generate": "a generative model", "embed": "an embedding model"}


def _task_paths(task: str) -> list[str]:
    return [spec.path for spec in SPECS.values() if task in spec.tasks]


class OpenAIServing:
    def __init__(
        self,
        catalog: Catalog,
        dispatcher: Dispatcher,
        workers: WorkerView,
        settings: RouterSettings,
        limiter: Limiter | None = None,
        usage: UsagePublisher | None = None,
        metrics: RouterMetrics | None = None,
        capturer: Capturer | None = None,
        settler: Settler | None = None,
    ) -> None:
        self.catalog = catalog
        self.capturer = capturer
        self.dispatcher = dispatcher
        self.workers = workers
        self.settings = settings
        if limiter is not None and settler is None:
            raise ValueError("a limiter's reservations need a settler")
        self.limiter = limiter
        self.settler = settler
        self.usage = usage
        self.metrics = metrics
        self._finishing: set[asyncio.Task[None]] = set()
        self._draining = False  # set by drain: late reports are no longer waited for
        self.drain_meter = DrainMeter()
        self.affinity = Affinity(
            workers,
            enabled=settings.affinity == "prefix",
            load=settings.affinity_load,
            busy=dispatcher.busy,
        )
        self._ready_s: dict[str, float] = {}  # model -> latest measured time to ready

    def parse(self, endpoint: Endpoint, raw: bytes) -> Prepared:
        """Check what the edge must check; raise an :class:`InvalidRequest` otherwise.

        Every number is checked here, before any reservation: a request that
        passes cannot fail later for its shape.
        """
        # orjson would round an integer beyond 64 bits to a float, or refuse it as invalid JSON
        if (where := integer_beyond_64_bits(raw)) is not None:
            raise InvalidRequest(integer_message(where), param=dotted(where))
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequest(
                "We could not parse the JSON body of your request. The body must be valid JSON."
            ) from None
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        _check_depth(raw, body)
        spec = SPECS[endpoint]
        try:
            checked = spec.body_model.model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise InvalidRequest(message, param=param) from None
        if (problem := checked.problem()) is not None:
            raise InvalidRequest(problem[0], param=problem[1])
        normalise(checked, body)
        target = self.catalog.target(checked.model)
        if target is None:
            raise ModelNotFound(checked.model)
        entry = target.entry
        if entry.task not in spec.tasks:
            raise InvalidRequest(
                f"`{checked.model}` is {_TASK_NAMES[entry.task]}: it does not serve "
                f"{endpoint.path} (its endpoints: {', '.join(_task_paths(entry.task))}).",
                param="model",
                code="model_not_supported",
            )
        spec.check(body, self.settings)
        limit = checked.token_limit
        if limit is not None and limit > entry.max_model_len:
            param = checked.token_limit_param
            raise InvalidRequest(
                f"{param}={limit} is larger than the context of `{entry.id}` "
                f"({entry.max_model_len} tokens).",
                param=param,
            )
        return Prepared(
            endpoint, entry, body, bool(checked.stream), checked.wants_usage, target.adapter
        )

    async def submit(
        self,
        prepared: Prepared,
        request_id: str,
        principal: Principal | None,
        capture: bool = True,
        priority: Priority = Priority.INTERACTIVE,
        session: str | None = None,
    ) -> Call:
        """Check the model's queue has room, reserve the key's limits, then queue the request.

        ``session`` (the ``X-Tollgate-Session`` header) keeps a conversation on
        one worker (:mod:`services.router.affinity`).
        """
        await self._check_room(prepared.entry.id)
        reservation = None
        if principal is not None and self.limiter is not None and principal.limited:
            try:
                billed = prepared.target.billed
                reservation = await self.limiter.reserve(
                    principal.record,
                    worst_case_tokens(
                        prepared.endpoint, prepared.body, prepared.entry.max_model_len
                    ),
                    principal.tenant_record,
                    self.catalog.price_at(billed, time.time()) if principal.priced else None,
                    billed,
                )
            except RateLimited as exc:
                if "Retry-After" not in exc.headers:  # the key's concurrent requests
                    fallback = self.settings.retry_after_s
                    wait = self.drain_meter.slot_retry_after(prepared.entry.id, fallback)
                    exc.headers["Retry-After"] = str(wait)
                raise
            except TollgateError:
                raise
            except Exception as exc:  # the limits cannot be checked: refuse, never guess
                log.warning("limits unavailable: %s: %s", type(exc).__name__, str(exc))
                raise ServiceUnavailable(
                    "This key's limits cannot be checked right now. Please retry.",
                    code="limits_unavailable",
                    headers={"Retry-After": str(self.settings.retry_after_s)},
                ) from None
        try:
            call = await self._dispatch(prepared, request_id, principal, priority, session)
        except BaseException as exc:
            settlement: list[Change] = []
            if reservation is not None and self.settler is not None:
                settlement = self.settler.plan(reservation, 0)
            if isinstance(exc, ServiceUnavailable):
                # Accepted but never queued: a zero-token row, so analysts see it.
                self._record(
                    UsageEvent(
                        request_id=request_id,
                        time=time.time(),
                        tenant=(principal.tenant if principal else None) or "anonymous",
                        key_id=principal.key_id if principal else None,
                        model=prepared.target.billed,
                        prompt_tokens=0,
                        completion_tokens=0,
                        outcome=Outcome.NOT_DISPATCHED,
                        streamed=prepared.stream,
                        endpoint=prepared.endpoint.value,
                        total_s=0.0,
                        http_status=exc.status,
                    ),
                    settlement=journaled(settlement),
                )
            if self.settler is not None:
                await self.settler.settle(request_id, settlement)
            raise
        call.reservation = reservation
        if self.usage is not None:
            held = reservation.held() if reservation is not None else None
            try:
                self.usage.opened(call.request, prepared.stream, held)
            except Exception as exc:
                # Queued already: its life stops it (events raises UsageUnrecorded),
                # takes it back or cancels it, and bills what a worker did of it.
                log.error(
                    "a call could not be journaled; stopping it: %s: %s",
                    type(exc).__name__,
                    str(exc),
                )
                call.unjournaled = True
        if capture and self.capturer is not None:
            tenant = (principal.tenant if principal else None) or "anonymous"
            if self.capturer.wanted(principal.record if principal else None, tenant):
                call.captured = []
        return call

    async def _check_room(self, model: str) -> None:
        """Refuse at once (503, Retry-After) when the model's queue is at its pending limit.

        The counts kept (read at most every half second) are read afresh
        before a refusal: until a call's START reaches this router, which may
        come up to START_HOLD_S after a worker took it, the call still counts
        as waiting here while the worker's heartbeat already counts its slot.
        """
        limit = self.settings.max_queued_per_model
        # What the model's free slots take at once does not wait: a burst into
        # an idle model is not refused (slots as last heard in heartbeats).
        free = sum(
            max(0, beat.slots_total - beat.slots_used)
            for beat in self.workers.live(model)
            if beat.state is WorkerState.READY
        )
        try:
            waiting = await self.dispatcher.waiting(model)
            if waiting - free >= limit:
                waiting = await self.dispatcher.waiting(model, max_age_s=0)
        except Exception as exc:  # the queue's own limits still hold
            log.debug("queue depth unknown: %s: %s", type(exc).__name__, str(exc))
            return
        if waiting - free >= limit:
            raise self._overloaded(model, waiting - free - limit + 1)

    def _overloaded(self, model: str, excess: int) -> Overloaded:
        wait = self.drain_meter.queue_retry_after(model, excess, self.settings.retry_after_s)
        return Overloaded(
            f"`{model}` has more requests waiting than it can take now. Please retry in {wait} s.",
            headers={"Retry-After": str(wait)},
        )

    async def _dispatch(
        self,
        prepared: Prepared,
        request_id: str,
        principal: Principal | None,
        priority: Priority = Priority.INTERACTIVE,
        session: str | None = None,
    ) -> Call:
        now = time.time()
        tenant = principal.tenant if principal else None
        key_weight = principal.record.weight if principal else 1.0
        request = InferenceRequest(
            request_id=request_id,
            model=prepared.entry.id,
            adapter=prepared.adapter.id if prepared.adapter is not None else None,
            endpoint=prepared.endpoint,
            body=prepared.body,
            reply_to=self.dispatcher.reply_subject(request_id),
            enqueued_at=now,
            # The router withdraws the request when it stops waiting (queue
            # timeout, or a cold start that took too long); until then a
            # worker may start it.
            start_by=now + self.settings.request_timeout_s,
            deadline=now + self.settings.request_timeout_s,
            tenant=tenant,
            key_id=principal.key_id if principal else None,
            priority=priority,
            tenant_weight=self.settings.tenant_weights.get(tenant or "anonymous", 1.0),
            key_weight=key_weight,
            compact_reply=True,
        )
        key = affinity_key(
            prepared.endpoint, prepared.body, session, self.settings.affinity_prefix_chars
        )
        worker_id, decision = self.affinity.choose(prepared.entry.id, key)
        if self.metrics is not None:
            self.metrics.affinity.labels(prepared.entry.id, decision).inc()
        try:
            return await self.dispatcher.submit(request, worker_id, self._takes_offers(worker_id))
        except TollgateError:
            raise
        except QueueFull:
            raise self._overloaded(prepared.entry.id, 1) from None
        except Exception as exc:
            # str(exc): a log record kept by a handler must not hold the call's frames
            log.warning("dispatch failed: %s: %s", type(exc).__name__, str(exc))
            raise self._unavailable("The model's queue cannot be reached. Please retry.") from None

    def _takes_offers(self, worker_id: str | None) -> bool:
        """Whether the worker chosen for a direct request claims the queue's copies (its beat)."""
        seen = self.workers.get(worker_id) if worker_id is not None else None
        return seen is not None and seen.beat.takes_queued

    def _unavailable(self, message: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            message, headers={"Retry-After": str(self.settings.retry_after_s)}
        )

    async def events(
        self, call: Call, prepared: Prepared
    ) -> AsyncIterator[ResponseChunk | Keepalive]:
        """The call's chunks in order, until END.

        Yields KEEPALIVE when a wait passes without a chunk (so the handler can
        send SSE comments and notice a client that went away). Raises a
        TollgateError when the queue timeout or the deadline passes, or when
        the worker running the call stops heartbeating.
        """
        if call.unjournaled:
            raise UsageUnrecorded(self.settings.retry_after_s)
        loop = asyncio.get_running_loop()
        started = loop.time()
        start_deadline = started + self.settings.queue_timeout_s
        deadline = started + self.settings.request_timeout_s
        tick = self.settings.first_byte_wait_s
        expected = 0
        held_since: float | None = None  # waiting for a starting worker since
        span = tracing.current_call()  # the call's span, when tracing is on
        model = prepared.entry.id
        while True:
            queue = call.queue  # a new one when the call is queued again
            if queue.empty():
                now = loop.time()
                if call.worker_id is None:
                    wait = min(tick, start_deadline - now)
                    if wait <= 0:
                        held = self._hold(prepared.entry, now, deadline)
                        if held is not None and held > start_deadline:
                            if held_since is None:
                                held_since = now
                                log.info(
                                    "waiting for a starting worker",
                                    extra={"model": model, "hold_s": round(held - now, 1)},
                                )
                            start_deadline = held
                            continue
                        waited = (
                            f"{self.settings.queue_timeout_s:g} s"
                            if held_since is None
                            else f"{now - started:.0f} s (a worker was starting)"
                        )
                        raise self._unavailable(
                            f"No worker for `{model}` became free within {waited}. Please retry."
                        )
                else:
                    wait = min(tick, self.workers.window(call.worker_id), deadline - now)
                    if wait <= 0:
                        raise DeadlineExceeded("The request took longer than its deadline.")
                try:
                    async with asyncio.timeout(wait):
                        chunk = await queue.get()
                except TimeoutError:
                    tick = self.settings.keepalive_interval_s
                    if call.worker_id is not None and not self.workers.alive(call.worker_id):
                        if await self._requeue(call):
                            expected = 0
                            continue
                        raise WorkerLost(
                            "The worker serving this request stopped responding."
                        ) from None
                    yield KEEPALIVE
                    continue
            else:
                chunk = queue.get_nowait()
            if chunk.seq != expected:
                # The worker is alive (a chunk was lost on the way): not queued again,
                # since cancelling its attempt would cancel the new one too. The
                # call is billed from the worker's final report (see finish): one
                # that came already is left for it.
                if chunk.kind is ChunkKind.END:
                    queue.put_nowait(chunk)
                raise WorkerLost("The response stream from the worker was interrupted.")
            expected += 1
            kind = chunk.kind
            if call.worker_id is None and chunk.worker_id is not None:
                # START, or a compact reply's first chunk (the call ended before
                # its START was due: see InferenceRequest.compact_reply)
                call.worker_id = chunk.worker_id
                call.started_at = time.monotonic()
                self.dispatcher.started(call)
                self.drain_meter.taken(model)
                if held_since is not None and self.metrics is not None:
                    self.metrics.cold_start_hold.labels(model).observe(loop.time() - held_since)
            if kind is ChunkKind.START:
                continue
            if kind is ChunkKind.END and chunk.data is not None:
                # a compact reply's body rides on its END: relayed as its DATA first
                body = ResponseChunk.model_construct(
                    request_id=chunk.request_id, seq=chunk.seq, kind=ChunkKind.DATA, data=chunk.data
                )
                self._relayed(call, prepared, span, body)
                yield body
                chunk.data = None
            if kind is ChunkKind.DATA:
                self._relayed(call, prepared, span, chunk)
            elif kind is ChunkKind.ERROR and span is not None:
                span.worker_error(chunk.data or "")
            if kind is ChunkKind.USAGE and not prepared.wants_usage:
                continue
            if kind is ChunkKind.END and chunk.outcome is Outcome.EXPIRED:
                raise self._unavailable("The request expired before a worker took it.")
            yield chunk
            if kind is ChunkKind.END:
                return

    @staticmethod
    def _relayed(
        call: Call, prepared: Prepared, span: tracing.InferenceSpan | None, chunk: ResponseChunk
    ) -> None:
        """Note a DATA chunk on its way to the client: first output, counts, capture, trace."""
        if call.first_output_at is None:
            call.first_output_at = time.monotonic()
        if chunk.usage is not None:
            call.delivered = chunk.usage
        if call.captured is not None and chunk.data is not None:
            call.captured.append(chunk.data)
        if span is not None and chunk.data is not None:
            if prepared.stream:
                span.response_event(chunk.data)
            else:
                span.response_body(chunk.data)

    def _hold(self, entry: ModelEntry, now: float, deadline: float) -> float | None:
        """Until when (loop time) a request may wait for the model's starting workers.

        None when no worker of the model is starting. Never past the request's deadline.
        """
        for beat in self.workers.live(entry.id):
            if beat.startup_s is not None:
                self._ready_s[entry.id] = beat.startup_s
        measured = self._ready_s.get(entry.id)
        expected = measured if measured is not None else entry.scaling.time_to_ready_s
        until = hold_until(self.workers.starting(entry.id), expected)
        if until is None:
            return None
        return min(deadline, now + (until - time.time()))

    async def _requeue(self, call: Call) -> bool:
        """Queue a call again once when its worker was lost before any output reached the client.

        Its heartbeats stopped and nothing was sent, so another worker can serve it
        as if the first had never taken it; it is billed once, when it ends
        (``attempts`` 2).
        """
        nc = self.dispatcher.nc
        if (
            call.first_output_at is not None
            or call.cancelled
            or call.request.attempt >= 1
            or call.worker_id is None
            # this router was cut off from NATS meanwhile: the worker may still
            # be running the call, and a second run would not be billed
            or not nc.is_connected
            or nc.stats["reconnects"] != call.reconnects
        ):
            return False
        lost = call.worker_id
        try:
            await self.dispatcher.requeue(call)
        except Exception as exc:
            log.warning("queueing again failed: %s: %s", type(exc).__name__, str(exc))
            return False
        log.warning("worker lost before any output; queued again", extra={"worker_id": lost})
        if self.metrics is not None:
            self.metrics.retries.labels(call.request.model).inc()
        return True

    def life(self, call: Call, prepared: Prepared) -> CallLife:
        """The owner of an accepted call until it ends (see lifecycle.py).

        It cancels the call once when it does not run to its end, and finishes
        it once (:meth:`finish`), whatever way the handler leaves.
        """
        return CallLife(
            call,
            events=lambda: self.events(call, prepared),
            cancel=self.dispatcher.cancel,
            finish=lambda ending: self._finish_later(call, prepared, ending),
        )

    def _finish_later(self, call: Call, prepared: Prepared, ending: Ending) -> None:
        """Finish the call after the response has gone out (never delays the client)."""
        # Called as the handler leaves the call's life, while its span is open.
        if (span := tracing.current_call()) is not None:
            _trace_ending(span, call, ending)
        task = asyncio.create_task(self.finish(call, prepared, ending))
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    async def drain(self, timeout: float = 10) -> None:
        """Let the calls still finishing record their usage (bounded).

        A call waiting for a late final report stops waiting after its
        current round and bills what it relayed: a stopping router must not
        leave its event unwritten.
        """
        self._draining = True
        if self._finishing:
            await asyncio.wait(self._finishing, timeout=timeout)

    async def finish(self, call: Call, prepared: Prepared, ending: Ending) -> None:
        """The call is over: emit its usage event and settle its reservation.

        When the call ended before the worker's final report (the client went
        away, the deadline passed, a chunk was lost on the way), the worker
        still reports the tokens it generated; wait for that report
        (:meth:`_late_end`) so billing stays exact. A worker that stopped
        beating is not waited for: its report is taken only if it came already.
        """
        end, outcome = ending.end, ending.outcome
        if end is None and call.worker_id is not None:
            if outcome is not Outcome.WORKER_LOST or self.workers.alive(call.worker_id):
                end = await self._late_end(call)
            else:
                end = _end_in_hand(call)
        elif end is None and call.seq is not None and not await self.dispatcher.withdraw(call):
            # A worker took it before its START reached this router (or the
            # queue could not say): its report comes on the cancel.
            end = await self._late_end(call)
        self.dispatcher.finish(call)
        if end is not None and end.usage is not None:
            usage = end.usage
        else:
            # No final report (the worker died, or the wait for it ended): bill what was relayed.
            usage = call.delivered or Usage()
        if outcome is None:
            outcome = end.outcome if end is not None and end.outcome else Outcome.LOST
        request = call.request
        now = time.monotonic()
        event = UsageEvent(
            request_id=request.request_id,
            time=time.time(),
            tenant=request.tenant or "anonymous",
            key_id=request.key_id,
            model=request.billed_model,
            worker_id=call.worker_id,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            outcome=outcome,
            finish_reason=end.finish_reason if end is not None else None,
            streamed=prepared.stream,
            queue_s=_since(call.submitted_at, call.started_at),
            ttft_s=_since(call.submitted_at, call.first_output_at),
            total_s=now - call.submitted_at,
            http_status=ending.status,
            attempts=request.attempt + 1,
            priority=request.priority,
            endpoint=prepared.endpoint.value,
        )
        if call.started_at is not None:
            self.drain_meter.served(request.model, now - call.started_at)
        # The event first, with what settles the reservation: settling waits on
        # the bus, and a shutdown that cuts this task short must cost neither.
        # Only once the event is in the outbox does the worker hear that its
        # final report is billed.
        settlement: list[Change] = []
        if call.reservation is not None and self.settler is not None:
            settlement = self.settler.plan(
                call.reservation, usage.total_tokens, usage.prompt_tokens
            )
        try:
            self._record(
                event,
                budget=call.reservation is not None and call.reservation.budget,
                settlement=journaled(settlement),
            )
        except Exception as exc:
            # The outbox cannot be written: the worker's report is not
            # acknowledged (it keeps it), and the event is logged, not lost silently.
            log.error(
                "usage event not journaled: %s: %s",
                type(exc).__name__,
                str(exc),
                extra={
                    "request_id": request.request_id,
                    **event.model_dump(mode="json", exclude={"type", "time"}),
                },
            )
            if self.settler is not None:
                await self.settler.settle(request.request_id, settlement)
            return
        await self.dispatcher.acknowledge_end(call)
        if call.captured is not None and self.capturer is not None:
            self.capturer.emit(
                event, prepared.endpoint, prepared.body, call.captured, event.finish_reason
            )
        if self.settler is not None:
            await self.settler.settle(request.request_id, settlement)
        log.info(
            "request done",
            extra={
                "request_id": request.request_id,
                **event.model_dump(mode="json", exclude={"type", "time"}),
            },
        )

    def _record(
        self, event: UsageEvent, budget: bool = False, settlement: Sequence[Change] = ()
    ) -> None:
        if self.usage is not None:
            self.usage.emit(event, budget, settlement)
        if self.metrics is not None:
            self.metrics.ended(event)

    async def _late_end(self, call: Call) -> ResponseChunk | None:
        """The worker's final report, after the client went away (None: it never came).

        The wait goes on, ``late_usage_wait_s`` at a time, while the worker
        running the call still beats: a loaded worker may answer the cancel
        late, and a report that came after the router stopped waiting would
        not be billed (the call would be billed only what was relayed). Time
        cut off from NATS does not count either: the cancel and the worker's
        report wait in the clients' buffers and go out once both reconnect,
        so a wait that saw the connection down or come back starts again.
        Either reason to wait on ends at the request's deadline (a call cut
        off by its deadline still gets one round), and neither holds once the
        router is stopping (:meth:`drain`).
        """
        nc = self.dispatcher.nc
        wait = self.settings.late_usage_wait_s
        give_up = time.monotonic() + max(0.0, call.request.deadline - time.time())
        while True:
            reconnects = nc.stats["reconnects"]
            try:
                async with asyncio.timeout(wait):
                    while True:
                        chunk = await call.queue.get()
                        if call.worker_id is None and chunk.worker_id is not None:
                            call.worker_id = chunk.worker_id  # its START came late
                        if chunk.kind is ChunkKind.END:
                            return chunk
            except TimeoutError:
                cut_off = not nc.is_connected or nc.stats["reconnects"] != reconnects
                running = call.worker_id is not None and self.workers.alive(call.worker_id)
                if (
                    wait <= 0  # configured not to wait
                    or self._draining
                    or not (cut_off or running)
                    or time.monotonic() >= give_up
                ):
                    return None


def _end_in_hand(call: Call) -> ResponseChunk | None:
    """The worker's final report if it is among the call's chunks already (no wait)."""
    while not call.queue.empty():
        chunk = call.queue.get_nowait()
        if chunk.kind is ChunkKind.END:
            return chunk
    return None


def _trace_ending(span: tracing.InferenceSpan, call: Call, ending: Ending) -> None:
    """The span's token counts and ending: the engine's counts as billed, or what was relayed.

    A call that did not complete names its outcome as its ``error.type``
    (``client_disconnected``, ``worker_lost``, ``deadline_exceeded``, ...),
    unless the engine's own error response named it first.
    """
    end = ending.end
    usage = end.usage if end is not None and end.usage is not None else call.delivered
    if usage is not None:
        span.usage(usage.prompt_tokens, usage.completion_tokens)
    outcome = ending.outcome or (end.outcome if end is not None else None)
    failed = None if outcome is None or outcome is Outcome.COMPLETED else outcome.value
    span.ended(ending.status, failed)


def _since(start: float, end: float | None) -> float | None:
    # Every timestamp of a call comes from time.monotonic(): the event loop's
    # clock (uvloop's is cached, in milliseconds) would make these negative.
    return None if end is None else end - start
