"""An offered request starts while its claim (the delete) is on its way.

A real nats-server, a router's dispatcher offering the request, and a worker
consumer around a held engine (a test double whose runs wait until released),
so each test decides what the engine is doing when the claim's answer comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from nats.aio.client import Client as NATS
from nats.errors import FlushTimeoutError, OutboundBufferLimitError

from services.router.dispatch import Call, Dispatcher
from services.worker import consumer as consumer_module
from services.worker.consumer import WorkerConsumer
from services.worker.engine import EngineStats, FullResult
from services.worker.metrics import WorkerMetrics
from services.worker.settings import WorkerSettings
from tests.conftest import NatsServer
from tollgate.runtime.tasks import stop_tasks
from tollgate.wire import codec
from tollgate.wire.contracts import (
    CancelRequest,
    ChunkKind,
    Endpoint,
    InferenceRequest,
    Outcome,
    Usage,
)
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

SUBJECTS = Subjects("ahead")
MODEL = "some/ahead"


class HeldEngine:
    """A test double of an engine: each run waits until ``release`` is set."""

    name = "held"
    slots_total = 4
    model_path = Path("/m")

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.release = asyncio.Event()
        self.stopped = asyncio.Event()
        self.runs = 0
        self.cancelled = 0
        self.stop_s = 0.0  # how long a cancelled run takes to stop (an engine's abort)

    def stats(self) -> EngineStats:
        return EngineStats()

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> FullResult:
        self.runs += 1
        self.started.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            if self.stop_s:
                await asyncio.sleep(self.stop_s)
            self.stopped.set()
            raise
        return FullResult('{"answer": 1}', Usage(prompt_tokens=5, completion_tokens=2), "stop")


@dataclass
class Rig:
    router: NATS
    dispatcher: Dispatcher
    consumer: WorkerConsumer
    engine: HeldEngine
    other: NATS  # another worker's connection

    def request(self, request_id: str) -> InferenceRequest:
        now = time.time()
        return InferenceRequest(
            request_id=request_id,
            model=MODEL,
            endpoint=Endpoint.CHAT,
            body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
            reply_to=self.dispatcher.reply_subject(request_id),
            enqueued_at=now,
            start_by=now + 30,
            deadline=now + 60,
            tenant="acme",
            key_id="k1",
            compact_reply=True,
        )

    def claimed(self, source: str) -> float:
        return float(self.consumer.metrics.claims.labels(MODEL, source)._value.get())  # type: ignore[union-attr]


def held_consumer(nc: NATS, worker_id: str, engine: HeldEngine | None = None) -> WorkerConsumer:
    """A worker's consumer of this model around a held engine."""
    return WorkerConsumer(
        nc,
        engine or HeldEngine(),  # type: ignore[arg-type]
        WorkerSettings(worker_id=worker_id),
        SUBJECTS,
        MODEL,
        WorkerMetrics(),
    )


async def until_read(consumer: WorkerConsumer) -> None:
    """Until the consumer's pull loop has read the queue (subscribed to its offers first)."""
    async with asyncio.timeout(10):
        while consumer.claims._read_at == 0.0:  # noqa: ASYNC110 - polls a time the consumer sets
            await asyncio.sleep(0.01)


@pytest.fixture
async def rig(nats_server: NatsServer) -> AsyncIterator[Rig]:
    router = await nats_server.connect(Role.ROUTER, name="test-router", prefix="ahead")
    worker = await nats_server.connect(Role.WORKER, name="test-worker", prefix="ahead")
    other = await nats_server.connect(Role.WORKER, name="test-other-worker", prefix="ahead")
    dispatcher = Dispatcher(router, Topology(SUBJECTS), "r1")
    await dispatcher.start([MODEL])
    engine = HeldEngine()
    consumer = held_consumer(worker, "w-1", engine)
    pulling = asyncio.create_task(consumer._pull_loop())
    await until_read(consumer)
    yield Rig(router, dispatcher, consumer, engine, other)
    consumer._stopping.set()
    await stop_tasks(pulling, *consumer.inflight.values())
    for nc in (router, worker, other):
        await nc.close()


