"""Optional OpenTelemetry tracing, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or
``console``) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). The SDK and the exporters come with
the ``otel`` extra (``pip install 'tollgate[otel]'``); without them, or with
tracing off, every call here is a no-op and nothing of OpenTelemetry is
imported.

The router opens one span per inference call (:func:`inference_span`) with
the OpenTelemetry GenAI semantic conventions (``gen_ai.*``), and sends its
context in the inference request's NATS headers (``traceparent``); the
worker continues it. No prompt or completion text is ever put on a span:
only the request's settings, the response's id, model and finish reasons,
and the engine's token counts. While a span is current, every log line
carries its ``trace_id`` and ``span_id`` (:func:`current_ids`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from typing import Any

import orjson

log = logging.getLogger("tollgate.runtime.tracing")

_tracer: Any = None
_provider: Any = None
_get_current_span: Callable[[], Any] | None = None

# The GenAI semantic conventions' attributes (semantic-conventions-genai,
# docs/gen-ai/client-inference.md), and the general ones the spans carry.
OPERATION_NAME = "gen_ai.operation.name"
PROVIDER_NAME = "gen_ai.provider.name"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
REQUEST_TEMPERATURE = "gen_ai.request.temperature"
REQUEST_TOP_P = "gen_ai.request.top_p"
REQUEST_TOP_K = "gen_ai.request.top_k"
REQUEST_FREQUENCY_PENALTY = "gen_ai.request.frequency_penalty"
REQUEST_PRESENCE_PENALTY = "gen_ai.request.presence_penalty"
REQUEST_SEED = "gen_ai.request.seed"
REQUEST_STOP_SEQUENCES = "gen_ai.request.stop_sequences"
REQUEST_CHOICE_COUNT = "gen_ai.request.choice.count"
REQUEST_STREAM = "gen_ai.request.stream"
OUTPUT_TYPE = "gen_ai.output.type"
RESPONSE_ID = "gen_ai.response.id"
RESPONSE_MODEL = "gen_ai.response.model"
RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
HTTP_METHOD = "http.request.method"
HTTP_ROUTE = "http.route"
HTTP_STATUS = "http.response.status_code"

# The provider as the caller sees it: Tollgate serves the models and answers
# for them (its counts are what a key is billed); the engine behind it (vLLM,
# or the simulated engine) is a worker's detail the router does not know.
PROVIDER = "tollgate"

# The finish reason of a choice that never got one (the call failed or was
# cancelled), as the conventions ask.
MISSING_FINISH_REASON = "error"


def enabled() -> bool:
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none" or os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
    )
    return bool(exporter or endpoint)


def setup_tracing(service: str) -> bool:
    """Install a tracer provider for ``service`` when the environment asks for one."""
    if not enabled():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SimpleSpanProcessor,
        )
    except ImportError:
        log.warning(
            "OTEL_* is set but the OpenTelemetry SDK is not installed "
            "(pip install 'tollgate[otel]'): no tracing"
        )
        return False
    name = os.environ.get("OTEL_SERVICE_NAME") or f"tollgate-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        # one span per line, so a log file stays line-oriented
        exporter = ConsoleSpanExporter(formatter=lambda span: span.to_json(indent=None) + "\n")
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
        try:
            if protocol.startswith("http"):
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )
            else:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                    OTLPSpanExporter,
                )
        except ImportError:
            log.warning(
                "the OTLP exporter for %s is not installed (pip install 'tollgate[otel]'): "
                "no tracing",
                protocol,
            )
            return False
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    # Global too, so that a library's own instrumentation joins the same traces.
    trace.set_tracer_provider(provider)
    use_provider(provider)
    log.info("tracing on", extra={"exporter": kind, "service_name": name})
    return True


def use_provider(provider: Any) -> None:
    """Trace with ``provider`` (an SDK ``TracerProvider``); None turns tracing off.

    :func:`setup_tracing` calls it; a test or an embedding program may call it
    with a provider of its own (an in-memory exporter, say).
    """
    global _tracer, _provider, _get_current_span
    if provider is None:
        _tracer = _provider = _get_current_span = None
        return
    from opentelemetry import trace

    _provider = provider
    _tracer = provider.get_tracer("tollgate")
    _get_current_span = trace.get_current_span


def active() -> bool:
    """Whether spans are recorded (a provider is in use)."""
    return _tracer is not None


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (attributes or {}).items() if v is not None}


@contextlib.contextmanager
def span(
    name: str, attributes: Mapping[str, Any] | None = None, parent: Mapping[str, str] | None = None
) -> Iterator[Any]:
    """A span (child of the context in ``parent`` headers, if given); None when off."""
    if _tracer is None:
        yield None
        return
    from opentelemetry.propagate import extract

    context = extract(dict(parent)) if parent else None
    with _tracer.start_as_current_span(name, context=context, attributes=_clean(attributes)) as cur:
        yield cur


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's context (``traceparent``) to message headers."""
    if _tracer is not None:
        from opentelemetry.propagate import inject as otel_inject

        otel_inject(headers)
    return headers


