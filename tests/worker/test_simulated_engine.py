"""The simulated engine (a test double) counts tokens with the real tokenizer."""

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