def other_worker_claims_first(rig: Rig) -> None:
    """The request spills to another worker once it runs here: that worker's delete comes first."""
    real_delete = rig.consumer.claims._delete

    async def delete_after_the_other_worker(seq: int) -> bool:
        await rig.engine.started.wait()  # it runs here already
        answer = await rig.other.request(
            f"$JS.API.STREAM.MSG.DELETE.{SUBJECTS.infer_stream}",
            orjson.dumps({"seq": seq, "no_erase": True}),
            timeout=5,
        )
        assert orjson.loads(answer.data)["success"]
        return await real_delete(seq)

    rig.consumer.claims._delete = delete_after_the_other_worker  # type: ignore[method-assign]


async def chunks_within(call: Call, seconds: float) -> list[Any]:
    got = []
    try:
        async with asyncio.timeout(seconds):
            while True:
                got.append(await call.queue.get())
    except TimeoutError:
        return got


async def test_an_offered_request_starts_before_its_claim_is_answered(rig: Rig) -> None:
    real_delete = rig.consumer.claims._delete
    order: list[str] = []

    async def delete_once_started(seq: int) -> bool:
        # the claim goes out only once the engine runs the request: a worker
        # that waited for the claim first would never get here
        await rig.engine.started.wait()
        order.append("engine started")
        ok = await real_delete(seq)
        order.append("claimed")
        rig.engine.release.set()
        return ok

    rig.consumer.claims._delete = delete_once_started  # type: ignore[method-assign]
    call = await rig.dispatcher.submit(rig.request("ahead-1"), worker_id="w-1", offer=True)
    assert call.offer
    async with asyncio.timeout(10):
        end = await call.queue.get()
    assert end.kind is ChunkKind.END and end.worker_id == "w-1"
    assert end.usage == Usage(prompt_tokens=5, completion_tokens=2)
    assert orjson.loads(end.data or "") == {"answer": 1}
    await rig.dispatcher.acknowledge_end(call)
    assert order == ["engine started", "claimed"]
    assert rig.engine.runs == 1 and rig.consumer.tokens_total == 7
    assert rig.claimed("direct") == 1
    info = await rig.router.jetstream().stream_info(SUBJECTS.infer_stream)
    assert info.state.messages == 0  # claimed: gone from the queue


async def test_an_offer_another_worker_had_first_is_stopped_and_sends_nothing(
    rig: Rig,
) -> None:
    """The request spilled to another worker before this one's delete: the work
    started for it is stopped, and nothing of it reaches the router or the counts."""
    other_worker_claims_first(rig)
    call = await rig.dispatcher.submit(rig.request("ahead-2"), worker_id="w-1", offer=True)
    async with asyncio.timeout(10):
        await rig.engine.stopped.wait()  # stopped once the claim failed
    assert await chunks_within(call, 1.0) == []  # no START, no END: the other worker answers
    assert rig.engine.runs == 1
    assert rig.consumer.inflight == {}  # its slot is free again
    assert rig.consumer.tokens_total == 0
    assert rig.claimed("direct") == 0


async def test_a_lost_claim_wakes_the_sleeping_pull_loop_to_read_the_queue(rig: Rig) -> None:
    """An offer started in the reader whose claim fails: the pull loop, asleep
    until an arrival (or its one-second look), reads the queue again at once."""
    takes: list[float] = []
    real_take = rig.consumer.claims.take

    async def timed_take() -> Any:
        takes.append(time.monotonic())
        return await real_take()

    other_worker_claims_first(rig)
    async with asyncio.timeout(10):
        while not rig.consumer._parked:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    rig.consumer.claims.take = timed_take  # type: ignore[method-assign]
    await rig.dispatcher.submit(rig.request("lost-1"), worker_id="w-1", offer=True)
    async with asyncio.timeout(10):
        await rig.engine.stopped.wait()
    lost_at = time.monotonic()
    async with asyncio.timeout(10):
        while not takes:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
    assert takes[0] - lost_at < 0.3  # woken by the loss, not by the one-second look
    assert rig.consumer.claims._read_at >= takes[0]  # that take read the queue again


