"""Every way a call can fail releases it: 1,000 calls per failing stage, nothing left behind.

Each stage runs its own router in this process (see test_lifecycle.py for the
router and the scripted worker double) and sends 1,000 calls that fail there:
at the edge, at dispatch, with an engine error, a lost worker, the queue
timeout, the deadline, or a client that hangs up mid-stream. Afterwards the
router holds no call (the in-flight and queued gauges are back at 0 and no
``Call`` object is left in memory), and every accepted call produced exactly
one usage event.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import nats.errors
import pytest

from services.router.app import DISPATCHER
from services.router.appkeys import METRICS, SERVING
from services.router.dispatch import Call
from tests.router import test_lifecycle
from tests.router.test_lifecycle import (
    CHAT,
    ENGINE_ERROR,
    MESSAGES,
    MODEL,
    STREAMED,
    OpenRouter,
    Reply,
    Router,
)
from tollgate.wire.contracts import ChunkKind, Outcome, Usage

pytestmark = pytest.mark.timeout(300)

open_router = test_lifecycle.open_router  # the fixture: a router in this process

CALLS = 1000
AT_ONCE = 100


def _gauge(router: Router, name: str) -> float:
    """A gauge's value as the router's /metrics would report it."""
    for metric in router.app[METRICS].registry.collect():
        for sample in metric.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"no gauge {name}")


async def _send_all(send: Callable[[int], Awaitable[Any]]) -> list[Any]:
    gate = asyncio.Semaphore(AT_ONCE)

    async def one(i: int) -> Any:
        async with gate:
            return await send(i)

    return await asyncio.gather(*(one(i) for i in range(CALLS)))


async def _post(router: Router, body: bytes | dict[str, Any]) -> tuple[int, str | None]:
    kwargs: dict[str, Any] = (
        {"data": body, "headers": {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    async with router.http.post(CHAT, **kwargs) as r:
        payload = await r.json()
        code = payload["error"]["code"] if "error" in payload else None
        return r.status, code


def _assert_released(router: Router) -> None:
    dispatcher = router.app[DISPATCHER]
    assert dispatcher.in_flight == 0 and dispatcher.queued == 0
    assert _gauge(router, "tollgate_router_requests_in_flight") == 0
    assert _gauge(router, "tollgate_router_requests_queued") == 0
    assert not router.app[SERVING]._finishing
    gc.collect()
    prefix = router.subjects.prefix  # this router's calls, not another test's
    assert not [
        o for o in gc.get_objects() if isinstance(o, Call) and o.request.reply_to.startswith(prefix)
    ]


async def _ended(
    router: Router, expected: int, outcome: Outcome | None = None, status: int | None = None
) -> None:
    """Stop the router; every accepted call left exactly one usage event."""
    await router.app[SERVING].drain()
    _assert_released(router)
    published = await router.close()
    # the usage stream keeps one event per call (a publish retried is deduplicated)
    stored = [e.request_id for e in published.stored]
    assert len(stored) == len(set(stored)) == expected
    assert {e.request_id for e in published.usage} == set(stored)
    assert {(e.outcome, e.http_status) for e in published.usage} == (
        {(outcome, status)} if expected else set()
    )
    assert all(e.prompt_tokens >= 0 and e.completion_tokens >= 0 for e in published.usage)


async def test_calls_refused_at_the_edge_hold_nothing(open_router: OpenRouter) -> None:
    router = await open_router()
    deep = b'{"model":"%s","messages":[],"x":%s%s}' % (MODEL.encode(), b"[" * 300, b"]" * 300)
    bodies: list[bytes | dict[str, Any]] = [
        b"{not json",
        deep,
        {"model": MODEL, "messages": MESSAGES, "max_tokens": -5},
        {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": "abc"},
        {"model": "no/such-model", "messages": MESSAGES},
    ]
    results = await _send_all(lambda i: _post(router, bodies[i % len(bodies)]))
    assert {status for status, _ in results} <= {400, 404}
    await _ended(router, 0)  # nothing was accepted


async def test_calls_whose_dispatch_fails_hold_nothing(
    open_router: OpenRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    router = await open_router()

    async def no_ack(*args: Any, **kwargs: Any) -> None:
        raise nats.errors.TimeoutError  # the publish's ack never came

    monkeypatch.setattr(router.app[DISPATCHER].js, "publish", no_ack)
    results = await _send_all(lambda i: _post(router, {"model": MODEL, "messages": MESSAGES}))
    assert set(results) == {(503, "no_capacity")}
    await _ended(router, CALLS, Outcome.NOT_DISPATCHED, 503)


async def test_calls_the_engine_refuses_hold_nothing(open_router: OpenRouter) -> None:
    async def refuse(reply: Reply) -> None:
        await reply.start()
        await reply.send(ChunkKind.ERROR, data=ENGINE_ERROR, status=400)
        await reply.end(Outcome.ERROR, Usage())

    router = await open_router()
    await router.worker(refuse)
    results = await _send_all(lambda i: _post(router, {"model": MODEL, "messages": MESSAGES}))
    assert {status for status, _ in results} == {400}
    await _ended(router, CALLS, Outcome.ERROR, 400)


async def test_calls_whose_worker_is_lost_hold_nothing(open_router: OpenRouter) -> None:
    async def skip_one(reply: Reply) -> None:
        await reply.start()
        await reply.send(ChunkKind.DATA, seq=2, data="{}")

    router = await open_router()
    await router.worker(skip_one)
    results = await _send_all(lambda i: _post(router, {"model": MODEL, "messages": MESSAGES}))
    assert set(results) == {(502, "worker_lost")}
    await _ended(router, CALLS, Outcome.WORKER_LOST, 502)


async def test_calls_that_wait_out_the_queue_hold_nothing(open_router: OpenRouter) -> None:
    router = await open_router(queue_timeout_s=0.05)  # no worker at all
    results = await _send_all(lambda i: _post(router, {"model": MODEL, "messages": MESSAGES}))
    assert set(results) == {(503, "no_capacity")}
    await _ended(router, CALLS, Outcome.NO_CAPACITY, 503)


async def test_calls_past_their_deadline_hold_nothing(open_router: OpenRouter) -> None:
    async def stall(reply: Reply) -> None:
        await reply.start()
        await reply.cancelled.wait()
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=1))

    router = await open_router(request_timeout_s=0.2)
    await router.worker(stall)
    results = await _send_all(lambda i: _post(router, {"model": MODEL, "messages": MESSAGES}))
    assert set(results) == {(504, "deadline_exceeded")}
    await _ended(router, CALLS, Outcome.DEADLINE_EXCEEDED, 504)


async def test_calls_whose_client_hangs_up_hold_nothing(open_router: OpenRouter) -> None:
    async def until_cancelled(reply: Reply) -> None:
        await reply.start()
        await reply.send(
            ChunkKind.DATA, data=STREAMED[0], usage=Usage(prompt_tokens=5, completion_tokens=1)
        )
        await reply.cancelled.wait()
        await reply.end(Outcome.CANCELLED, Usage(prompt_tokens=5, completion_tokens=2))

    router = await open_router()
    await router.worker(until_cancelled)

    async def hang_up(i: int) -> None:
        # a connection of its own, closed after the first chunk
        async with aiohttp.ClientSession(router.http._base_url) as http:
            body = {"model": MODEL, "messages": MESSAGES, "stream": True}
            async with http.post(CHAT, json=body) as r:
                event = b": waiting\n\n"  # keep-alives while the call is queued
                while event.startswith(b":"):
                    event = await r.content.readuntil(b"\n\n")
                assert event == STREAMED[0].encode()
                r.close()

    await _send_all(hang_up)
    # the router notices each closed connection at its next keep-alive
    async with asyncio.timeout(30):
        while router.app[DISPATCHER].in_flight:  # noqa: ASYNC110 (a gauge, no event to await)
            await asyncio.sleep(0.05)
    await _ended(router, CALLS, Outcome.CLIENT_DISCONNECTED, 499)
