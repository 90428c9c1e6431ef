"""The life of a call, in process: exactly one usage event and one cancel, whatever the ending.

The router app runs in this process on an aiohttp runner configured as
deployed (a client that hangs up does not cancel its handler, unless a test
says so), against the session's real nats-server, under a subject prefix of
its own. :class:`ScriptedWorker` is a test double for a worker: it takes
requests from the model's work queue and answers each with the chunks the
test's script sends. Usage events and cancels are counted as the router
publishes them (a core subscription sees a duplicate that the usage stream's
dedupe would hide), once the router has stopped and so finished every call.
"""

from __future__ import annotations

import asyncio
import socket
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from services.router.app import DISPATCHER, create_app
from services.router.appkeys import METRICS, SERVING
from services.router.dispatch import Call
from services.router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
    TollgateError,
    WorkerLost,
    sse_error_event,
)
from services.router.lifecycle import (
    KEEPALIVE,
    CallLife,
    ClientGone,
    Ending,
    Item,
    error_outcome,
)
from services.router.settings import RouterSettings
from services.worker.claims import WorkClaims
from tests.conftest import NatsServer
from tests.lib.net import free_port
from tests.lib.streams import read_subject
from tollgate.models.catalog import Catalog, ModelEntry
from tollgate.runtime.tasks import stop_tasks
from tollgate.wire import codec
from tollgate.wire.contracts import (
    CancelRequest,
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
    UsageEvent,
    WorkerHeartbeat,
    WorkerState,
)
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

MODEL = "sim/lifecycle"
CATALOG = Catalog(
    models={MODEL: ModelEntry(id=MODEL, source="package://none/none.gguf", engine="simulated")}
)
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
ANSWER = '{"id":"cmpl-1","object":"chat.completion","choices":[]}'
ENGINE_ERROR = '{"error":{"message":"bad","type":"BadRequestError","param":null,"code":400}}'


# -- a worker, scripted by the test -------------------------------------------


class Reply:
    """One request the scripted worker took, and the chunks its script sends back."""

    def __init__(self, nc: NATS, request: InferenceRequest, worker_id: str) -> None:
        self.nc = nc
        self.request = request
        self.worker_id = worker_id
        self.seq = 0
        self.cancelled = asyncio.Event()

    async def send(self, kind: ChunkKind, seq: int | None = None, **fields: Any) -> None:
        chunk = ResponseChunk(
            request_id=self.request.request_id,
            seq=self.seq if seq is None else seq,
            kind=kind,
            **fields,
        )
        self.seq = chunk.seq + 1
        await self.nc.publish(self.request.reply_to, codec.encode(chunk))

    async def start(self) -> None:
        await self.send(ChunkKind.START, worker_id=self.worker_id)

    async def end(self, outcome: Outcome, usage: Usage, finish_reason: str | None = None) -> None:
        await self.send(ChunkKind.END, outcome=outcome, usage=usage, finish_reason=finish_reason)


Script = Callable[[Reply], Coroutine[Any, Any, None]]


class ScriptedWorker:
    """A test double for a worker: pulls the model's work queue, heartbeats, and
    answers each request with ``script`` (it runs no engine, simulated or real)."""

    def __init__(self, nc: NATS, subjects: Subjects, script: Script, heartbeat_s: float) -> None:
        self.nc = nc
        self.subjects = subjects
        self.script = script
        self.heartbeat_s = heartbeat_s
        self.worker_id = f"scripted-{uuid.uuid4().hex[:8]}"
        self.replies: dict[str, Reply] = {}
        self.taken = asyncio.Queue[Reply]()
        self._beating: asyncio.Task[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.cancel_all, cb=self._on_cancel)
        await Topology(self.subjects).ensure_work(self.nc.jetstream())
        claims = WorkClaims(self.nc, self.subjects, MODEL, self.worker_id)
        await self._beat()
        self._beating = asyncio.create_task(self._beat_loop())
        self._tasks.append(asyncio.create_task(self._pull_loop(claims)))

    def stop_heartbeats(self) -> None:
        """From now on the worker looks dead to the router."""
        assert self._beating is not None
        self._beating.cancel()

    async def stop(self) -> None:
        # cancelled until they end: a cancel that meets a reply inside nats.py's
        # request can be absorbed, and the pull loop would poll on forever
        await stop_tasks(*(t for t in (self._beating, *self._tasks) if t is not None))

    async def _beat(self) -> None:
        beat = WorkerHeartbeat(
            worker_id=self.worker_id,
            model=MODEL,
            engine="simulated",
            state=WorkerState.READY,
            slots_used=0,
            slots_total=8,
            interval_s=self.heartbeat_s,
            sent_at=time.time(),
        )
        await self.nc.publish(self.subjects.heartbeat(MODEL), codec.encode(beat))

    async def _beat_loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)  # a heartbeat period, not a wait for an event
            await self._beat()

    async def _pull_loop(self, claims: WorkClaims) -> None:
        """Claims requests as a worker does (services.worker.claims), polling when idle."""
        while True:
            claims.arrived()  # this double hears no arrivals: it reads the counts each time
            claimed = await claims.take()
            if claimed is None:
                await asyncio.sleep(0.02)  # a poll period
                continue
            reply = Reply(self.nc, codec.decode(InferenceRequest, claimed.data), self.worker_id)
            self.replies[reply.request.request_id] = reply
            self.taken.put_nowait(reply)
            self._tasks.append(asyncio.create_task(self.script(reply)))

    async def _on_cancel(self, msg: Any) -> None:
        cancel = codec.decode(CancelRequest, msg.data)
        reply = self.replies.get(cancel.request_id)
        if reply is not None:
            reply.cancelled.set()


