"""Optional OpenTelemetry tracing, configured by the standard ``OTEL_*`` variables.

Off unless ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp`` or
``console``) or an OTLP endpoint is set (``OTEL_EXPORTER_OTLP_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``). The router opens a span per request
and sends its context in the inference request's NATS headers
(``traceparent``); the worker continues it. Without the SDK installed, or
with tracing off, every call here is a no-op.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping
from typing import Any

log = logging.getLogger("tollgate.runtime.tracing")

_tracer: Any = None


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
    global _tracer
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
        log.warning("OTEL_* is set but the OpenTelemetry SDK is not installed: no tracing")
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
        if protocol.startswith("http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[assignment]
                OTLPSpanExporter,
            )
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("tollgate")
    log.info("tracing on", extra={"exporter": kind, "service_name": name})
    return True


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
    attrs = {k: v for k, v in (attributes or {}).items() if v is not None}
    with _tracer.start_as_current_span(name, context=context, attributes=attrs) as current:
        yield current


def inject(headers: dict[str, str]) -> dict[str, str]:
    """Add the current span's context (``traceparent``) to message headers."""
    if _tracer is not None:
        from opentelemetry.propagate import inject as otel_inject

        otel_inject(headers)
    return headers


def shutdown() -> None:
    if _tracer is None:
        return
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    with contextlib.suppress(Exception):
        provider.shutdown()  # type: ignore[attr-defined]
