"""Anthropic's Messages API (/v1/messages) with the official ``anthropic`` SDK.

On the shared stack with the real vLLM worker for SmolLM2: the SDK sends the
key as ``x-api-key``; answers, streams and errors must be what the SDK parses,
and each call is billed once with the SDK's own token counts.
"""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import EMBED_MODEL, REAL_MODEL, Stack
from tests.e2e.test_embeddings import usage_events
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("real_worker", "sim_workers"),
]
TENANT = "embedder"  # usage_events reads this tenant's events
ASK = [{"role": "user", "content": "Name three colours."}]


async def test_the_anthropic_sdk_gets_messages_and_streams_billed_once(
    stack: Stack, router_url: str
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = anthropic.AsyncAnthropic(base_url=router_url, api_key=key, max_retries=0)
    billed: dict[str, tuple[int, int]] = {}

    raw = await client.messages.with_raw_response.create(
        model=REAL_MODEL,
        max_tokens=16,
        messages=ASK,
        system="You are terse.",
        extra_body={"temperature": 0},
    )
    message = await raw.parse()
    assert message.role == "assistant" and message.type == "message"
    assert message.content and message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 0 < message.usage.output_tokens <= 16 and message.usage.input_tokens > 0
    billed[raw.headers["x-request-id"]] = (
        message.usage.input_tokens,
        message.usage.output_tokens,
    )

    async with client.messages.stream(
        model=REAL_MODEL,
        max_tokens=16,
        messages=ASK,
        system="You are terse.",
        extra_body={"temperature": 0},
    ) as stream:
        texts = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
        request_id = stream.response.headers["x-request-id"]
    assert "".join(texts) == final.content[0].text  # type: ignore[union-attr]
    assert "".join(texts) == message.content[0].text  # greedy: the same reply, streamed
    assert final.usage.output_tokens == message.usage.output_tokens
    billed[request_id] = (message.usage.input_tokens, final.usage.output_tokens)

    events = await usage_events(stack, set(billed))
    assert sorted(e.request_id for e in events) == sorted(billed)
    for event in events:
        assert event.endpoint == "messages" and event.outcome is Outcome.COMPLETED
        assert (event.prompt_tokens, event.completion_tokens) == billed[event.request_id]


async def test_errors_come_in_anthropics_shape(stack: Stack, router_url: str) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = anthropic.AsyncAnthropic(base_url=router_url, api_key=key, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as bad_key:
        await anthropic.AsyncAnthropic(
            base_url=router_url, api_key="tg-not-a-key", max_retries=0
        ).messages.create(model=REAL_MODEL, max_tokens=4, messages=ASK)
    assert bad_key.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as unknown:
        await client.messages.create(model="no/such-model", max_tokens=4, messages=ASK)
    assert unknown.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as too_long:
        await client.messages.create(model=REAL_MODEL, max_tokens=4096, messages=ASK)
    assert "context" in too_long.value.message  # SmolLM2's is 2,048 tokens
    with pytest.raises(anthropic.BadRequestError):  # an embedding model has no chat
        await client.messages.create(model=EMBED_MODEL, max_tokens=4, messages=ASK)
    # the engine's own refusal, relayed in Anthropic's shape
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{router_url}/v1/messages",
            json={"model": REAL_MODEL, "max_tokens": 4, "messages": ASK, "top_k": "many"},
            headers={"x-api-key": key},
        )
        assert r.status_code == 400, r.text
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error", r.text
        # no max_tokens: the edge's own refusal
        r = await http.post(
            f"{router_url}/v1/messages",
            json={"model": REAL_MODEL, "messages": ASK},
            headers={"x-api-key": key},
        )
        assert r.status_code == 400 and set(r.json()) == {"type", "error"}, r.text
        assert "max_tokens" in r.json()["error"]["message"]