def current_ids() -> tuple[str, str] | None:
    """The current span's trace and span ids in hex (W3C form), or None.

    None when tracing is off or no span is current: a log line written while
    a traced call is handled carries them, others do not.
    """
    if _get_current_span is None:
        return None
    context = _get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")


def shutdown() -> None:
    """Export what is pending and stop tracing."""
    provider = _provider
    if provider is None:
        return
    use_provider(None)
    with contextlib.suppress(Exception):
        provider.shutdown()


# -- GenAI inference spans ----------------------------------------------------

_current_call: ContextVar[InferenceSpan | None] = ContextVar(
    "tollgate_inference_span", default=None
)


@contextlib.contextmanager
def inference_span(
    operation: str, attributes: Mapping[str, Any] | None = None
) -> Iterator[InferenceSpan | None]:
    """The span of one inference call served here; None when tracing is off.

    A SERVER span: it is the call as the gateway received it, the root of
    the call's trace (the worker's span is its child). It is named
    ``{operation}`` until :meth:`InferenceSpan.request` knows the model, then
    ``{operation} {model}``, as the GenAI conventions name it. While it is
    open, :func:`current_call` returns it, so the code that follows the call
    sets its attributes without being handed it.
    """
    if _tracer is None:
        yield None
        return
    from opentelemetry.trace import SpanKind

    attrs = {OPERATION_NAME: operation, PROVIDER_NAME: PROVIDER, **_clean(attributes)}
    with _tracer.start_as_current_span(operation, kind=SpanKind.SERVER, attributes=attrs) as cur:
        call = InferenceSpan(cur, operation)
        token = _current_call.set(call)
        try:
            yield call
        except BaseException as exc:
            call.fail(type(exc).__qualname__)
            raise
        finally:
            _current_call.reset(token)


def current_call() -> InferenceSpan | None:
    """The inference span open in this context (None: tracing off, or no call)."""
    return _current_call.get()


# A choice's finish reason in an SSE event, when it is set (a string, not null).
_FINISH_REASON = re.compile(r'"finish_reason"\s*:\s*"')