# -- the router in this process ---------------------------------------------------


@dataclass
class Published:
    """What the router published on the bus, once it had stopped."""

    usage: list[UsageEvent]  # every usage event publish (duplicates included)
    stored: list[UsageEvent]  # what the usage stream kept
    cancels: list[CancelRequest]

    def one_event(self) -> UsageEvent:
        assert len(self.usage) == 1, self.usage
        assert [e.request_id for e in self.stored] == [self.usage[0].request_id]
        return self.usage[0]


@dataclass
class Router:
    app: web.Application
    runner: web.AppRunner
    http: aiohttp.ClientSession
    nc: NATS
    subjects: Subjects
    usage_sub: Subscription
    cancel_sub: Subscription
    workers: list[ScriptedWorker] = field(default_factory=list)
    closed: Published | None = None

    async def worker(self, script: Script, heartbeat_s: float = 0.5) -> ScriptedWorker:
        worker = ScriptedWorker(self.nc, self.subjects, script, heartbeat_s)
        await worker.start()
        self.workers.append(worker)
        return worker

    async def post(self, **body: Any) -> aiohttp.ClientResponse:
        return await self.http.post(CHAT, json={"model": MODEL, "messages": MESSAGES, **body})

    def ended(self) -> float:
        """Accepted calls the router's metrics counted as ended (all labels)."""
        requests = self.app[METRICS].requests
        return sum(
            s.value for m in requests.collect() for s in m.samples if s.name.endswith("_total")
        )

    async def until_ended(self, calls: int = 1) -> None:
        """Wait (at most 10 s) until the router has ended ``calls`` calls while it runs.

        A stopping router stops waiting for late reports: a test about a late
        report waits for its call to end before it stops the router.
        """
        async with asyncio.timeout(10):
            while self.ended() < calls:  # noqa: ASYNC110 - polls the router's metrics
                await asyncio.sleep(0.05)

    async def close(self) -> Published:
        """Stop the router (it finishes its calls and flushes their usage events)."""
        if self.closed is not None:
            return self.closed
        await self.http.close()
        await self.runner.cleanup()
        for worker in self.workers:
            await worker.stop()
        # Every publish the router made reached the server before it stopped;
        # one round trip later they are all in these subscriptions' queues.
        await self.nc.flush()
        usage = [codec.decode(UsageEvent, m.data) for m in await _taken(self.usage_sub)]
        cancels = [codec.decode(CancelRequest, m.data) for m in await _taken(self.cancel_sub)]
        stream = await read_subject(self.nc.jetstream(), self.subjects.usage("anonymous", False))
        stored = [codec.decode(UsageEvent, m.data) for m in stream]
        await self.nc.close()
        self.closed = Published(usage, stored, cancels)
        return self.closed


async def _taken(sub: Subscription) -> list[Any]:
    return [await sub.next_msg(timeout=1) for _ in range(sub.pending_msgs)]


OpenRouter = Callable[..., Awaitable[Router]]


