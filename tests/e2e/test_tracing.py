"""OpenTelemetry tracing end to end: the GenAI spans of the router, as a collector receives them.

The router and a worker export through the real OTLP/HTTP exporter to a small
in-process receiver (aiohttp, decoding ``ExportTraceServiceRequest`` with
opentelemetry-proto). A chat call, streamed and not, and failing calls must
arrive as spans with the GenAI semantic conventions' attributes and the right
values, one trace from the router to the worker, and the router's log lines
about a call must name its trace.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.proto.trace.v1.trace_pb2 import Span, Status

from tests.conftest import OBSERVED_MODEL, ORPHAN_MODEL, Service, Stack, wait_ready
from tests.lib.net import free_port

# Words no attribute may carry: the prompt is private.
SECRET_PROMPT = "zebra-quartz-marmalade say hi"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind) if kind else None


@dataclass
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    status: int


@dataclass
class Collector:
    """An OTLP/HTTP trace receiver: every span it is sent, decoded."""

    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    requests: int = 0
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def receive(self, request: web.Request) -> web.Response:
        export = ExportTraceServiceRequest()
        export.ParseFromString(await request.read())  # aiohttp undoes a gzip encoding
        async with self._changed:
            self.requests += 1
            for resource_spans in export.resource_spans:
                resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            ReceivedSpan(
                                service=resource.get("service.name", ""),
                                name=span.name,
                                kind=span.kind,
                                trace_id=span.trace_id.hex(),
                                span_id=span.span_id.hex(),
                                parent_id=span.parent_span_id.hex(),
                                attributes={a.key: _value(a.value) for a in span.attributes},
                                status=span.status.code,
                            )
                        )
            self._changed.notify_all()
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    async def wait_for(
        self, found: Callable[[list[ReceivedSpan]], list[ReceivedSpan]], timeout: float = 30
    ) -> list[ReceivedSpan]:
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: bool(found(self.spans)))
        return found(self.spans)

    async def call_spans(self, request_id: str, worker: bool = True) -> dict[str, ReceivedSpan]:
        """The router's span of a call, and the worker's when ``worker``."""

        def of_call(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
            mine = [s for s in spans if s.attributes.get("tollgate.request_id") == request_id]
            services = {s.service for s in mine}
            wanted = {"tollgate-router", "tollgate-worker"} if worker else {"tollgate-router"}
            return mine if wanted <= services else []

        found = await self.wait_for(of_call)
        by_service: dict[str, ReceivedSpan] = {}
        for span in found:
            assert span.service not in by_service, f"two spans of {span.service}: {found}"
            by_service[span.service] = span
        return by_service


@pytest.fixture(scope="module")
async def collector() -> AsyncIterator[Collector]:
    collector = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", collector.receive)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    collector.url = f"http://127.0.0.1:{port}"
    try:
        yield collector
    finally:
        await runner.cleanup()


@dataclass
class Traced:
    router: Service
    url: str
    worker: Service


@pytest.fixture(scope="module")
async def traced(stack: Stack, collector: Collector, api_key: str) -> AsyncIterator[Traced]:
    """A router and a worker that export their spans to the collector."""
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector.url,
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "50",  # milliseconds: spans leave at once
    }
    # a short queue timeout: a model no worker serves answers 503 within a second
    router, url = stack.router(TOLLGATE_ROUTER_QUEUE_TIMEOUT_S="1", **env)
    worker = stack.worker(OBSERVED_MODEL, **env)
    try:
        await wait_ready(stack.nats, OBSERVED_MODEL, timeout=120)
        yield Traced(router, url, worker)
    finally:
        worker.stop()
        router.stop()


def _log_lines(service: Service, request_id: str) -> list[dict[str, Any]]:
    lines = []
    for line in service.log_text().splitlines():
        if line.startswith("{") and request_id in line:
            entry = json.loads(line)
            if entry.get("request_id") == request_id:
                lines.append(entry)
    return lines


def _assert_logs_name_the_trace(service: Service, span: ReceivedSpan, request_id: str) -> None:
    lines = _log_lines(service, request_id)
    assert lines, f"no log line about {request_id}"
    for entry in lines:
        assert entry.get("trace_id") == span.trace_id, entry
        assert entry.get("span_id") == span.span_id, entry


def _assert_no_content(spans: list[ReceivedSpan], *texts: str) -> None:
    for span in spans:
        for key, value in span.attributes.items():
            for text in filter(None, texts):
                assert text not in json.dumps(value), f"{span.name} {key} carries content"


async def _call(url: str, api_key: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=30) as client:
        return await client.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json=body,
        )


def _deltas(events: list[dict[str, Any]]) -> dict[int, list[str]]:
    texts: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            texts.setdefault(choice["index"], []).append(choice["delta"].get("content") or "")
    return texts


def _chat(model: str, content: str = "hi", **fields: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **fields}


SAMPLING = {
    "max_tokens": 7,
    "temperature": 0.5,
    "top_p": 0.9,
    "frequency_penalty": 0.25,
    "presence_penalty": -0.5,
    "seed": 1234,
    "stop": ["never-in-the-reply"],
    "n": 2,
}


def _assert_request_attributes(attributes: dict[str, Any]) -> None:
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "tollgate"
    assert attributes["gen_ai.request.model"] == OBSERVED_MODEL
    assert attributes["gen_ai.request.max_tokens"] == 7
    assert attributes["gen_ai.request.temperature"] == 0.5
    assert attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.frequency_penalty"] == 0.25
    assert attributes["gen_ai.request.presence_penalty"] == -0.5
    assert attributes["gen_ai.request.seed"] == 1234
    assert attributes["gen_ai.request.stop_sequences"] == ["never-in-the-reply"]
    assert attributes["gen_ai.request.choice.count"] == 2


@pytest.mark.timeout(180)
async def test_a_chat_call_is_one_genai_span_and_the_worker_continues_its_trace(
    traced: Traced, collector: Collector, api_key: str
) -> None:
    body = {"model": OBSERVED_MODEL, "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    r = await _call(traced.url, api_key, {**body, **SAMPLING})
    assert r.status_code == 200, r.text
    answer = r.json()
    request_id = r.headers["x-request-id"]

    spans = await collector.call_spans(request_id)
    edge, served = spans["tollgate-router"], spans["tollgate-worker"]
    assert edge.name == f"chat {OBSERVED_MODEL}"
    assert edge.kind == Span.SpanKind.SPAN_KIND_SERVER
    assert edge.status == Status.StatusCode.STATUS_CODE_UNSET
    attributes = edge.attributes
    _assert_request_attributes(attributes)
    assert "gen_ai.request.stream" not in attributes
    assert attributes["gen_ai.response.id"] == answer["id"]
    assert attributes["gen_ai.response.model"] == answer["model"]
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    assert len(choices) == 2
    assert attributes["gen_ai.response.finish_reasons"] == [c["finish_reason"] for c in choices]
    assert attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"] > 0
    port = int(traced.url.rsplit(":", 1)[1])
    assert attributes["server.address"] == "127.0.0.1"
    assert attributes["server.port"] == port
    assert attributes["http.response.status_code"] == 200
    assert "error.type" not in attributes
    # the worker's span continues the router's trace, as its child
    assert served.trace_id == edge.trace_id
    assert served.parent_id == edge.span_id
    # no prompt and no completion on any span
    replies = [c["message"]["content"] for c in choices if c["message"]["content"]]
    _assert_no_content([edge, served], SECRET_PROMPT, *replies)
    _assert_logs_name_the_trace(traced.router, edge, request_id)


@pytest.mark.timeout(180)
async def test_a_streamed_chat_call_has_the_same_attributes(
    traced: Traced, collector: Collector, api_key: str
) -> None:
    body = {
        "model": OBSERVED_MODEL,
        "messages": [{"role": "user", "content": SECRET_PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
        **SAMPLING,
    }
    events: list[dict[str, Any]] = []
    async with (
        httpx.AsyncClient(timeout=30) as client,
        client.stream(
            "POST",
            f"{traced.url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json=body,
        ) as r,
    ):
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
    finish = {
        c["index"]: c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]
    }
    usage = next(e["usage"] for e in events if e.get("usage"))
    assert sorted(finish) == [0, 1]

    spans = await collector.call_spans(request_id)
    edge = spans["tollgate-router"]
    assert edge.name == f"chat {OBSERVED_MODEL}"
    attributes = edge.attributes
    _assert_request_attributes(attributes)
    assert attributes["gen_ai.request.stream"] is True
    assert attributes["gen_ai.response.id"] == events[0]["id"]
    assert attributes["gen_ai.response.model"] == events[0]["model"]
    assert attributes["gen_ai.response.finish_reasons"] == [finish[0], finish[1]]
    assert attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"] > 0
    assert attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"] > 0
    assert attributes["http.response.status_code"] == 200
    assert "error.type" not in attributes
    assert spans["tollgate-worker"].parent_id == edge.span_id
    replies = ["".join(texts) for texts in _deltas(events).values()]
    _assert_no_content(list(spans.values()), SECRET_PROMPT, *replies)
    _assert_logs_name_the_trace(traced.router, edge, request_id)


@pytest.mark.timeout(180)
async def test_failing_calls_name_their_error(
    traced: Traced, collector: Collector, api_key: str
) -> None:
    # refused at the edge, before a model is known: the span is named by its operation only
    r = await _call(
        traced.url,
        api_key,
        _chat("no-such-model"),
    )
    assert r.status_code == 404
    edge = (await collector.call_spans(r.headers["x-request-id"], worker=False))["tollgate-router"]
    assert edge.name == "chat"
    assert edge.attributes["error.type"] == "model_not_found"
    assert edge.attributes["http.response.status_code"] == 404
    assert edge.attributes["gen_ai.operation.name"] == "chat"
    assert "gen_ai.request.model" not in edge.attributes
    # a client error is not the server's: the span's status stays unset
    assert edge.status == Status.StatusCode.STATUS_CODE_UNSET
    _assert_logs_name_the_trace(traced.router, edge, r.headers["x-request-id"])

    # refused by the engine (a prompt longer than the model's context): its error type
    long_prompt = "hello " * 3000
    r = await _call(
        traced.url,
        api_key,
        {"model": OBSERVED_MODEL, "messages": [{"role": "user", "content": long_prompt}], "n": 2},
    )
    assert r.status_code == 400, r.text
    error_type = r.json()["error"]["type"]
    spans = await collector.call_spans(r.headers["x-request-id"])
    edge = spans["tollgate-router"]
    assert edge.name == f"chat {OBSERVED_MODEL}"
    assert edge.attributes["error.type"] == error_type == "BadRequestError"
    assert edge.attributes["http.response.status_code"] == 400
    # both choices expected, none generated: each reported as an error
    assert edge.attributes["gen_ai.response.finish_reasons"] == ["error", "error"]
    assert edge.status == Status.StatusCode.STATUS_CODE_UNSET
    _assert_no_content(list(spans.values()), "hello hello")
    _assert_logs_name_the_trace(traced.router, edge, r.headers["x-request-id"])

    # no worker takes it within the queue timeout: 503, a server-side failure
    r = await _call(
        traced.url,
        api_key,
        _chat(ORPHAN_MODEL),
    )
    assert r.status_code == 503
    edge = (await collector.call_spans(r.headers["x-request-id"], worker=False))["tollgate-router"]
    assert edge.name == f"chat {ORPHAN_MODEL}"
    assert edge.attributes["error.type"] == "no_capacity"
    assert edge.attributes["http.response.status_code"] == 503
    assert edge.attributes["gen_ai.response.finish_reasons"] == ["error"]
    assert edge.status == Status.StatusCode.STATUS_CODE_ERROR
    _assert_logs_name_the_trace(traced.router, edge, r.headers["x-request-id"])


async def test_tracing_is_off_without_otel_settings(
    stack: Stack, router_url: str, api_key: str
) -> None:
    """The session's router runs without OTEL_*: no tracing, and no trace id in its logs."""
    r = await _call(
        router_url,
        api_key,
        _chat("no-such-model"),
    )
    assert r.status_code == 404
    port = router_url.rsplit(":", 1)[1]
    router = next(s for s in stack.services if s.name == "router" and port in s.proc.args)
    lines = _log_lines(router, r.headers["x-request-id"])
    assert lines, "the refused call is logged"
    assert all("trace_id" not in line and "span_id" not in line for line in lines), lines
    assert '"tracing on"' not in router.log_text()
