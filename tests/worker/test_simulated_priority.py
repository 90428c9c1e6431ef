"""The simulated engine (a test double) admits waiting requests as vLLM's priority policy does.

One slot, taken by a stream that the test holds open (the stream generates
only as it is read), so every other request waits: a freed slot goes to the
lowest ``priority`` value, first come first served among equals.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from services.worker.engine import FullResult, StreamEvent, StreamResult
from services.worker.simulated import SimulatedEngine
from tollgate.models.catalog import ModelEntry, SimulatedEngineConfig
from tollgate.wire.contracts import ENGINE_PRIORITY, Endpoint, Priority

INTERACTIVE = ENGINE_PRIORITY[Priority.INTERACTIVE]
BATCH = ENGINE_PRIORITY[Priority.BATCH]
MESSAGES = [{"role": "user", "content": "Say something."}]


@pytest.fixture
async def engine(prepared_model: Path) -> AsyncIterator[SimulatedEngine]:
    entry = ModelEntry(
        id="sim/priority",
        source="file:///unused",
        engine="simulated",
        max_model_len=256,
        simulated=SimulatedEngineConfig(
            tokens_per_s=10_000, ttft_ms=0, natural_tokens=4, max_num_seqs=1
        ),
    )
    eng = SimulatedEngine(entry, prepared_model)
    await eng.start()
    yield eng
    assert eng.stats().running == 0 and eng.stats().waiting == 0, "a slot was left taken"


def chat(priority: int | None = None, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim/priority", "messages": MESSAGES, "stream": stream}
    if priority is not None:
        body["priority"] = priority
    return body


async def take_the_slot(engine: SimulatedEngine) -> AsyncIterator[StreamEvent]:
    """A stream that holds the only slot until it is read to its end."""
    result = await engine.run(Endpoint.CHAT, chat(stream=True), "holder")
    assert isinstance(result, StreamResult)
    events = result.events.__aiter__()
    await anext(events)  # generating: the slot is its own
    assert engine.stats().running == 1
    return events


class Arrivals:
    """Requests queued one after another; the order in which they finish."""

    def __init__(self, engine: SimulatedEngine) -> None:
        self.engine = engine
        self.finished: list[str] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def queue(self, name: str, body: dict[str, Any]) -> asyncio.Task[None]:
        async def call() -> None:
            result = await self.engine.run(Endpoint.CHAT, body, name)
            assert isinstance(result, FullResult), result
            assert result.usage.completion_tokens == 4
            self.finished.append(name)

        waiting = self.engine.stats().waiting
        task = asyncio.create_task(call())
        self.tasks.append(task)
        await asyncio.sleep(0)  # its first step renders the body and waits for the slot
        assert self.engine.stats().waiting == waiting + 1, "it should wait for the slot"
        return task

    async def run_after(self, holder: AsyncIterator[StreamEvent]) -> list[str]:
        """Free the slot (read the holder to its end); the order the queued ones finished."""
        assert self.finished == [], "nothing runs while the slot is taken"
        async for _ in holder:
            pass
        await asyncio.gather(*self.tasks)
        return self.finished


async def test_a_batch_request_queued_first_starts_after_an_interactive_one(
    engine: SimulatedEngine,
) -> None:
    holder = await take_the_slot(engine)
    arrivals = Arrivals(engine)
    await arrivals.queue("batch", chat(BATCH))
    await arrivals.queue("interactive", chat(INTERACTIVE))
    assert await arrivals.run_after(holder) == ["interactive", "batch"]


async def test_equal_priorities_keep_their_order(engine: SimulatedEngine) -> None:
    holder = await take_the_slot(engine)
    arrivals = Arrivals(engine)
    for name in ("b1", "b2", "b3"):
        await arrivals.queue(name, chat(BATCH))
    assert await arrivals.run_after(holder) == ["b1", "b2", "b3"]


async def test_classes_first_then_arrival_and_no_priority_is_zero(
    engine: SimulatedEngine,
) -> None:
    holder = await take_the_slot(engine)
    arrivals = Arrivals(engine)
    await arrivals.queue("batch-1", chat(BATCH))
    await arrivals.queue("interactive-1", chat(INTERACTIVE))
    await arrivals.queue("batch-2", chat(BATCH))
    await arrivals.queue("no-priority", chat())  # vLLM's default: 0
    await arrivals.queue("urgent", chat(-5))  # any int64: lower runs first
    order = await arrivals.run_after(holder)
    assert order == ["urgent", "interactive-1", "no-priority", "batch-1", "batch-2"]


async def test_a_queued_stream_sends_nothing_until_it_has_a_slot(engine: SimulatedEngine) -> None:
    holder = await take_the_slot(engine)
    result = await engine.run(Endpoint.CHAT, chat(BATCH, stream=True), "queued-stream")
    assert isinstance(result, StreamResult)
    first = asyncio.create_task(anext(result.events.__aiter__()))
    await asyncio.sleep(0)
    assert engine.stats().waiting == 1 and not first.done()
    async for _ in holder:
        pass
    role = await first
    assert '"role":"assistant"' in role.text
    texts = [event.text async for event in result.events]
    assert texts[-1] == "data: [DONE]\n\n"
    assert result.usage is not None and result.usage.completion_tokens == 4


async def test_a_request_cancelled_while_waiting_gives_up_its_place(
    engine: SimulatedEngine,
) -> None:
    holder = await take_the_slot(engine)
    arrivals = Arrivals(engine)
    gone = await arrivals.queue("gone", chat(INTERACTIVE))
    await arrivals.queue("batch", chat(BATCH))
    gone.cancel()
    await asyncio.sleep(0)
    assert engine.stats().waiting == 1
    arrivals.tasks.remove(gone)
    assert await arrivals.run_after(holder) == ["batch"]
    assert gone.cancelled()


async def test_free_slots_take_requests_at_once(prepared_model: Path) -> None:
    entry = ModelEntry(
        id="sim/two",
        source="file:///unused",
        engine="simulated",
        simulated=SimulatedEngineConfig(ttft_ms=0, natural_tokens=4, max_num_seqs=2),
    )
    eng = SimulatedEngine(entry, prepared_model)
    await eng.start()
    first = await eng.run(Endpoint.CHAT, chat(BATCH, stream=True), "one")
    second = await eng.run(Endpoint.CHAT, chat(INTERACTIVE, stream=True), "two")
    assert isinstance(first, StreamResult) and isinstance(second, StreamResult)
    await anext(first.events.__aiter__())
    await anext(second.events.__aiter__())
    assert (eng.stats().running, eng.stats().waiting) == (2, 0)
    for stream in (first, second):
        async for _ in stream.events:
            pass
    assert (eng.stats().running, eng.stats().waiting) == (0, 0)