@pytest.fixture
async def open_router(nats_server: NatsServer, tmp_path: Path) -> AsyncIterator[OpenRouter]:
    opened: list[Router] = []

    async def open_(
        handler_cancellation: bool = False, server: NatsServer = nats_server, **overrides: Any
    ) -> Router:
        subjects = Subjects(f"life-{uuid.uuid4().hex[:10]}")
        common = server.settings(Role.ROUTER, subjects.prefix, var_dir=tmp_path)
        settings = RouterSettings(
            **{
                "auth": False,
                "outbox": tmp_path / f"{subjects.prefix}.db",
                "first_byte_wait_s": 0.05,
                "keepalive_interval_s": 0.05,
                **overrides,
            }
        )
        nc = await server.connect(name="test-lifecycle")
        usage_sub = await nc.subscribe(subjects.usage_all)
        cancel_sub = await nc.subscribe(subjects.cancel_all)
        app = create_app(settings, common, CATALOG)
        runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
        await runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        await web.SockSite(runner, sock).start()
        port = sock.getsockname()[1]
        http = aiohttp.ClientSession(f"http://127.0.0.1:{port}")
        router = Router(app, runner, http, nc, subjects, usage_sub, cancel_sub)
        opened.append(router)
        return router

    yield open_
    for router in opened:
        await router.close()


async def _answer(reply: Reply) -> None:
    await reply.start()
    await reply.send(ChunkKind.DATA, data=ANSWER)
    await reply.end(Outcome.COMPLETED, Usage(prompt_tokens=5, completion_tokens=3), "stop")


STREAMED = ['data: {"n":1}\n\n', 'data: {"n":2}\n\n', "data: [DONE]\n\n"]


async def _stream(reply: Reply) -> None:
    await reply.start()
    for n, data in enumerate(STREAMED):
        await reply.send(
            ChunkKind.DATA, data=data, usage=Usage(prompt_tokens=5, completion_tokens=n)
        )
    await reply.end(Outcome.COMPLETED, Usage(prompt_tokens=5, completion_tokens=2), "stop")


async def _one_piece_until_cancelled(reply: Reply) -> None:
    """Start, send one piece (one token counted), and wait for the router's cancel."""
    await reply.start()
    await reply.send(
        ChunkKind.DATA, data=STREAMED[0], usage=Usage(prompt_tokens=5, completion_tokens=1)
    )
    await reply.cancelled.wait()


async def _until_cancelled(reply: Reply) -> None:
    """Start, send one piece, and stop only when the router cancels (then report)."""
    await _one_piece_until_cancelled(reply)
    await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=2))


# -- calls through HTTP -------------------------------------------------------------


async def test_a_completed_call_emits_one_usage_event_and_no_cancel(
    open_router: OpenRouter,
) -> None:
    router = await open_router()
    worker = await router.worker(_answer)
    r = await router.post()
    assert r.status == 200 and r.content_type == "application/json"
    assert await r.read() == ANSWER.encode()
    request_id = r.headers["x-request-id"]

    published = await router.close()
    event = published.one_event()
    assert event.request_id == request_id and event.worker_id == worker.worker_id
    assert (event.outcome, event.http_status, event.finish_reason) == (
        Outcome.COMPLETED,
        200,
        "stop",
    )
    assert (event.prompt_tokens, event.completion_tokens, event.streamed) == (5, 3, False)
    assert published.cancels == []
    assert router.ended() == 1


async def test_a_streamed_call_relays_every_byte_and_emits_one_event(
    open_router: OpenRouter,
) -> None:
    router = await open_router()
    await router.worker(_stream)
    r = await router.post(stream=True)
    assert r.status == 200 and r.content_type == "text/event-stream"
    assert r.headers["Cache-Control"] == "no-cache" and r.headers["X-Accel-Buffering"] == "no"
    assert await r.read() == "".join(STREAMED).encode()

    published = await router.close()
    event = published.one_event()
    assert event.request_id == r.headers["x-request-id"]
    assert (event.outcome, event.http_status, event.streamed) == (Outcome.COMPLETED, 200, True)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 2)
    assert published.cancels == []


