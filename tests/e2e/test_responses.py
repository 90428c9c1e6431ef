"""OpenAI's Responses API (/v1/responses) through the stack, with the official OpenAI SDK.

On the shared stack (real nats-server, router; the simulated SIM_MODEL worker: a
test double that renders ``instructions`` and ``input`` as a chat, as vLLM's
Responses layer does for a text model). The real engine is tested in
``test_responses_real.py``.
"""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI

from tests.conftest import SIM_MODEL, Stack
from tests.lib.streams import tenant_usage
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome

TENANT = "responder"


async def test_the_openai_sdk_gets_whole_and_streamed_responses_billed_once(
    stack: Stack, router_url: str, sim_workers: None
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    billed: dict[str, tuple[int, int]] = {}  # request id -> (input, output) tokens

    raw = await client.responses.with_raw_response.create(
        model=SIM_MODEL, input="Name three colours.", instructions="Be brief.", max_output_tokens=6
    )
    whole = raw.parse()
    assert whole.object == "response" and whole.status == "incomplete"  # cut at 6 tokens
    assert whole.incomplete_details is not None
    assert whole.incomplete_details.reason == "max_output_tokens"
    assert whole.output_text and whole.usage is not None and whole.usage.output_tokens == 6
    billed[raw.headers["x-request-id"]] = (whole.usage.input_tokens, whole.usage.output_tokens)

    # items in, streamed out: the same prompt, so the same text and counts
    stream = await client.responses.with_raw_response.create(
        model=SIM_MODEL,
        instructions="Be brief.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}
        ],
        max_output_tokens=6,
        stream=True,
    )
    text, kinds, completed = "", [], None
    async for event in stream.parse():  # type: ignore[attr-defined]
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            completed = event.response
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert completed is not None and completed.usage is not None
    assert text == whole.output_text == completed.output_text
    assert completed.usage.input_tokens == whole.usage.input_tokens
    usage = completed.usage
    billed[stream.headers["x-request-id"]] = (usage.input_tokens, usage.output_tokens)

    events = await tenant_usage(stack.nats, TENANT, set(billed))
    assert set(events) == set(billed), "every call has exactly one usage row"
    for request_id, (prompt, completion) in billed.items():
        event = events[request_id]
        assert (event.prompt_tokens, event.completion_tokens) == (prompt, completion)
        assert event.endpoint == "responses" and event.outcome is Outcome.COMPLETED
        assert event.finish_reason == "length"


async def test_what_needs_stored_responses_is_refused_with_a_clear_400(
    stack: Stack, router_url: str, sim_workers: None
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    base = {"model": SIM_MODEL, "input": "hi"}
    cases = [
        ({**base, "previous_response_id": "resp_123"}, "previous_response_id"),
        ({**base, "background": True}, "background"),
        ({"model": SIM_MODEL, "input": ""}, "input"),
        ({"model": SIM_MODEL}, "input"),
        ({**base, "max_output_tokens": 0}, "max_output_tokens"),
        ({**base, "max_output_tokens": 100_000}, "max_output_tokens"),  # past the context
    ]
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as http:
        for body, param in cases:
            r = await http.post(
                "/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert r.status_code == 400, (body, r.text)
            error = r.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error"
        # store is accepted (nothing is kept) and the call is answered
        r = await http.post(
            "/v1/responses",
            json={**base, "store": True, "max_output_tokens": 2},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200, r.text
        # and there is nothing to fetch back
        r = await http.get(
            f"/v1/responses/{r.json()['id']}", headers={"Authorization": f"Bearer {key}"}
        )
        assert r.status_code in (404, 405) and "error" in r.json()