class InferenceSpan:
    """Sets the GenAI attributes of one call's span from what the call sees.

    It reads the request's settings, the response's id, model and finish
    reasons (from the bodies the router relays, never their text), the
    engine's token counts, and how the call ended.
    """

    def __init__(self, otel_span: Any, operation: str) -> None:
        self.span = otel_span
        self.operation = operation
        self.choices = 1
        self._finish_reasons: dict[int, str] = {}
        self._seen_response = False
        self._error_type: str | None = None

    def set(self, key: str, value: Any) -> None:
        """One attribute of the call's own (``tollgate.*``); None sets nothing."""
        if value is not None:
            self.span.set_attribute(key, value)

    # -- the request

    def request(self, model: str, body: Mapping[str, Any], choices: int = 1) -> None:
        """The model asked for and the request's settings (no prompt, no messages).

        ``choices`` is how many generations the response holds (``n`` per prompt).
        """
        self.choices = choices
        self.span.update_name(f"{self.operation} {model}")
        self.span.set_attributes(_clean(request_attributes(self.operation, model, body)))

    # -- the response

    def response_body(self, text: str) -> None:
        """A whole JSON response body (a call that is not streamed)."""
        try:
            body = orjson.loads(text)
        except orjson.JSONDecodeError:
            return
        if isinstance(body, dict):
            self._response_fields(body)
            self._choices(body.get("choices"))

    def response_event(self, text: str) -> None:
        """One SSE event of a streamed response (``data: {...}``).

        Only the first event (for the response's id and model) and the events
        that set a finish reason are parsed: the others pass untouched.
        """
        if self._seen_response and _FINISH_REASON.search(text) is None:
            return
        start = text.find("{")
        if start < 0:
            return  # data: [DONE], or a comment
        try:
            event = orjson.loads(text[start:])
        except orjson.JSONDecodeError:
            return
        if isinstance(event, dict):
            if not self._seen_response:
                self._response_fields(event)
            self._choices(event.get("choices"))

    def worker_error(self, text: str) -> None:
        """An error response from the engine's serving layer: its type is the error's type."""
        error_type = "error"
        with contextlib.suppress(orjson.JSONDecodeError):
            body = orjson.loads(text.encode().removeprefix(b"data: "))
            error = body.get("error") if isinstance(body, dict) else None
            value = error.get("type") if isinstance(error, dict) else None
            if isinstance(value, str) and value:
                error_type = value[:MAX_ATTRIBUTE_CHARS]
        self.fail(error_type)

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        """The engine's own counts: those a key is billed for."""
        self.span.set_attributes(
            {USAGE_INPUT_TOKENS: input_tokens, USAGE_OUTPUT_TOKENS: output_tokens}
        )

    def _response_fields(self, body: Mapping[str, Any]) -> None:
        self._seen_response = True
        for key, attribute in (("id", RESPONSE_ID), ("model", RESPONSE_MODEL)):
            value = body.get(key)
            if isinstance(value, str):
                self.span.set_attribute(attribute, value[:MAX_ATTRIBUTE_CHARS])

    def _choices(self, choices: Any) -> None:
        if not isinstance(choices, list):
            return
        changed = False
        for position, choice in enumerate(choices):
            if not isinstance(choice, dict):
                continue
            reason = choice.get("finish_reason")
            index = choice.get("index", position)
            if isinstance(reason, str) and isinstance(index, int) and 0 <= index < 1 << 16:
                self._finish_reasons[index] = reason[:MAX_ATTRIBUTE_CHARS]
                changed = True
        if changed:
            self._set_finish_reasons(fill=False)

    def _set_finish_reasons(self, fill: bool) -> None:
        reasons = self._finish_reasons
        if fill:
            count = max(self.choices, max(reasons, default=-1) + 1)
            values = [reasons.get(i, MISSING_FINISH_REASON) for i in range(count)]
        else:
            values = [reasons[i] for i in sorted(reasons)]
        if values:
            self.span.set_attribute(RESPONSE_FINISH_REASONS, values)

    # -- the ending

    def fail(self, error_type: str) -> None:
        """The call failed; the first cause named is kept."""
        if self._error_type is None:
            self._error_type = error_type
            self.span.set_attribute(ERROR_TYPE, error_type)

    def ended(self, status: int, error_type: str | None = None) -> None:
        """The call ended with HTTP ``status``; ``error_type`` when it did not succeed.

        A choice that never got a finish reason is reported as ``error``. The
        span's status is an error for a server-side failure (5xx) only: a
        refused or cancelled call is the client's, as HTTP server spans count it.
        """
        self.span.set_attribute(HTTP_STATUS, status)
        if error_type is None and status >= 400:
            error_type = str(status)  # as HTTP spans name an error without a cause
        if error_type is not None:
            self.fail(error_type)
        if self._error_type is not None:
            self._set_finish_reasons(fill=True)
        if status >= 500:
            from opentelemetry.trace import Status, StatusCode

            self.span.set_status(Status(StatusCode.ERROR, self._error_type))


def request_attributes(operation: str, model: str, body: Mapping[str, Any]) -> dict[str, Any]:
    """The GenAI request attributes of an OpenAI-shaped request body.

    Values the edge has checked but not rewritten (a lax ``"0.5"``) are
    converted; a value that cannot be is left out. ``max_tokens`` is the
    limit the client set (``max_completion_tokens`` first on chat), none
    when it set none.
    """
    limit = body.get("max_tokens")
    if operation == "chat" and body.get("max_completion_tokens") is not None:
        limit = body.get("max_completion_tokens")
    choices = _int(body.get("n"))
    output = body.get("response_format")
    output_kind = output.get("type") if isinstance(output, dict) else None
    return {
        REQUEST_MODEL: model,
        REQUEST_MAX_TOKENS: _int(limit),
        REQUEST_TEMPERATURE: _float(body.get("temperature")),
        REQUEST_TOP_P: _float(body.get("top_p")),
        REQUEST_TOP_K: _int(body.get("top_k")),
        REQUEST_FREQUENCY_PENALTY: _float(body.get("frequency_penalty")),
        REQUEST_PRESENCE_PENALTY: _float(body.get("presence_penalty")),
        REQUEST_SEED: _int(body.get("seed")),
        REQUEST_STOP_SEQUENCES: _strings(body.get("stop")),
        # set when not 1, as the conventions ask
        REQUEST_CHOICE_COUNT: choices if choices is not None and choices != 1 else None,
        REQUEST_STREAM: True if body.get("stream") is True else None,
        OUTPUT_TYPE: _OUTPUT_TYPES.get(output_kind) if isinstance(output_kind, str) else None,
    }


_OUTPUT_TYPES = {"text": "text", "json_object": "json", "json_schema": "json"}


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return int(value)
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


# A span stays small whatever a body holds: the stop sequences it lists, and
# how long each may be (vLLM bounds neither).
MAX_STOP_SEQUENCES = 16
MAX_ATTRIBUTE_CHARS = 256


def _strings(value: Any) -> list[str] | None:
    if isinstance(value, str):
        value = [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return [v[:MAX_ATTRIBUTE_CHARS] for v in value[:MAX_STOP_SEQUENCES]]
    return None