async def test_an_offer_read_while_the_pull_loop_sleeps_starts_as_it_is_read(rig: Rig) -> None:
    """Taken in the connection's reader: the pull loop, asleep until an
    arrival, never takes it (nor runs it a second time)."""
    takes = 0
    real_take = rig.consumer.claims.take

    async def counted_take() -> Any:
        nonlocal takes
        takes += 1
        return await real_take()

    rig.consumer.claims.take = counted_take  # type: ignore[method-assign]
    async with asyncio.timeout(10):
        while not rig.consumer._parked:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    calls = [
        await rig.dispatcher.submit(rig.request(f"reader-{i}"), worker_id="w-1", offer=True)
        for i in range(2)
    ]
    async with asyncio.timeout(10):
        while rig.engine.runs < 2:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    assert takes == 0
    rig.engine.release.set()
    for call in calls:
        async with asyncio.timeout(10):
            end = await call.queue.get()
        assert end.kind is ChunkKind.END and end.worker_id == "w-1"
        await rig.dispatcher.acknowledge_end(call)
    assert rig.engine.runs == 2 and rig.claimed("direct") == 2
    info = await rig.router.jetstream().stream_info(SUBJECTS.infer_stream)
    assert info.state.messages == 0


async def test_an_offer_read_while_draining_is_not_started(rig: Rig) -> None:
    async with asyncio.timeout(10):
        while not rig.consumer._parked:  # noqa: ASYNC110
            await asyncio.sleep(0.01)
    rig.consumer._stopping.set()
    call = await rig.dispatcher.submit(rig.request("draining-1"), worker_id="w-1", offer=True)
    assert await chunks_within(call, 1.0) == []
    assert rig.engine.runs == 0
    info = await rig.router.jetstream().stream_info(SUBJECTS.infer_stream)
    assert info.state.messages == 1  # still queued: another worker takes it
    answer = await rig.other.request(  # and it does (the next test's queue is empty)
        f"$JS.API.STREAM.MSG.DELETE.{SUBJECTS.infer_stream}",
        orjson.dumps({"seq": info.state.first_seq, "no_erase": True}),
        timeout=5,
    )
    assert orjson.loads(answer.data)["success"]