@pytest.mark.parametrize("handler_cancellation", [False, True], ids=["deployed", "cancelled"])
async def test_a_client_hanging_up_mid_stream_gets_one_cancel_and_one_event(
    open_router: OpenRouter, handler_cancellation: bool
) -> None:
    """As deployed, the handler notices the closed connection between chunks;
    a runner that cancels handlers ends it by a CancelledError instead."""
    router = await open_router(handler_cancellation=handler_cancellation)
    worker = await router.worker(_until_cancelled)
    r = await router.post(stream=True)
    assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
    r.close()
    reply = await worker.taken.get()
    async with asyncio.timeout(10):
        await reply.cancelled.wait()

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    # billed: the worker's final report, sent after the cancel
    assert (event.prompt_tokens, event.completion_tokens) == (5, 2)
    assert [(c.request_id, c.reason) for c in published.cancels] == [
        (reply.request.request_id, "client_disconnected")
    ]
    assert router.ended() == 1


async def test_a_worker_slow_to_answer_the_cancel_is_waited_for_while_it_beats(
    open_router: OpenRouter,
) -> None:
    """A loaded worker reports well after the router's wait for the report: the
    router waits on while the worker beats, and bills what the engine generated."""

    async def report_late(reply: Reply) -> None:
        await _one_piece_until_cancelled(reply)
        await asyncio.sleep(1.2)  # four of the router's waits for the report
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=9))

    router = await open_router(late_usage_wait_s=0.3)
    await router.worker(report_late)
    r = await router.post(stream=True)
    assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
    r.close()
    await router.until_ended()

    event = (await router.close()).one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 9)


async def test_a_client_gone_before_the_workers_start_arrived_is_billed_its_report(
    open_router: OpenRouter,
) -> None:
    """A worker took the call but its START has not reached the router when the
    client leaves: the router cannot take the request back out of the queue, so
    it waits for the report the worker sends on the cancel and bills it."""
    taken = asyncio.Event()

    async def start_late(reply: Reply) -> None:
        taken.set()
        async with asyncio.timeout(10):
            await reply.cancelled.wait()
        await reply.send(
            ChunkKind.END,
            worker_id=reply.worker_id,
            outcome=Outcome.CANCELLED,
            usage=Usage(prompt_tokens=5, completion_tokens=0),
        )

    router = await open_router()
    await router.worker(start_late)
    r = await router.post(stream=True)
    async with asyncio.timeout(10):
        await taken.wait()
    r.close()
    await router.until_ended()

    event = (await router.close()).one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 0)
    assert event.worker_id is not None


async def test_a_worker_lost_after_the_client_left_is_not_waited_for(
    open_router: OpenRouter,
) -> None:
    """The worker stops beating instead of reporting: the router stops waiting
    (well before the call's deadline) and bills what it relayed."""
    lost = asyncio.Event()

    async def die_on_cancel(reply: Reply) -> None:
        await _one_piece_until_cancelled(reply)
        lost.set()

    router = await open_router(late_usage_wait_s=0.3, request_timeout_s=120)
    worker = await router.worker(die_on_cancel, heartbeat_s=0.1)
    r = await router.post(stream=True)
    assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
    r.close()
    async with asyncio.timeout(10):
        await lost.wait()
    worker.stop_heartbeats()
    # A wait for the report until the deadline would not end here.
    await router.until_ended()
    event = (await router.close()).one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 1)


async def test_a_stopping_router_stops_waiting_for_a_late_report_and_bills_the_call(
    open_router: OpenRouter,
) -> None:
    """The worker beats on but never reports: the router's stop does not wait
    for the report until the deadline (its event would be lost), it bills what
    was relayed."""
    cancelled = asyncio.Event()

    async def never_report(reply: Reply) -> None:
        await _one_piece_until_cancelled(reply)
        cancelled.set()

    router = await open_router(late_usage_wait_s=0.3, request_timeout_s=120)
    await router.worker(never_report)
    r = await router.post(stream=True)
    assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
    r.close()
    async with asyncio.timeout(10):
        await cancelled.wait()
    await asyncio.sleep(1.0)  # the router is waiting on, the worker beating
    event = (await router.close()).one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 1)


async def test_a_worker_that_stops_heartbeating_ends_the_stream_with_one_event(
    open_router: OpenRouter,
) -> None:
    router = await open_router()
    worker = await router.worker(_until_cancelled, heartbeat_s=0.1)
    r = await router.post(stream=True)
    assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
    worker.stop_heartbeats()
    rest = await r.read()
    # keep-alive comments while the router waits, then the error and the end
    error = sse_error_event(WorkerLost("The worker serving this request stopped responding."))
    assert rest.replace(b": \n\n", b"") == error + b"data: [DONE]\n\n"

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.WORKER_LOST, 502)
    # billed: the running count relayed with the last chunk (no final report)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 1)
    assert [c.reason for c in published.cancels] == ["worker_lost"]


