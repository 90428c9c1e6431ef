"""Compact replies: a non-stream call answered at once costs the worker one message.

On the shared stack (real nats-server, router, simulated workers: test
doubles). The test listens on every router's reply subjects and counts what
the worker sent for each call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import orjson

from tests.conftest import SIM_MODEL, SLOW_MODEL, Stack
from tollgate.wire import codec
from tollgate.wire.contracts import ChunkKind, ResponseChunk
from tollgate.wire.subjects import Subjects


@asynccontextmanager
async def replies(stack: Stack) -> AsyncIterator[dict[str, list[ResponseChunk]]]:
    """Every chunk workers send to routers meanwhile, by request id."""
    seen: dict[str, list[ResponseChunk]] = {}
    nc = await stack.nats.connect(name="test-replies")

    async def on_chunk(msg: object) -> None:
        chunk = codec.decode(ResponseChunk, msg.data)  # type: ignore[attr-defined]
        seen.setdefault(chunk.request_id, []).append(chunk)

    try:
        await nc.subscribe(f"{Subjects().prefix}.reply.>", cb=on_chunk)
        await nc.flush()
        yield seen
    finally:
        await nc.close()


async def until_ended(seen: dict[str, list[ResponseChunk]], *calls: httpx.Response) -> None:
    """Wait (at most 10 s) until this listener has each call's END too."""

    def ended(r: httpx.Response) -> bool:
        chunks = seen.get(r.headers["x-request-id"], [])
        return any(c.kind is ChunkKind.END for c in chunks)

    async with asyncio.timeout(10):
        while not all(ended(r) for r in calls):  # noqa: ASYNC110 - polls the listener
            await asyncio.sleep(0.02)


async def test_a_non_stream_call_answered_at_once_is_one_message_and_a_slow_one_two(
    stack: Stack, router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with replies(stack) as seen, httpx.AsyncClient(timeout=60) as http:
        # The simulated engine answers within a few milliseconds, well inside
        # START_HOLD_S; a machine that stalls the worker past it gets a START
        # first. So: the first of up to five quick calls that is one message.
        quicks: list[httpx.Response] = []
        for _ in range(5):
            quick = await http.post(
                f"{router_url}/v1/chat/completions",
                json={"model": SIM_MODEL, **ask},
                headers=auth_headers,
            )
            quicks.append(quick)
            await until_ended(seen, quick)
            if len(seen[quick.headers["x-request-id"]]) == 1:
                break
        # ten tokens a second: 0.4 s, longer than the worker holds its START back
        slow = await http.post(
            f"{router_url}/v1/chat/completions",
            json={"model": SLOW_MODEL, **ask},
            headers=auth_headers,
        )
        streamed = await http.post(
            f"{router_url}/v1/chat/completions",
            json={"model": SIM_MODEL, "stream": True, **ask},
            headers=auth_headers,
        )
        await until_ended(seen, slow, streamed)
    for r in (*quicks, slow, streamed):
        assert r.status_code == 200, r.text
    # the whole answer reached the client, counted as the engine counted it
    for r in (*quicks, slow):
        body = r.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 4
    for r in quicks[:-1]:  # held past START_HOLD_S: the START, then the END, as a slow call
        assert [c.kind for c in seen[r.headers["x-request-id"]]] == [
            ChunkKind.START,
            ChunkKind.END,
        ]
    quick_chunks = seen[quick.headers["x-request-id"]]
    assert [c.kind for c in quick_chunks] == [ChunkKind.END]
    (end,) = quick_chunks
    assert end.worker_id and end.data is not None and end.usage is not None
    assert orjson.loads(end.data)["choices"] == quick.json()["choices"]
    slow_chunks = seen[slow.headers["x-request-id"]]
    assert [c.kind for c in slow_chunks] == [ChunkKind.START, ChunkKind.END]
    assert slow_chunks[0].worker_id == slow_chunks[1].worker_id
    assert slow_chunks[1].data is not None
    # a stream is relayed event by event, after its START, as before
    kinds = [c.kind for c in seen[streamed.headers["x-request-id"]]]
    assert kinds[0] is ChunkKind.START and kinds[-1] is ChunkKind.END
    assert ChunkKind.DATA in kinds
    assert [c.seq for c in seen[streamed.headers["x-request-id"]]] == list(range(len(kinds)))