async def test_a_drain_waits_for_final_reports_within_its_own_time(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Final reports still retrying (NATS restarting as the worker is scaled down)
    outlast the least wait for reports: the drain waits for them, until its own
    time (drain_timeout_s) is spent, and no longer."""
    monkeypatch.setattr(consumer_module, "REPORTS_WAIT_S", 0.1)
    rig.consumer.settings.drain_timeout_s = 2.0
    # stand in for two reports: one whose retries end once NATS is back (soon),
    # one that would retry past the drain's time
    back_soon = asyncio.create_task(asyncio.sleep(0.5))
    never_back = asyncio.create_task(asyncio.sleep(60))
    for report in (back_soon, never_back):
        rig.consumer._reporting.add(report)
        report.add_done_callback(rig.consumer._reporting.discard)
    began = time.monotonic()
    await rig.consumer.drain()
    took = time.monotonic() - began
    assert back_soon.done() and not back_soon.cancelled()
    assert not never_back.done()
    assert 1.5 < took < 6, took  # the drain's time, not the 8 s reports had before
    assert rig.consumer.drained.is_set()
    never_back.cancel()


async def until(condition: Any, seconds: float = 10.0) -> None:
    """Poll ``condition``: state the consumer sets, with no event to wait on."""
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


async def test_an_offer_delivered_twice_runs_once(rig: Rig) -> None:
    """A second copy of an offer already claimed and running here starts
    nothing: the running request keeps its slot, and answers once."""
    offers: list[tuple[Any, ...]] = []
    real_offered = rig.consumer.claims.offered

    def recorded(*args: Any) -> bool:
        offers.append(args)
        return real_offered(*args)

    rig.consumer.claims.offered = recorded  # type: ignore[method-assign]
    await until(lambda: rig.consumer._parked)
    call = await rig.dispatcher.submit(rig.request("twice-1"), worker_id="w-1", offer=True)
    await until(lambda: "twice-1" in rig.consumer._runs and rig.engine.started.is_set())
    first = rig.consumer.inflight["twice-1"]
    claim = rig.consumer._runs["twice-1"][1]
    assert claim is not None
    await until(claim.done)
    assert claim.result()
    # the same offer once more, as the connection's reader hands it on
    assert len(offers) == 1
    started_here = rig.consumer.claims.offered(*offers[0]) and rig.consumer._start_offered()
    if not started_here:
        rig.consumer._arrival.set()  # the pull loop takes it instead
    await asyncio.sleep(0.5)  # its claim (the delete of a request gone) is answered
    assert rig.engine.runs == 1 and rig.engine.cancelled == 0
    assert rig.consumer.inflight == {"twice-1": first}
    rig.engine.release.set()
    got = []
    async with asyncio.timeout(10):
        while not got or got[-1].kind is not ChunkKind.END:
            got.append(await call.queue.get())
    # START (the run outlasted the hold before it), then END: one answer
    assert [(c.kind, c.seq, c.worker_id) for c in got] == [
        (ChunkKind.START, 0, "w-1"),
        (ChunkKind.END, 1, "w-1"),
    ]
    await rig.dispatcher.acknowledge_end(call)
    assert await chunks_within(call, 0.5) == []
    assert rig.consumer.tokens_total == 7
    assert rig.claimed("direct") == 1


async def test_a_request_queued_again_replaces_its_older_attempt_running_here(rig: Rig) -> None:
    """The router queued the request again (this worker's beats seemed to stop):
    the older attempt, whose replies nobody reads now, is stopped, and the new
    one runs and answers on the new attempt's subject."""
    call = await rig.dispatcher.submit(rig.request("again-1"))
    await until(rig.engine.started.is_set)
    first = rig.consumer.inflight["again-1"]
    await rig.dispatcher.requeue(call)
    assert call.request.attempt == 1
    async with asyncio.timeout(10):
        await rig.engine.stopped.wait()  # the older attempt
    await until(lambda: rig.engine.runs == 2)
    assert rig.engine.cancelled == 1
    assert rig.consumer.inflight["again-1"] is not first
    assert rig.consumer._runs["again-1"][0] == 1
    rig.engine.release.set()
    got = []
    async with asyncio.timeout(10):
        while not got or got[-1].kind is not ChunkKind.END:
            got.append(await call.queue.get())
    end = got[-1]
    assert end.worker_id == "w-1" and end.seq == len(got) - 1  # the new attempt's chunks only
    assert end.usage == Usage(prompt_tokens=5, completion_tokens=2)
    await rig.dispatcher.acknowledge_end(call)
    await until(lambda: rig.consumer.inflight == {})
    assert rig.consumer._runs == {}


async def test_a_cancel_reaches_the_newer_attempt_once_the_older_one_stopped(rig: Rig) -> None:
    """The older attempt takes a while to stop (as an engine's abort does), and
    ends after the newer one started: the client's cancel still stops the newer one."""
    rig.engine.stop_s = 0.2
    call = await rig.dispatcher.submit(rig.request("again-2"))
    await until(rig.engine.started.is_set)
    first = rig.consumer.inflight["again-2"]
    await rig.dispatcher.requeue(call)
    await until(lambda: rig.engine.runs == 2)
    await until(first.done)  # the older attempt ended after the newer one started
    assert rig.engine.cancelled == 1
    cancel = CancelRequest(request_id="again-2", reason="client left")
    await rig.consumer._on_cancel(SimpleNamespace(data=codec.encode(cancel)))  # type: ignore[arg-type]
    got = []
    async with asyncio.timeout(10):
        while not got or got[-1].kind is not ChunkKind.END:
            got.append(await call.queue.get())
    assert got[-1].outcome is Outcome.CANCELLED and got[-1].worker_id == "w-1"
    assert rig.engine.cancelled == 2
    await rig.dispatcher.acknowledge_end(call)
    await until(lambda: rig.consumer.inflight == {})


async def test_a_chunk_the_bus_refuses_still_ends_with_the_final_report(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS away long enough to fill the client's buffer: the answer cannot be sent,
    and the final report still goes, with what the engine generated."""
    real_publish = rig.consumer.nc.publish

    async def refuse_the_answer(subject: str, payload: bytes = b"", **kw: Any) -> None:
        # the answer, and an error response in its place, find the buffer full
        if orjson.loads(payload).get("kind") in (ChunkKind.DATA.value, ChunkKind.ERROR.value):
            raise OutboundBufferLimitError
        await real_publish(subject, payload, **kw)

    monkeypatch.setattr(rig.consumer.nc, "publish", refuse_the_answer)
    request = rig.request("refused-1").model_copy(update={"compact_reply": False})
    call = await rig.dispatcher.submit(request, worker_id="w-1", offer=True)
    async with asyncio.timeout(10):
        await rig.engine.started.wait()
        rig.engine.release.set()
        start = await call.queue.get()
        end = await call.queue.get()
    assert (start.kind, start.seq) == (ChunkKind.START, 0)
    assert (end.kind, end.seq, end.outcome) == (ChunkKind.END, 2, Outcome.ERROR)  # 1 never left
    assert end.usage == Usage(prompt_tokens=5, completion_tokens=2)
    await rig.dispatcher.acknowledge_end(call)
    async with asyncio.timeout(10):
        while rig.consumer._reporting:  # noqa: ASYNC110 - the report's task ends on the ack
            await asyncio.sleep(0.01)
    assert rig.consumer.tokens_total == 7


async def test_a_flush_that_fails_as_the_worker_turns_ready_is_tried_again(
    rig: Rig, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NATS slow to answer as a worker turns ready: its pull loop does not die
    (the worker would beat on as ready and take nothing), it confirms its
    subscriptions once NATS answers and takes requests."""
    nc = await nats_server.connect(Role.WORKER, name="test-second-worker", prefix="ahead")
    real_flush = nc.flush
    flushes: list[float] = []

    async def slow_at_first(timeout: float = 10) -> None:
        flushes.append(time.monotonic())
        if len(flushes) == 1:
            raise FlushTimeoutError
        await real_flush(timeout)

    monkeypatch.setattr(nc, "flush", slow_at_first)
    second = held_consumer(nc, "w-2")
    pulling = asyncio.create_task(second._pull_loop())
    try:
        await until_read(second)
        assert len(flushes) == 2 and not pulling.done()
        assert second._takes_offers
    finally:
        second._stopping.set()
        await stop_tasks(pulling)
        await nc.close()


async def test_a_pull_loop_that_fails_is_started_again(
    rig: Rig, nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    nc = await nats_server.connect(Role.WORKER, name="test-second-worker", prefix="ahead")
    second = held_consumer(nc, "w-3")
    real_loop = second._pull_loop
    runs: list[float] = []

    async def fail_once() -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            raise RuntimeError("the pull loop's first run failed")
        await real_loop()

    monkeypatch.setattr(second, "_pull_loop", fail_once)
    second._start_pulling()
    try:
        await until_read(second)
        assert len(runs) == 2
        assert [t.get_name() for t in second._tasks] == ["pull"]  # the failed one is gone
    finally:
        second._stopping.set()
        await stop_tasks(*second._tasks)
        await nc.close()


async def test_a_cancel_read_before_the_calls_task_first_runs_stops_it(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The router's cancel is read in the same turn as the request (its client
    left at once): the call's task has not run yet, and still nothing runs."""
    real_accept = rig.consumer._accept

    def accept_then_cancel(claimed: Any) -> None:
        real_accept(claimed)
        request = codec.decode(InferenceRequest, claimed.data)
        cancel = CancelRequest(request_id=request.request_id, reason="client_disconnected")
        handled = rig.consumer._on_cancel(SimpleNamespace(data=codec.encode(cancel)))  # type: ignore[arg-type]
        with contextlib.suppress(StopIteration):  # it awaits nothing: done in this turn
            handled.send(None)

    monkeypatch.setattr(rig.consumer, "_accept", accept_then_cancel)
    call = await rig.dispatcher.submit(rig.request("cancel-first"), worker_id="w-1", offer=True)
    async with asyncio.timeout(10):
        end = await call.queue.get()
    assert (end.kind, end.outcome) == (ChunkKind.END, Outcome.CANCELLED)
    assert end.usage == Usage()
    await rig.dispatcher.acknowledge_end(call)
    assert rig.engine.runs == 0
