"""The simulated engine (a test double): real token counts, and vLLM's answers to bodies."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest
from transformers import AutoTokenizer

from services.worker.engine import ErrorResult, FullResult, StreamResult, TokenTally, current_tally
from services.worker.simulated import SimulatedEngine
from tollgate.models.catalog import ModelEntry, SimulatedEngineConfig
from tollgate.wire.contracts import Endpoint


@pytest.fixture(scope="module")
async def engine(prepared_model: Path) -> SimulatedEngine:
    entry = ModelEntry(
        id="sim/unit",
        source="file:///unused",
        engine="simulated",
        max_model_len=256,
        simulated=SimulatedEngineConfig(tokens_per_s=10_000, ttft_ms=0, natural_tokens=10),
    )
    eng = SimulatedEngine(entry, prepared_model)
    await eng.start()
    return eng


MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


async def test_prompt_tokens_are_the_templated_prompt(
    engine: SimulatedEngine, prepared_model: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    expected = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    result = await engine.run(Endpoint.CHAT, {"messages": MESSAGES, "max_tokens": 3}, "r")
    assert isinstance(result, FullResult)
    assert result.usage.prompt_tokens == len(expected)
    assert result.usage.completion_tokens == 3 and result.finish_reason == "length"


async def test_natural_end_is_stop(engine: SimulatedEngine) -> None:
    result = await engine.run(Endpoint.COMPLETIONS, {"prompt": "hi"}, "r")
    assert isinstance(result, FullResult)
    assert result.finish_reason == "stop" and result.usage.completion_tokens == 10
    assert orjson.loads(result.body)["choices"][0]["text"]


async def test_stream_usage_event_and_tally(engine: SimulatedEngine) -> None:
    tally = TokenTally()
    current_tally.set(tally)
    result = await engine.run(
        Endpoint.CHAT, {"messages": MESSAGES, "stream": True, "n": 2, "max_tokens": 4}, "r"
    )
    assert isinstance(result, StreamResult)
    events = [e async for e in result.events]
    assert events[-1].text == "data: [DONE]\n\n"
    usage_events = [e for e in events if e.is_usage]
    assert len(usage_events) == 1
    assert orjson.loads(usage_events[0].text[6:])["usage"]["completion_tokens"] == 8
    assert result.usage is not None and result.usage.completion_tokens == 8
    assert tally.completion_tokens == 8 and tally.prompt_tokens == result.usage.prompt_tokens


async def test_too_many_tokens_for_the_context_is_a_400(engine: SimulatedEngine) -> None:
    result = await engine.run(Endpoint.CHAT, {"messages": MESSAGES, "max_tokens": 300}, "r")
    assert isinstance(result, ErrorResult) and result.status == 400
    assert orjson.loads(result.body)["error"]["param"] == "max_tokens"


async def test_a_prompt_near_the_context_gets_what_is_left(engine: SimulatedEngine) -> None:
    # 250 prompt tokens in a 256-token context: 6 are left, whatever max_tokens asks
    body = {"prompt": [6403] * 250, "max_tokens": 100}
    result = await engine.run(Endpoint.COMPLETIONS, body, "r")
    assert isinstance(result, FullResult)
    assert result.usage.prompt_tokens == 250 and result.usage.completion_tokens == 6
    assert result.finish_reason == "length"


@pytest.mark.parametrize("limit", [{}, {"max_tokens": 4}], ids=["no-max-tokens", "max-tokens"])
async def test_a_prompt_longer_than_the_context_is_a_400(
    engine: SimulatedEngine, limit: dict[str, int]
) -> None:
    body = {"messages": [{"role": "user", "content": " hello" * 300}], **limit}
    result = await engine.run(Endpoint.CHAT, body, "r")
    assert isinstance(result, ErrorResult) and result.status == 400
    assert orjson.loads(result.body)["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("message", "rendered"),
    [
        ({"role": "user", "content": [{"type": "text", "text": "hi"}]}, "hi"),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            "a\nb",
        ),
        ({"role": "user"}, ""),
        ({"role": "assistant", "content": None}, ""),
    ],
    ids=["one-part", "two-parts", "no-content", "null-content"],
)
async def test_content_is_rendered_as_vllm_renders_it(
    engine: SimulatedEngine, prepared_model: Path, message: dict[str, object], rendered: str
) -> None:
    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    as_text = [{"role": message["role"], "content": rendered}]
    expected = tok.apply_chat_template(as_text, add_generation_prompt=True, tokenize=True)
    if hasattr(expected, "keys"):
        expected = expected["input_ids"]
    result = await engine.run(Endpoint.CHAT, {"messages": [message], "max_tokens": 1}, "r")
    assert isinstance(result, FullResult)
    assert result.usage.prompt_tokens == len(expected)


async def test_null_user_content_is_refused_like_vllm_refuses_it(engine: SimulatedEngine) -> None:
    body = {"messages": [{"role": "user", "content": None}], "max_tokens": 1}
    result = await engine.run(Endpoint.CHAT, body, "r")
    assert isinstance(result, ErrorResult) and result.status == 400
    # what vllm serve's request validation writes
    assert orjson.loads(result.body)["error"]["type"] == "Bad Request"


async def test_a_batch_of_prompts_is_one_generation_each(engine: SimulatedEngine) -> None:
    body = {"prompt": ["Once upon a time", "The cat"], "max_tokens": 3, "n": 2}
    result = await engine.run(Endpoint.COMPLETIONS, body, "r")
    assert isinstance(result, FullResult)
    assert result.usage.prompt_tokens == 4 + 2 and result.usage.completion_tokens == 2 * 2 * 3
    assert [c["index"] for c in orjson.loads(result.body)["choices"]] == [0, 1, 2, 3]


async def test_a_stream_the_engine_refuses_fails_after_its_200(engine: SimulatedEngine) -> None:
    tally = TokenTally()
    current_tally.set(tally)
    body = {"messages": MESSAGES, "max_tokens": 2, "logprobs": True, "top_logprobs": 21}
    result = await engine.run(Endpoint.CHAT, {**body, "stream": True}, "r")
    assert isinstance(result, StreamResult)
    events = [e.text async for e in result.events]
    assert events[-1] == "data: [DONE]\n\n" and len(events) == 2
    assert orjson.loads(events[0][6:])["error"]["type"] == "BadRequestError"
    assert result.usage is None and tally.usage().total_tokens == 0
    refused = await engine.run(Endpoint.CHAT, body, "r")  # not streamed: a plain 400
    assert isinstance(refused, ErrorResult) and refused.status == 400


@pytest.mark.parametrize("stream", [False, True])
async def test_echo_of_token_ids_outside_the_vocabulary_is_a_400(
    engine: SimulatedEngine, stream: bool
) -> None:
    """As vLLM: refused as out of vocabulary (a stream: in its first event, after the 200),
    not an engine failure while decoding the echo."""
    body = {"prompt": [9223372036854775807, 37], "echo": True, "max_tokens": 2, "stream": stream}
    result = await engine.run(Endpoint.COMPLETIONS, body, "r")
    if isinstance(result, StreamResult):
        texts = [event.text async for event in result.events]
        assert "out of vocabulary" in texts[0], texts
    else:
        assert isinstance(result, ErrorResult) and result.status == 400, result
        assert "out of vocabulary" in orjson.loads(result.body)["error"]["message"]
