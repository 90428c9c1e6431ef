"""Batched prompts reserve what they can generate: prompts x n x the completion limit."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson

from services.router.endpoints import prompts_of, worst_case_tokens
from tests.router.test_key_mirror import OpenKeys, signing_keys, wait_status
from tests.router.test_key_mirror import open_keys as open_keys
from tests.router.test_lifecycle import CATALOG, MODEL, OpenRouter, Reply, Script
from tests.router.test_lifecycle import open_router as open_router
from tollgate.wire.contracts import ChunkKind, Endpoint, Outcome, Usage

CONTEXT = CATALOG.models[MODEL].max_model_len


def test_prompts_of_a_completion_request() -> None:
    assert prompts_of("hi") == ["hi"]
    assert prompts_of([1, 2, 3]) == [[1, 2, 3]]
    assert prompts_of(["a", "b"]) == ["a", "b"]
    assert prompts_of([[1], [2, 3]]) == [[1], [2, 3]]


def test_the_worst_case_counts_every_prompt_and_every_choice() -> None:
    one = {"prompt": "hello", "max_tokens": 100}
    single = worst_case_tokens(Endpoint.COMPLETIONS, one, CONTEXT)
    assert single == len(orjson.dumps("hello")) + 64 + 100
    batch = {"prompt": ["hello"] * 1000, "max_tokens": 100, "n": 3}
    assert (
        worst_case_tokens(Endpoint.COMPLETIONS, batch, CONTEXT)
        == 1000 * (len(orjson.dumps("hello")) + 64) + 1000 * 3 * 100
    )
    tokens = {"prompt": [[1, 2, 3], [4, 5]], "max_tokens": 10, "n": 2}
    assert worst_case_tokens(Endpoint.COMPLETIONS, tokens, CONTEXT) == 5 + 2 * 2 * 10
    # no limit on completions: 16 each, as OpenAI's API and vLLM default it
    default = {"prompt": ["a", "b"]}
    prompts = 2 * (len(orjson.dumps("a")) + 64)
    assert worst_case_tokens(Endpoint.COMPLETIONS, default, CONTEXT) == prompts + 2 * 16
    # max_tokens 0 (echo only) still generates one token
    echo = {"prompt": ["a", "b"], "max_tokens": 0, "echo": True}
    assert worst_case_tokens(Endpoint.COMPLETIONS, echo, CONTEXT) == prompts + 2 * 1
    # no limit on chat: each completion is bounded by the context
    unbounded = {"messages": [{"role": "user", "content": "hi"}]}
    assert worst_case_tokens(Endpoint.CHAT, unbounded, CONTEXT) >= CONTEXT
    # completions has no max_completion_tokens: never read there, whatever it holds
    odd = {"prompt": "a", "max_tokens": 4, "max_completion_tokens": "abc"}
    assert worst_case_tokens(Endpoint.COMPLETIONS, odd, CONTEXT) == len(b'"a"') + 64 + 4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2}
    assert worst_case_tokens(Endpoint.CHAT, chat, CONTEXT) == (
        len(orjson.dumps(chat["messages"])) + 64 + 2 * 5
    )


PROMPTS = [f"prompt number {i}" for i in range(8)]
BATCH = {"model": MODEL, "prompt": PROMPTS, "max_tokens": 16, "n": 2}
GENERATED = len(PROMPTS) * 2 * 16  # what an engine makes of BATCH at most


def _answer_every_prompt(release: asyncio.Event) -> Script:
    """An engine that generates for every prompt and choice up to the limit, once released."""

    async def answer(reply: Reply) -> None:
        await reply.start()
        await release.wait()
        await reply.send(ChunkKind.DATA, data='{"object":"text_completion","choices":[]}')
        usage = Usage(prompt_tokens=len(PROMPTS) * 4, completion_tokens=GENERATED)
        await reply.end(Outcome.COMPLETED, usage, "length")

    return answer


async def test_batched_requests_cannot_overshoot_a_budget_sized_for_ten(
    open_router: OpenRouter, open_keys: OpenKeys, tmp_path: Path
) -> None:
    router = await open_router(auth=True)
    keys = await open_keys(router, signing_keys(tmp_path, "EdDSA"))
    await keys.publish_current()
    release = asyncio.Event()
    await router.worker(_answer_every_prompt(release))
    worst = worst_case_tokens(Endpoint.COMPLETIONS, BATCH, CONTEXT)
    budget = 10 * worst
    token, _ = await keys.issue(budget_tokens=budget, budget_period="total")
    await wait_status(router, token, 200)
    headers = {"Authorization": f"Bearer {token}"}

    async def one() -> tuple[int, Any]:
        r = await router.http.post("/v1/completions", json=BATCH, headers=headers)
        return r.status, await r.json()

    # The calls that run are answered once the others have been refused: a
    # call that ended would give back what it reserved beyond its use, room
    # for one more. With every call reserving its worst case, 20 are refused
    # while 10 run; were they reserving less, more would run, and fewer than
    # 20 would be refused before the wait below ends.
    calls = [asyncio.create_task(one()) for _ in range(30)]
    try:
        async with asyncio.timeout(10):
            while sum(c.done() for c in calls) < 20:  # noqa: ASYNC110 - polls the calls
                await asyncio.sleep(0.02)
    except TimeoutError:
        pass  # too many running: the count below says so
    release.set()
    results = await asyncio.gather(*calls)
    ran = [body for status, body in results if status == 200]
    refused = [body for status, body in results if status == 429]
    assert len(ran) + len(refused) == 30, [status for status, _ in results]
    assert all(body["error"]["code"] == "insufficient_quota" for body in refused)
    billed = len(ran) * (len(PROMPTS) * 4 + GENERATED)
    # every request reserved what it could generate, so no more than ten ran
    assert len(ran) == 10, len(ran)
    assert billed <= budget