async def test_a_chunk_lost_on_the_way_ends_the_call_billed_from_the_final_report(
    open_router: OpenRouter,
) -> None:
    """A gap in the chunks (one lost on the way) ends the call as a lost worker's
    would; the worker, alive, answers the cancel with its engine's count, which
    the router waits for and bills (not the nothing it relayed)."""

    async def skip_one(reply: Reply) -> None:
        await reply.start()
        await reply.send(ChunkKind.DATA, seq=2, data=ANSWER)
        async with asyncio.timeout(10):
            await reply.cancelled.wait()
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=7))

    router = await open_router()
    await router.worker(skip_one)
    r = await router.post()
    assert r.status == 502
    assert (await r.json())["error"]["code"] == "worker_lost"
    await router.until_ended()

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.WORKER_LOST, 502)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 7)
    assert [c.reason for c in published.cancels] == ["worker_lost"]


async def test_a_final_report_that_shows_a_lost_chunk_is_billed_and_acknowledged(
    open_router: OpenRouter, nats_server: NatsServer
) -> None:
    """The chunk lost on the way is the last before the final report: the report
    in hand is the call's bill, and the worker hears that it was billed."""
    acknowledged = asyncio.Event()
    router = await open_router()
    # the report goes as a worker sends it: a request from the worker's identity,
    # whose inbox the router may answer
    worker_nc = await nats_server.connect(Role.WORKER, "test-worker", router.subjects.prefix)

    async def lose_the_data(reply: Reply) -> None:
        reply.nc = worker_nc  # every chunk on the one connection, in order
        await reply.start()
        end = ResponseChunk(
            request_id=reply.request.request_id,
            seq=2,  # the DATA (1) never arrives
            kind=ChunkKind.END,
            outcome=Outcome.COMPLETED,
            usage=Usage(prompt_tokens=5, completion_tokens=4),
            finish_reason="stop",
        )
        await worker_nc.request(reply.request.reply_to, codec.encode(end), timeout=10)
        acknowledged.set()

    await router.worker(lose_the_data)
    r = await router.post()
    assert r.status == 502
    assert (await r.json())["error"]["code"] == "worker_lost"
    try:
        async with asyncio.timeout(10):
            await acknowledged.wait()
    finally:
        await worker_nc.close()

    event = (await router.close()).one_event()
    assert (event.outcome, event.http_status) == (Outcome.WORKER_LOST, 502)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 4)


async def test_the_queue_timeout_is_a_503_with_retry_after_and_one_event(
    open_router: OpenRouter,
) -> None:
    router = await open_router(queue_timeout_s=0.3, retry_after_s=7)  # no worker at all
    r = await router.post()
    assert r.status == 503 and r.headers["Retry-After"] == "7"
    assert (await r.json())["error"]["code"] == "no_capacity"

    published = await router.close()
    event = published.one_event()
    assert event.request_id == r.headers["x-request-id"]
    assert (event.outcome, event.http_status, event.worker_id) == (Outcome.NO_CAPACITY, 503, None)
    assert (event.prompt_tokens, event.completion_tokens) == (0, 0)
    # so that no worker runs it later for nobody
    assert [c.reason for c in published.cancels] == ["no_capacity"]


@pytest.mark.parametrize(("stream", "taken_first"), [(False, False), (True, False), (False, True)])
async def test_a_call_the_outbox_cannot_journal_is_stopped_and_answered_503(
    open_router: OpenRouter, monkeypatch: pytest.MonkeyPatch, stream: bool, taken_first: bool
) -> None:
    """A full disk as the call is queued: a call this router could not bill must
    not run. It is taken back out of the queue or, when a worker took it first,
    cancelled and billed what that worker did."""
    router = await open_router(retry_after_s=4)
    worker = await router.worker(_until_cancelled)
    outbox = router.app[SERVING].usage.outbox
    dispatcher = router.app[DISPATCHER]

    def disk_full(request_id: str, record: dict[str, Any]) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(outbox, "open", disk_full)
    if taken_first:
        withdraw = dispatcher.withdraw
        took = asyncio.ensure_future(worker.taken.get())  # awaited by the cancel and the finish

        async def after_the_worker_took_it(call: Call) -> bool:
            async with asyncio.timeout(10):
                await took
            return await withdraw(call)

        monkeypatch.setattr(dispatcher, "withdraw", after_the_worker_took_it)
    r = await router.post(stream=stream)
    assert r.status == 503 and r.headers["Retry-After"] == "4"
    assert (await r.json())["error"]["code"] == "usage_unavailable"
    request_id = r.headers["x-request-id"]
    await router.until_ended()
    queued = await read_subject(router.nc.jetstream(), router.subjects.infer_all)

    published = await router.close()
    event = published.one_event()
    assert event.request_id == request_id
    assert (event.outcome, event.http_status) == (Outcome.INTERNAL_ERROR, 503)
    assert [c.request_id for c in published.cancels] == [request_id]
    assert queued == []  # nothing left for a worker to run later
    assert (request_id in worker.replies) == taken_first
    # taken back before any worker ran it: zero; else what the worker reported
    assert (event.prompt_tokens, event.completion_tokens) == ((5, 2) if taken_first else (0, 0))


