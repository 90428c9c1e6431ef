"""The local backend drains a worker that is busy streaming: every stream still completes."""

from __future__ import annotations

import asyncio

import openai
import pytest

from services.scaler.backends import LocalBackend
from tests.conftest import SCALE_MODEL, HeartbeatWatch, Stack
from tollgate.wire.contracts import WorkerState
from tollgate.wire.subjects import Subjects

MESSAGES = [{"role": "user", "content": "hello"}]


async def long_stream(aclient: openai.AsyncOpenAI) -> tuple[int, str | None]:
    chunks = await aclient.chat.completions.create(
        model=SCALE_MODEL, messages=MESSAGES, stream=True
    )
    pieces, finish = 0, None
    async for chunk in chunks:
        for choice in chunk.choices:
            pieces += 1 if choice.delta.content else 0
            finish = choice.finish_reason or finish
    return pieces, finish


@pytest.mark.timeout(180)
async def test_scale_down_of_busy_workers_aborts_nothing(
    stack: Stack, router_url: str, api_key: str
) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)
    backend = LocalBackend(stack.env(), stack.var_dir / "logs", drain_timeout_s=60)
    await backend.start()
    try:
        async with HeartbeatWatch(stack.nats, Subjects()) as watch:
            await backend.scale(SCALE_MODEL, 2, [])
            await watch.wait_for(lambda _: len(watch.ready(SCALE_MODEL)) == 2, timeout=60)
            # four 5-second streams fill both workers' two slots
            streams = [asyncio.create_task(long_stream(aclient)) for _ in range(4)]
            await watch.wait_for(
                lambda _: [b.slots_used for b in watch.ready(SCALE_MODEL)] == [2, 2], timeout=30
            )
            busy = [b.worker_id for b in watch.ready(SCALE_MODEL)]
            await backend.scale(SCALE_MODEL, 1, busy[:1])
            assert (await backend.current(SCALE_MODEL)).running == 1
            await watch.wait_for(
                lambda b: b[busy[0]].state in (WorkerState.DRAINING, WorkerState.STOPPED), 10
            )
            results = await asyncio.gather(*streams)
            assert results == [(100, "stop")] * 4, "the drained worker finished its streams"
            # it exits once its streams are done, not before
            [drained] = [w for w in backend.workers[SCALE_MODEL] if w.worker_id == busy[0]] or [
                None
            ]
            if drained is not None:
                await asyncio.wait_for(drained.proc.wait(), 30)
            await backend.scale(SCALE_MODEL, 0, [])
            await watch.wait_for(lambda _: not watch.ready(SCALE_MODEL), timeout=30)
    finally:
        await backend.close()
    assert all(w.proc.returncode is not None for ws in backend.workers.values() for w in ws)
