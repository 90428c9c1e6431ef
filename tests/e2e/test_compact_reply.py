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
        await asyncio.sleep(0.3)  # the last END's copy on its way to this listener
    finally:
        await nc.close()


async def test_a_non_stream_call_answered_at_once_is_one_message_and_a_slow_one_two(
    stack: Stack, router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    ask = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    async with replies(stack) as seen, httpx.AsyncClient(timeout=60) as http:
        quick = await http.post(
            f"{router_url}/v1/chat/completions",
            json={"model": SIM_MODEL, **ask},
            headers=auth_headers,
        )
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
    for r in (quick, slow, streamed):
        assert r.status_code == 200, r.text
    # the whole answer reached the client, counted as the engine counted it
    for r in (quick, slow):
        body = r.json()
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 4
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