async def test_a_stream_waiting_in_the_queue_gets_keepalives_then_the_error(
    open_router: OpenRouter,
) -> None:
    router = await open_router(queue_timeout_s=0.3)
    r = await router.post(stream=True)
    assert r.status == 200  # the stream opened while the request waited
    body = await r.read()
    comments, _, rest = body.rpartition(b": waiting\n\n")
    assert comments.replace(b": waiting\n\n", b"") == b""
    message = f"No worker for `{MODEL}` became free within 0.3 s. Please retry."
    assert rest == sse_error_event(ServiceUnavailable(message)) + b"data: [DONE]\n\n"

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.NO_CAPACITY, 503)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "full"])
async def test_an_engine_error_before_any_output_keeps_its_status_and_body(
    open_router: OpenRouter, stream: bool
) -> None:
    async def refuse(reply: Reply) -> None:
        await reply.start()
        await reply.send(ChunkKind.ERROR, data=ENGINE_ERROR, status=400)
        await reply.end(Outcome.ERROR, Usage())

    router = await open_router()
    await router.worker(refuse)
    r = await router.post(stream=stream)
    assert r.status == 400 and r.content_type == "application/json"
    assert await r.read() == ENGINE_ERROR.encode()
    assert "x-request-id" in r.headers

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.ERROR, 400)
    assert published.cancels == []  # the worker ended it itself


async def test_the_deadline_cancels_once_and_bills_the_final_report(
    open_router: OpenRouter,
) -> None:
    async def stall(reply: Reply) -> None:
        await reply.start()
        await reply.cancelled.wait()
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=3))

    router = await open_router(request_timeout_s=0.4)
    await router.worker(stall)
    r = await router.post()
    assert r.status == 504 and (await r.json())["error"]["code"] == "deadline_exceeded"

    published = await router.close()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.DEADLINE_EXCEEDED, 504)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 3)
    assert [c.reason for c in published.cancels] == ["deadline_exceeded"]


# -- OpenAIServing.events, fed by hand ---------------------------------------------


async def test_a_nats_outage_while_waiting_for_the_final_report_still_bills_it(
    open_router: OpenRouter, tmp_path: Path
) -> None:
    """The client hangs up and NATS goes away for longer than the router waits
    for the worker's final report: the wait starts again once NATS is back, so
    the row bills what the engine generated, not only what was relayed."""
    back = asyncio.Event()

    async def report_more_than_relayed(reply: Reply) -> None:
        """Relay one piece; once NATS is back, report the seven tokens the engine made.

        The report waits for both connections to be back: a core NATS message
        sent while its receiver is still reconnecting is lost, which is not
        what this test is about.
        """
        await reply.start()
        await reply.send(
            ChunkKind.DATA, data=STREAMED[0], usage=Usage(prompt_tokens=5, completion_tokens=1)
        )
        await back.wait()
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=7))

    server = NatsServer(free_port(), tmp_path / "own-nats")
    server.start()
    try:
        router = await open_router(server=server, late_usage_wait_s=0.5)
        await router.worker(report_more_than_relayed)
        r = await router.post(stream=True)
        assert await r.content.readuntil(b"\n\n") == STREAMED[0].encode()
        r.close()
        server.stop()
        # an outage that outlasts the router's wait for the report
        await asyncio.sleep(1.5)
        server.start()
        connections = (router.app[DISPATCHER].nc, router.nc)
        deadline = time.monotonic() + 10
        while not all(nc.is_connected for nc in connections):
            assert time.monotonic() < deadline, "no reconnect"
            await asyncio.sleep(0.02)
        for nc in connections:
            await nc.flush()  # their subscriptions are back on the server
        back.set()
        await router.until_ended()
        published = await router.close()
    finally:
        server.stop()
    event = published.one_event()
    assert (event.outcome, event.http_status) == (Outcome.CLIENT_DISCONNECTED, 499)
    assert (event.prompt_tokens, event.completion_tokens) == (5, 7)
    assert len(published.cancels) <= 1


