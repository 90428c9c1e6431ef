"""Request classes in the real vLLM engine (vllm marker): the priority policy, honoured.

One engine (SmolLM2 on the CPU, in this process, as tests/corpus/record.py
runs it) with one slot, so that requests wait in vLLM's own queue: a batch
request (priority 10) queued before an interactive one (priority 0) runs
after it. Under vLLM's default first-come-first-served policy it would run
first.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from services.worker.engine import EngineResult, ErrorResult, FullResult, StreamResult
from services.worker.lifetime import PARENT_ENV, kill_engine_processes
from services.worker.vllm_engine import VllmEngine
from tests.conftest import REAL_MODEL
from tollgate.models.catalog import ModelEntry
from tollgate.wire.contracts import ENGINE_PRIORITY, Endpoint, Priority

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

INTERACTIVE = ENGINE_PRIORITY[Priority.INTERACTIVE]
BATCH = ENGINE_PRIORITY[Priority.BATCH]


# An engine start takes about a minute here; one in a long run of engine tests
# was once seen to stall after its engine core had loaded (the core idle, the
# start never returning). A stalled start is shown (every task's stack) and
# made once more, so that the test fails on the scheduling it checks.
START_S = 300


@pytest.fixture(scope="module")
async def engine(prepared_model: Path) -> AsyncIterator[VllmEngine]:
    entry = ModelEntry(
        id=REAL_MODEL,
        source="file:///unused",
        max_model_len=512,
        # one slot: a second request waits in vLLM's queue
        engine_args=[
            "--max-num-seqs",
            "1",
            "--dtype",
            "bfloat16",
            "--seed",
            "0",
            "--enforce-eager",
        ],
    )
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setenv(PARENT_ENV, "")  # set by the engine's start; not left to later tests
        eng = await _started(entry, prepared_model)
        try:
            yield eng
        finally:
            await eng.stop()
            kill_engine_processes()


async def _started(entry: ModelEntry, path: Path, tries: int = 2) -> VllmEngine:
    for attempt in range(1, tries + 1):
        eng = VllmEngine(entry, path)
        try:
            async with asyncio.timeout(START_S):
                await eng.start()
            return eng
        except TimeoutError:
            if attempt == tries:
                raise
            print(f"engine start stalled for {START_S} s; its tasks:", file=sys.stderr)
            for task in asyncio.all_tasks():
                task.print_stack(file=sys.stderr)
            await eng.stop()
            kill_engine_processes()
    raise AssertionError("unreachable")


def completion(priority: int, max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": REAL_MODEL,
        "prompt": "Once upon a time",
        "max_tokens": max_tokens,
        "temperature": 0,
        "priority": priority,
        **extra,
    }


def chat(priority: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": REAL_MODEL,
        "messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "priority": priority,
    }


def responses(priority: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": REAL_MODEL,
        "input": "Name three colours.",
        "max_output_tokens": max_tokens,
        "temperature": 0,
        "priority": priority,
    }


# The batch call of the test below, on each generating endpoint's own serving layer:
# endpoint -> (its body, the object its answer is)
BATCH_CALLS = {
    Endpoint.CHAT: (chat, "chat.completion"),
    Endpoint.MESSAGES: (chat, "message"),  # Anthropic's body: messages and max_tokens
    Endpoint.RESPONSES: (responses, "response"),
}


async def until_queued(engine: VllmEngine, count: int) -> None:
    """Until the engine holds ``count`` unfinished requests (running or waiting)."""
    async with asyncio.timeout(60):
        # vLLM counts its requests but signals no change: poll the count
        while engine.stats().running < count:  # noqa: ASYNC110
            await asyncio.sleep(0.005)


def served(result: EngineResult) -> FullResult:
    assert not isinstance(result, ErrorResult), result.body
    assert isinstance(result, FullResult)
    return result


async def test_the_engine_runs_the_priority_policy(engine: VllmEngine) -> None:
    assert engine.scheduling_policy == "priority"
    assert engine.slots_total == 1


@pytest.mark.parametrize("batch_endpoint", list(BATCH_CALLS), ids=lambda e: e.value)
async def test_both_classes_are_served_and_interactive_goes_first(
    engine: VllmEngine, batch_endpoint: Endpoint
) -> None:
    # The one slot is busy with a long stream while the other two queue.
    blocker = await engine.run(
        Endpoint.COMPLETIONS,
        completion(INTERACTIVE, 160, stream=True, ignore_eos=True),
        f"prio-blocker-{batch_endpoint.value}",
    )
    assert isinstance(blocker, StreamResult)
    events = blocker.events.__aiter__()
    await anext(events)  # it runs: the slot is taken
    finished: list[str] = []

    async def call(name: str, endpoint: Endpoint, body: dict[str, Any]) -> FullResult:
        result = served(await engine.run(endpoint, body, f"prio-{name}-{batch_endpoint.value}"))
        finished.append(name)
        return result

    # the batch request arrives first: first come, first served would run it first
    make_body, batch_object = BATCH_CALLS[batch_endpoint]
    batch = asyncio.create_task(call("batch", batch_endpoint, make_body(BATCH, 4)))
    await until_queued(engine, 2)
    interactive = asyncio.create_task(
        call("interactive", Endpoint.COMPLETIONS, completion(INTERACTIVE, 4))
    )
    await until_queued(engine, 3)
    streamed = [event.text async for event in events]
    batch_result, interactive_result = await asyncio.gather(batch, interactive)

    assert blocker.usage is not None and blocker.usage.completion_tokens == 160
    assert streamed[-1] == "data: [DONE]\n\n"
    assert finished == ["interactive", "batch"]
    for result, kind in (
        (batch_result, batch_object),
        (interactive_result, "text_completion"),
    ):
        body = orjson.loads(result.body)
        assert body.get("object", body.get("type")) == kind
        assert result.usage.prompt_tokens > 0
        assert result.usage.completion_tokens == 4
