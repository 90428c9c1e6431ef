"""OpenAI's Responses API (/v1/responses) on the real engine, with the official OpenAI SDK.

On the shared stack with the real vLLM worker for SmolLM2: vLLM's Responses
layer renders ``instructions`` and ``input`` with the model's chat template,
so a greedy response is the greedy chat completion of the same conversation;
a stream's text is the whole response's; each call is billed once with the
SDK's own token counts.
"""

from __future__ import annotations

import pytest
from openai import AsyncOpenAI

from tests.conftest import REAL_MODEL, Stack
from tests.lib.streams import tenant_usage
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.usefixtures("real_worker")]
TENANT = "responder-real"
SYSTEM, ASK = "You are terse.", "Name three colours."


async def test_responses_match_chat_and_are_billed_once(stack: Stack, router_url: str) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    billed: dict[str, tuple[int, int]] = {}

    chat = await client.chat.completions.create(
        model=REAL_MODEL,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}],
        max_tokens=12,
        temperature=0,
    )
    raw = await client.responses.with_raw_response.create(
        model=REAL_MODEL, instructions=SYSTEM, input=ASK, max_output_tokens=12, temperature=0
    )
    whole = raw.parse()
    assert whole.usage is not None and chat.usage is not None
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    billed[raw.headers["x-request-id"]] = (whole.usage.input_tokens, whole.usage.output_tokens)

    stream = await client.responses.with_raw_response.create(
        model=REAL_MODEL,
        instructions=SYSTEM,
        input=[{"role": "user", "content": ASK}],
        max_output_tokens=12,
        temperature=0,
        stream=True,
    )
    text, completed = "", None
    async for event in stream.parse():  # type: ignore[attr-defined]
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.completed":
            completed = event.response
    assert completed is not None and completed.usage is not None
    assert text == completed.output_text == whole.output_text
    usage = completed.usage
    billed[stream.headers["x-request-id"]] = (usage.input_tokens, usage.output_tokens)

    events = await tenant_usage(stack.nats, TENANT, set(billed), timeout=60)
    assert set(events) == set(billed)
    for request_id, counts in billed.items():
        event = events[request_id]
        assert (event.prompt_tokens, event.completion_tokens) == counts
        assert event.endpoint == "responses" and event.outcome is Outcome.COMPLETED