def _call(request_id: str = "r1") -> Call:
    now = time.time()
    return Call(
        InferenceRequest(
            request_id=request_id,
            model=MODEL,
            endpoint=Endpoint.CHAT,
            body={},
            reply_to="nowhere",
            enqueued_at=now,
            start_by=now + 60,
            deadline=now + 60,
        )
    )


def _chunk(seq: int, kind: ChunkKind, **fields: Any) -> ResponseChunk:
    return ResponseChunk(request_id="r1", seq=seq, kind=kind, **fields)


async def _items(router: Router, call: Call, **body: Any) -> list[Item]:
    serving = router.app[SERVING]
    prepared = serving.parse(
        Endpoint.CHAT, orjson.dumps({"model": MODEL, "messages": MESSAGES, **body})
    )
    return [item async for item in serving.events(call, prepared)]


@pytest.mark.parametrize("wants_usage", [False, True])
async def test_events_relay_in_order_and_hide_start_and_unwanted_usage(
    open_router: OpenRouter, wants_usage: bool
) -> None:
    router = await open_router()
    call = _call()
    for chunk in (
        _chunk(0, ChunkKind.START, worker_id="w"),
        _chunk(1, ChunkKind.DATA, data="a"),
        _chunk(2, ChunkKind.USAGE, data="u"),
        _chunk(3, ChunkKind.END, outcome=Outcome.COMPLETED),
    ):
        call.queue.put_nowait(chunk)
    body = {"stream": True, "stream_options": {"include_usage": True}} if wants_usage else {}
    items = await _items(router, call, **body)
    kinds = [item.kind for item in items if isinstance(item, ResponseChunk)]
    expected = [ChunkKind.DATA, ChunkKind.USAGE, ChunkKind.END]
    assert kinds == (expected if wants_usage else [ChunkKind.DATA, ChunkKind.END])
    assert len(items) == len(kinds) and call.worker_id == "w"


async def test_events_raise_worker_lost_on_a_gap_in_the_sequence(open_router: OpenRouter) -> None:
    router = await open_router()
    call = _call()
    call.queue.put_nowait(_chunk(0, ChunkKind.START, worker_id="w"))
    call.queue.put_nowait(_chunk(2, ChunkKind.DATA, data="a"))
    with pytest.raises(WorkerLost):
        await _items(router, call)


async def test_events_yield_keepalives_while_queued_then_the_chunks(
    open_router: OpenRouter,
) -> None:
    router = await open_router()
    serving = router.app[SERVING]
    prepared = serving.parse(Endpoint.CHAT, orjson.dumps({"model": MODEL, "messages": MESSAGES}))
    call = _call()
    items: list[Item] = []
    async for item in serving.events(call, prepared):
        items.append(item)
        if item is KEEPALIVE and len(items) == 2:  # a worker takes it now
            call.queue.put_nowait(_chunk(0, ChunkKind.START, worker_id="w"))
            call.queue.put_nowait(_chunk(1, ChunkKind.DATA, data="a"))
            call.queue.put_nowait(_chunk(2, ChunkKind.END, outcome=Outcome.COMPLETED))
    assert items[:2] == [KEEPALIVE, KEEPALIVE]
    assert [i.kind for i in items[2:] if isinstance(i, ResponseChunk)] == [
        ChunkKind.DATA,
        ChunkKind.END,
    ]
    assert len(items) == 4


async def test_events_give_up_after_the_queue_timeout(open_router: OpenRouter) -> None:
    router = await open_router(queue_timeout_s=0.2, retry_after_s=3)
    with pytest.raises(ServiceUnavailable) as raised:
        await _items(router, _call())
    assert raised.value.headers == {"Retry-After": "3"}


async def test_events_turn_an_expired_request_into_no_capacity(open_router: OpenRouter) -> None:
    router = await open_router()
    call = _call()
    call.queue.put_nowait(_chunk(0, ChunkKind.END, outcome=Outcome.EXPIRED, usage=Usage()))
    with pytest.raises(ServiceUnavailable):
        await _items(router, call)


