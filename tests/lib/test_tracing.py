"""The GenAI spans and the log lines' trace ids, in process (tollgate.runtime.tracing, .logs).

A tracer provider with an in-memory exporter stands in for the OTLP exporter;
tests/e2e/test_tracing.py covers the real exporter and the router.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Iterator
from typing import Any

import orjson
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from tollgate.runtime import tracing
from tollgate.runtime.logs import JsonFormatter


@pytest.fixture
def exported() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    try:
        yield exporter
    finally:
        tracing.use_provider(None)
        provider.shutdown()


def only(exporter: InMemorySpanExporter) -> ReadableSpan:
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, spans
    return spans[0]


def test_request_attributes_of_a_chat_body() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "private"}],
        "max_tokens": 10,
        "max_completion_tokens": 20,  # wins over max_tokens on chat, as vLLM reads it
        "temperature": "0.5",  # lax, as the edge accepts it
        "top_p": 1,
        "top_k": 40,
        "frequency_penalty": 0.1,
        "presence_penalty": "nan",  # not a finite number: left out
        "seed": 7,
        "stop": "END",
        "n": 3,
        "stream": True,
        "response_format": {"type": "json_schema"},
    }
    attributes = tracing.request_attributes("chat", "m", body)
    assert attributes == {
        "gen_ai.request.model": "m",
        "gen_ai.request.max_tokens": 20,
        "gen_ai.request.temperature": 0.5,
        "gen_ai.request.top_p": 1.0,
        "gen_ai.request.top_k": 40,
        "gen_ai.request.frequency_penalty": 0.1,
        "gen_ai.request.presence_penalty": None,
        "gen_ai.request.seed": 7,
        "gen_ai.request.stop_sequences": ["END"],
        "gen_ai.request.choice.count": 3,
        "gen_ai.request.stream": True,
        "gen_ai.output.type": "json",
    }
    assert "private" not in json.dumps(attributes)


def test_request_attributes_leave_out_what_the_client_did_not_set() -> None:
    body = {"model": "m", "prompt": "p", "max_completion_tokens": 9, "n": 1, "stop": ["a", 1]}
    attributes = tracing.request_attributes("text_completion", "m", body)
    # /v1/completions never reads max_completion_tokens; n=1 is not reported; a stop
    # list that is not all strings (vLLM refuses it) is not either
    assert {k: v for k, v in attributes.items() if v is not None} == {"gen_ai.request.model": "m"}


def test_request_attributes_stay_small() -> None:
    body = {"model": "m", "stop": [f"{i}" * 1000 for i in range(10)] * 10}
    stops = tracing.request_attributes("chat", "m", body)["gen_ai.request.stop_sequences"]
    assert len(stops) == tracing.MAX_STOP_SEQUENCES
    assert stops[1] == "1" * tracing.MAX_ATTRIBUTE_CHARS


def test_a_call_that_is_not_streamed(exported: InMemorySpanExporter) -> None:
    with tracing.inference_span("chat", {"tollgate.request_id": "r1"}) as call:
        assert call is not None and tracing.current_call() is call
        call.request("alias", {"model": "alias", "max_tokens": 5, "n": 2}, choices=2)
        call.response_body(
            orjson.dumps(
                {
                    "id": "chatcmpl-1",
                    "model": "org/model",
                    "choices": [
                        {"index": 1, "finish_reason": "length", "message": {"content": "b"}},
                        {"index": 0, "finish_reason": "stop", "message": {"content": "a"}},
                    ],
                }
            ).decode()
        )
        call.usage(11, 12)
        call.ended(200)
    assert tracing.current_call() is None
    span = only(exported)
    assert span.name == "chat alias"
    assert span.kind is SpanKind.SERVER
    assert span.status.status_code is StatusCode.UNSET
    assert dict(span.attributes or {}) == {
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "tollgate",
        "tollgate.request_id": "r1",
        "gen_ai.request.model": "alias",
        "gen_ai.request.max_tokens": 5,
        "gen_ai.request.choice.count": 2,
        "gen_ai.response.id": "chatcmpl-1",
        "gen_ai.response.model": "org/model",
        "gen_ai.response.finish_reasons": ("stop", "length"),
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 12,
        "http.response.status_code": 200,
    }


def _event(**fields: Any) -> str:
    return f"data: {orjson.dumps(fields).decode()}\n\n"


def test_a_streamed_call(exported: InMemorySpanExporter) -> None:
    with tracing.inference_span("text_completion") as call:
        assert call is not None
        call.request("m", {"model": "m", "stream": True, "n": 2}, choices=2)
        first = [{"index": 0, "text": "a", "finish_reason": None}]
        call.response_event(_event(id="cmpl-9", model="m-served", choices=first))
        # later events name their own id and model: only the first one's are kept
        later = [{"index": 1, "text": "b", "finish_reason": None}]
        call.response_event(_event(id="other", model="other", choices=later))
        call.response_event(_event(id="x", choices=[{"index": 1, "finish_reason": "stop"}]))
        call.response_event(_event(id="x", choices=[{"index": 0, "finish_reason": "length"}]))
        call.response_event(_event(id="x", choices=[], usage={"prompt_tokens": 1}))
        call.response_event("data: [DONE]\n\n")
        call.ended(200)
    attributes = dict(only(exported).attributes or {})
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.response.id"] == "cmpl-9"
    assert attributes["gen_ai.response.model"] == "m-served"
    assert attributes["gen_ai.response.finish_reasons"] == ("length", "stop")
    assert "error.type" not in attributes


def test_an_engine_error_names_its_type_and_every_missing_finish_reason(
    exported: InMemorySpanExporter,
) -> None:
    error = {"error": {"message": "too long", "type": "BadRequestError", "code": 400}}
    with tracing.inference_span("chat") as call:
        assert call is not None
        call.request("m", {"model": "m", "n": 3}, choices=3)
        call.response_event(
            _event(id="c", model="m", choices=[{"index": 2, "finish_reason": "stop"}])
        )
        call.worker_error(orjson.dumps(error).decode())
        call.ended(400, "error")  # the first cause named is kept
    span = only(exported)
    attributes = dict(span.attributes or {})
    assert attributes["error.type"] == "BadRequestError"
    assert attributes["gen_ai.response.finish_reasons"] == ("error", "error", "stop")
    assert attributes["http.response.status_code"] == 400
    # a call refused for the client's fault is not a server error
    assert span.status.status_code is StatusCode.UNSET


def test_a_server_failure_sets_the_span_status(exported: InMemorySpanExporter) -> None:
    with tracing.inference_span("chat") as call:
        assert call is not None
        call.ended(503, "no_capacity")
    span = only(exported)
    assert span.name == "chat"  # the model was never known
    assert span.status.status_code is StatusCode.ERROR
    assert dict(span.attributes or {})["error.type"] == "no_capacity"
    assert "gen_ai.response.finish_reasons" in dict(span.attributes or {})


def test_a_status_without_a_cause_is_named_by_its_code(exported: InMemorySpanExporter) -> None:
    with tracing.inference_span("chat") as call:
        assert call is not None
        call.ended(429)
    assert dict(only(exported).attributes or {})["error.type"] == "429"


def test_an_exception_names_its_class(exported: InMemorySpanExporter) -> None:
    with pytest.raises(KeyError), tracing.inference_span("chat"):
        raise KeyError("boom")
    span = only(exported)
    assert dict(span.attributes or {})["error.type"] == "KeyError"
    assert span.status.status_code is StatusCode.ERROR


def _format(formatter: JsonFormatter, message: str) -> dict[str, Any]:
    record = logging.LogRecord("tollgate.test", logging.INFO, __file__, 1, message, None, None)
    result: dict[str, Any] = json.loads(formatter.format(record))
    return result


async def test_log_lines_carry_the_trace_of_the_call(exported: InMemorySpanExporter) -> None:
    formatter = JsonFormatter("router")
    assert "trace_id" not in _format(formatter, "before")
    with tracing.inference_span("chat") as call:
        assert call is not None
        context = call.span.get_span_context()
        inside = _format(formatter, "inside")

        async def later() -> dict[str, Any]:
            return _format(formatter, "in a task the call started")

        in_task = await asyncio.create_task(later())
    after = _format(formatter, "after")
    assert inside["trace_id"] == in_task["trace_id"] == format(context.trace_id, "032x")
    assert inside["span_id"] == in_task["span_id"] == format(context.span_id, "016x")
    assert len(inside["trace_id"]) == 32 and len(inside["span_id"]) == 16
    assert "trace_id" not in after and "span_id" not in after
    assert only(exported).context.trace_id == context.trace_id


def test_without_the_sdk_tracing_stays_off(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The otel extra not installed: OTEL_* set, yet nothing fails and nothing is traced."""
    for name in list(sys.modules):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            monkeypatch.setitem(sys.modules, name, None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert tracing.enabled()
    with caplog.at_level(logging.WARNING, "tollgate.runtime.tracing"):
        assert tracing.setup_tracing("router") is False
    assert "not installed" in caplog.text
    assert not tracing.active()
    with tracing.inference_span("chat", {"tollgate.request_id": "r"}) as call:
        assert call is None and tracing.current_call() is None
        with tracing.span("worker.serve") as plain:
            assert plain is None
        assert tracing.inject({"a": "b"}) == {"a": "b"}
        assert tracing.current_ids() is None
        line = _format(JsonFormatter("router"), "no trace")
    assert "trace_id" not in line and "span_id" not in line
    tracing.shutdown()  # nothing to stop


def test_tracing_is_on_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "OTEL_TRACES_EXPORTER",
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        "OTEL_SDK_DISABLED",
    ):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.enabled()
    assert tracing.setup_tracing("router") is False
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://127.0.0.1:9/v1/traces")
    assert tracing.enabled()
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not tracing.enabled()
