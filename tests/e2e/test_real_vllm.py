"""End to end on the real path: OpenAI SDK -> router -> NATS -> vLLM worker (SmolLM2)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.conftest import REAL_MODEL, SIM_MODEL, HeartbeatWatch, Stack
from tollgate.wire.subjects import Subjects

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900), pytest.mark.usefixtures("real_worker")]

MESSAGES = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def client(router_url: str, api_key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def aclient(router_url: str, api_key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(prepared_model: Path) -> object:
    return AutoTokenizer.from_pretrained(str(prepared_model))


def templated_prompt_tokens(tokenizer: object, messages: list[dict[str, str]]) -> int:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)  # type: ignore[attr-defined]
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return len(ids)


def test_chat_non_stream_usage_is_exact(client: openai.OpenAI, tokenizer: object) -> None:
    resp = client.chat.completions.create(
        model=REAL_MODEL, messages=MESSAGES, max_tokens=12, temperature=0
    )
    assert resp.object == "chat.completion"
    assert resp.model == REAL_MODEL
    assert resp.choices[0].message.content
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == templated_prompt_tokens(tokenizer, MESSAGES)
    assert resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_max_tokens_gives_finish_reason_length(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=REAL_MODEL,
        messages=[{"role": "user", "content": "Write a long story about a dragon."}],
        max_tokens=5,
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 5


def test_stream_with_usage_counts_every_streamed_token(
    client: openai.OpenAI, tokenizer: object
) -> None:
    stream = client.chat.completions.create(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
    )
    streamed_tokens, text, usage, finish = 0, "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs and choice.logprobs.content:
                streamed_tokens += len(choice.logprobs.content)
            finish = choice.finish_reason or finish
    assert text and finish in ("stop", "length")
    assert usage is not None
    assert usage.completion_tokens == streamed_tokens
    assert usage.prompt_tokens == templated_prompt_tokens(tokenizer, MESSAGES)


def test_stream_without_include_usage_has_no_usage_chunk(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=REAL_MODEL, messages=MESSAGES, max_tokens=8, stream=True
        )
    )
    assert chunks, "no chunks streamed"
    assert all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_stop_sequence_cuts_the_output(client: openai.OpenAI) -> None:
    args = {"model": REAL_MODEL, "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    full = client.chat.completions.create(**args).choices[0].message.content or ""
    words = full.split()
    assert len(words) >= 3, full
    stop = words[len(words) // 2]
    cut = client.chat.completions.create(**args, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert stop not in (cut.message.content or "")
    assert full.startswith(cut.message.content or "")


def test_n_two_returns_two_choices_and_sums_usage(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=REAL_MODEL,
        messages=MESSAGES,
        max_tokens=6,
        n=2,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in resp.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in resp.choices)
    assert resp.usage is not None and resp.usage.completion_tokens == 12


def test_seed_makes_sampling_reproducible(client: openai.OpenAI) -> None:
    args = {"model": REAL_MODEL, "messages": MESSAGES, "max_tokens": 16, "temperature": 1.0}
    first = client.chat.completions.create(**args, seed=1234).choices[0].message.content
    second = client.chat.completions.create(**args, seed=1234).choices[0].message.content
    assert first == second


def test_completions_stream_and_non_stream(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=REAL_MODEL, prompt="Once upon a time", max_tokens=6)
    assert resp.object == "text_completion"
    assert resp.usage is not None and resp.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=REAL_MODEL,
            prompt="Once upon a time",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0].completion_tokens == 6
    assert "".join(c.choices[0].text for c in chunks if c.choices)


def test_alias_routes_to_the_model(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=2)
    assert resp.usage is not None and resp.usage.completion_tokens == 2


def test_engine_validation_errors_pass_through(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=REAL_MODEL,
            messages=MESSAGES,
            max_tokens=4,
            extra_body={"stop": 5},  # the edge leaves stop to vLLM's request model
        )
    body = err.value.response.json()
    assert body["error"]["code"] == 400 and "stop" in body["error"]["message"]


def test_sampling_values_are_checked_at_the_edge_as_vllm_checks_them(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=REAL_MODEL, messages=MESSAGES, max_tokens=4, extra_body={"temperature": "hot"}
        )
    error = err.value.response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "temperature"


async def test_sixteen_concurrent_streams(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[int, int]:
        stream = await aclient.chat.completions.create(
            model=REAL_MODEL,
            messages=[{"role": "user", "content": f"Count to {i}."}],
            max_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
        )
        tokens, reported = 0, -1
        async for chunk in stream:
            if chunk.usage:
                reported = chunk.usage.completion_tokens
            for choice in chunk.choices:
                if choice.logprobs and choice.logprobs.content:
                    tokens += len(choice.logprobs.content)
        return tokens, reported

    results = await asyncio.gather(*(one(i) for i in range(16)))
    assert len(results) == 16
    for tokens, reported in results:
        assert tokens == reported and tokens > 0


async def test_two_models_are_routed_to_their_own_workers(
    aclient: openai.AsyncOpenAI, sim_workers: None
) -> None:
    real, sim = await asyncio.gather(
        aclient.chat.completions.create(model=REAL_MODEL, messages=MESSAGES, max_tokens=8),
        aclient.chat.completions.create(model=SIM_MODEL, messages=MESSAGES, max_tokens=8),
    )
    assert real.model == REAL_MODEL and sim.model == SIM_MODEL
    assert (sim.choices[0].message.content or "").startswith("Tollgate is a simulated")
    assert not (real.choices[0].message.content or "").startswith("Tollgate is a simulated")
    assert real.system_fingerprint and real.system_fingerprint.startswith("vllm")


async def test_client_disconnect_frees_the_slot(
    router_url: str, stack: Stack, auth_headers: dict[str, str]
) -> None:
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        async with httpx.AsyncClient(timeout=60, headers=auth_headers) as http:
            body = {
                "model": REAL_MODEL,
                "stream": True,
                "max_tokens": 1500,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me everything."}],
            }
            async with http.stream("POST", f"{router_url}/v1/chat/completions", json=body) as r:
                request_id = r.headers["x-request-id"]
                seen = 0
                # Hold the iterator: a dropped one is closed, and so the connection.
                lines = r.aiter_lines()
                async for line in lines:
                    seen += line.startswith("data: ")
                    if seen >= 5:
                        break
                # while it generates, the heartbeats carry vLLM's own KV-cache use
                await watch.wait_for(
                    lambda b: any(
                        x.model == REAL_MODEL and x.slots_used == 1 and (x.kv_cache_usage or 0) > 0
                        for x in b.values()
                    ),
                    timeout=15,
                )
        await watch.wait_for(
            lambda b: any(x.model == REAL_MODEL and x.slots_used == 0 for x in b.values()),
            timeout=30,
        )
    worker_log = next(s for s in stack.services if s.name == f"worker-{REAL_MODEL}").log_text()
    line = next(ln for ln in worker_log.splitlines() if request_id in ln and "request done" in ln)
    assert '"outcome":"cancelled"' in line
    # 1500 tokens were asked for; the worker stopped long before.
    completion = int(line.split('"completion_tokens":')[1].split(",")[0])
    assert 0 < completion < 1500