# -- CallLife on its own: every way out of a handler -------------------------------


class Recorder:
    """What a CallLife did: the endings it handed over and the cancels it sent."""

    def __init__(self, chunks: list[ResponseChunk]) -> None:
        self.chunks = chunks
        self.endings: list[Ending] = []
        self.cancels: list[str] = []

    def life(self) -> CallLife:
        return CallLife(
            _call(), events=self._events, cancel=self._cancel, finish=self.endings.append
        )

    async def _events(self) -> AsyncIterator[Item]:
        for chunk in self.chunks:
            yield chunk

    async def _cancel(self, call: Call, reason: str) -> None:
        self.cancels.append(reason)


START = _chunk(0, ChunkKind.START, worker_id="w")
DATA = _chunk(1, ChunkKind.DATA, data="a")
END = _chunk(2, ChunkKind.END, outcome=Outcome.COMPLETED, usage=Usage(completion_tokens=1))


async def test_a_life_that_saw_the_end_finishes_with_it_and_cancels_nothing() -> None:
    rec = Recorder([DATA, END])
    async with rec.life() as life:
        async for _ in life.events():
            pass
    assert rec.endings == [Ending(200, END)] and rec.cancels == []


@pytest.mark.parametrize(
    ("exc", "status", "outcome", "reason"),
    [
        (WorkerLost("x"), 502, Outcome.WORKER_LOST, "worker_lost"),
        (DeadlineExceeded("x"), 504, Outcome.DEADLINE_EXCEEDED, "deadline_exceeded"),
        (ServiceUnavailable("x"), 503, Outcome.NO_CAPACITY, "no_capacity"),
        (RateLimited("x"), 429, Outcome.ERROR, "rate_limit_exceeded"),
        (InvalidRequest("x"), 400, Outcome.ERROR, "error"),
        (ClientGone(), 499, Outcome.CLIENT_DISCONNECTED, "client_disconnected"),
        (ConnectionResetError(), 499, Outcome.CLIENT_DISCONNECTED, "client_disconnected"),
        (asyncio.CancelledError(), 499, Outcome.CLIENT_DISCONNECTED, "client_disconnected"),
        (RuntimeError("bug"), 500, Outcome.INTERNAL_ERROR, "internal_error"),
    ],
)
async def test_every_way_out_before_the_end_cancels_once_and_finishes_once(
    exc: BaseException, status: int, outcome: Outcome, reason: str
) -> None:
    rec = Recorder([START, DATA, END])
    with pytest.raises(type(exc)) as raised:
        async with rec.life() as life:
            async for item in life.events():
                if item is DATA:
                    raise exc
    assert raised.value is exc  # never swallowed: the handler still answers
    assert rec.endings == [Ending(status, outcome=outcome)]
    assert rec.cancels == [reason]


async def test_an_error_response_from_the_worker_is_not_cancelled() -> None:
    error = _chunk(1, ChunkKind.ERROR, data=ENGINE_ERROR, status=400)
    rec = Recorder([START, error, END])
    async with rec.life() as life:
        async for item in life.events():
            if item is error:
                life.status = 400
                break
    # the worker's END (its outcome and usage) comes after: finish waits for it
    assert rec.endings == [Ending(400)] and rec.cancels == []


async def test_a_handler_that_stops_reading_early_cancels_the_call() -> None:
    rec = Recorder([START, DATA, END])
    async with rec.life() as life:
        async for _ in life.events():
            break
    assert rec.endings == [Ending(200)] and rec.cancels == ["abandoned"]


async def test_a_life_is_entered_once_and_read_once() -> None:
    rec = Recorder([END])
    life = rec.life()
    with pytest.raises(RuntimeError):
        life.events()  # not entered yet
    async with life:
        life.events()
        with pytest.raises(RuntimeError):
            life.events()
    with pytest.raises(RuntimeError):
        async with life:
            pass
    assert len(rec.endings) == 1


@pytest.mark.parametrize("exc", [WorkerLost("x"), DeadlineExceeded("x"), ServiceUnavailable("x")])
def test_error_outcomes_keep_the_values_usage_rows_always_held(exc: TollgateError) -> None:
    # these error codes were stored as the outcome before Outcome covered them
    assert error_outcome(exc).value == exc.code
