"""HTTP handlers: a few lines each, JSON or SSE.

The logic is in serving.py; how an accepted call ends (its cancel, its usage
event) is owned by lifecycle.CallLife, which the call handlers enter.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from services.router.affinity import SESSION_HEADER
from services.router.appkeys import (
    CATALOG,
    KEYS,
    METRICS,
    SERVING,
    SETTINGS,
    STARTED_AT,
)
from services.router.auth import PRIORITY_HEADER, Principal, request_priority
from services.router.capture import replay_exempt
from services.router.dispatch import Call
from services.router.endpoints import SPECS
from services.router.errors import (
    ClientClosedRequest,
    InvalidRequest,
    ModelNotFound,
    PayloadTooLarge,
    RequestTimeout,
    ServiceUnavailable,
    TollgateError,
    UnsupportedMediaType,
    error_response,
    sse_error_event,
)
from services.router.lifecycle import CallLife, ClientGone, Keepalive
from tollgate.models.catalog import Catalog, Target
from tollgate.runtime import tracing
from tollgate.runtime.httpserver import BodyTimeout
from tollgate.runtime.logs import request_id_var
from tollgate.wire.contracts import ChunkKind, Endpoint
from tollgate.wire.errors import anthropic_error_body

log = logging.getLogger("tollgate.router")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_DONE_TEXT = "data: [DONE]"


# Bodies aiohttp decodes itself, its decompressed size bounded by max_body_bytes
# like any other body (request.read counts what it returns).
_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


async def _read_body(request: web.Request) -> bytes:
    # the header as SDKs send it is taken as it is; any other is parsed
    if (
        request.headers.get("Content-Type") != "application/json"
        and request.content_type != "application/json"
    ):
        raise UnsupportedMediaType("Content-Type must be application/json.")
    if request.headers.get("Content-Encoding", "").strip().lower() not in _ENCODINGS:
        raise UnsupportedMediaType(
            "Content-Encoding must be gzip, deflate or identity.",
            code="unsupported_content_encoding",
        )
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[SETTINGS].max_body_bytes
        raise PayloadTooLarge(f"The request body is larger than {limit} bytes.") from None
    except BodyTimeout as exc:
        raise RequestTimeout(str(exc)) from None
    except ConnectionResetError:
        raise ClientClosedRequest("The client closed the connection mid-request.") from None
    except web.RequestPayloadError:
        raise InvalidRequest(
            "The request body could not be read: it does not match its Content-Encoding, "
            "or its framing is invalid.",
            code="invalid_body",
        ) from None


def _headers(call: Call) -> dict[str, str]:
    """x-request-id, and the key's x-ratelimit-* headers as OpenAI sends them."""
    headers = {"x-request-id": call.request.request_id}
    if call.reservation is not None:
        headers.update(call.reservation.headers)
    return headers


def _gone(request_id: str) -> web.Response:
    """The reply to a client that hung up: nobody reads it (499, as nginx logs it)."""
    return web.Response(status=499, headers={"x-request-id": request_id})


def _closing(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _principal(request: web.Request) -> Principal | None:
    """The caller's key, or None when the router runs without auth."""
    if not request.app[SETTINGS].auth:
        return None
    return request.app[KEYS].authenticate(request)


def _visible(principal: Principal | None, target: Target) -> bool:
    return principal is None or principal.record.allows(target.names)


def call_handler(endpoint: Endpoint) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """The handler of one endpoint's calls (its path: ``endpoint.path``)."""

    async def handle(request: web.Request) -> web.StreamResponse:
        return await _relay(request, endpoint)

    handle.__name__ = f"call_{endpoint.name.lower()}"
    return handle


def _span_attributes(request: web.Request, endpoint: Endpoint, request_id: str) -> dict[str, Any]:
    """What a call's span knows before the body is read: the route and who was called."""
    attributes: dict[str, Any] = {
        "tollgate.request_id": request_id,
        tracing.HTTP_METHOD: request.method,
        tracing.HTTP_ROUTE: endpoint.path,
    }
    # The address the client called (its Host header), as HTTP server spans name it;
    # a Host that is not a valid authority leaves them out.
    try:
        url = request.url
        attributes[tracing.SERVER_ADDRESS] = url.host
        attributes[tracing.SERVER_PORT] = url.port
    except ValueError:
        pass
    return attributes


async def _relay(request: web.Request, endpoint: Endpoint) -> web.StreamResponse:
    request_id = uuid.uuid4().hex
    request_id_var.set(request_id)  # every log line about this call carries it
    attributes = _span_attributes(request, endpoint, request_id) if tracing.active() else None
    with tracing.inference_span(SPECS[endpoint].operation, attributes) as span:
        return await _serve_call(request, endpoint, request_id, span)


async def _serve_call(
    request: web.Request, endpoint: Endpoint, request_id: str, span: tracing.InferenceSpan | None
) -> web.StreamResponse:
    serving = request.app[SERVING]
    try:
        principal = _principal(request)
        prepared = serving.parse(endpoint, await _read_body(request))
        if span is not None:
            choices = SPECS[endpoint].generations(prepared.body)
            span.request(prepared.body["model"], prepared.body, choices)
            span.set("tollgate.tenant", principal.tenant if principal else "anonymous")
        if principal is not None:
            request.app[KEYS].authorize(principal, prepared.target, prepared.body["model"])
        # a replayed request (tollgate replay) is not captured again: only a replay key's
        replayed = replay_exempt(principal.record if principal else None, request.headers)
        priority = request_priority(
            principal.record if principal else None, request.headers.get(PRIORITY_HEADER)
        )
        call = await serving.submit(
            prepared,
            request_id,
            principal,
            capture=not replayed,
            priority=priority,
            session=request.headers.get(SESSION_HEADER),
        )
    except TollgateError as exc:
        if span is not None:
            span.ended(exc.status, exc.code or exc.type)
        if not isinstance(exc, ServiceUnavailable):  # an accepted request: counted when it ends
            request.app[METRICS].rejected.labels(exc.code or exc.type).inc()
        ending = "client closed the request" if exc.status == 499 else "request refused"
        log.info(ending, extra={"status": exc.status, "code": exc.code or exc.type})
        return error_response(exc, request_id, SPECS[endpoint].anthropic)
    life = serving.life(call, prepared)
    if prepared.stream:
        return await _stream(request, life, SPECS[endpoint].anthropic)
    return await _full(request, life, SPECS[endpoint].anthropic)


async def _full(request: web.Request, life: CallLife, anthropic: bool) -> web.StreamResponse:
    request_id = life.call.request.request_id
    body = b""
    try:
        async with life:
            async for item in life.events():
                if isinstance(item, Keepalive):
                    if _closing(request):
                        raise ClientGone
                    continue
                if item.kind is not ChunkKind.END and item.data is not None:
                    life.status = item.status or 200
                    data = item.data
                    if anthropic and life.status >= 400:
                        data = _anthropic_error(data, life.status)
                    body = data.encode()
    except TollgateError as exc:
        return error_response(exc, request_id, anthropic)
    except ClientGone:
        return _gone(request_id)
    return web.Response(
        status=life.status,
        body=body,
        content_type="application/json",
        headers=_headers(life.call),
    )


async def _stream(request: web.Request, life: CallLife, anthropic: bool) -> web.StreamResponse:
    call = life.call
    request_id = call.request.request_id
    response: web.StreamResponse | None = None
    inter_token = request.app[METRICS].inter_token.labels(call.request.model)
    last_output: float | None = None

    async def open_stream() -> web.StreamResponse:
        stream = web.StreamResponse(headers={**SSE_HEADERS, **_headers(call)})
        stream.content_type = "text/event-stream"
        await stream.prepare(request)
        return stream

    try:
        async with life:
            async for item in life.events():
                if isinstance(item, Keepalive):
                    if _closing(request):
                        raise ClientGone
                    if response is None:
                        response = await open_stream()
                    # An SSE comment: clients ignore it, proxies see a live connection.
                    await response.write(b": waiting\n\n" if call.worker_id is None else b": \n\n")
                    continue
                if item.kind is ChunkKind.END:
                    break
                if item.kind is ChunkKind.ERROR and response is None:
                    # The error came before any output: send it with its own status,
                    # as vllm serve does.
                    life.status = item.status or 500
                    data = item.data or ""
                    if anthropic:
                        data = _anthropic_error(data, life.status)
                    return web.Response(
                        status=life.status,
                        body=data.encode(),
                        content_type="application/json",
                        headers=_headers(call),
                    )
                if response is None:
                    response = await open_stream()
                if item.kind is ChunkKind.DATA and not (item.data or "").startswith(_DONE_TEXT):
                    now = time.monotonic()
                    if last_output is not None:
                        inter_token.observe(now - last_output)
                    last_output = now
                data = item.data or ""
                if item.kind is ChunkKind.ERROR:
                    # The engine failed mid-stream: end the stream as vLLM does.
                    data = (
                        f"event: error\ndata: {_anthropic_error(data, item.status or 500)}\n\n"
                        if anthropic
                        else f"data: {data}\n\ndata: [DONE]\n\n"
                    )
                await response.write(data.encode())
    except TollgateError as exc:
        if response is None:
            return error_response(exc, request_id, anthropic)
        try:
            end = b"" if anthropic else _DONE  # an Anthropic stream has no [DONE]
            await response.write(sse_error_event(exc, anthropic) + end)
        except ConnectionResetError:
            pass
        return response
    except (ClientGone, ConnectionResetError):
        return response if response is not None else _gone(request_id)
    assert response is not None
    await response.write_eof()
    return response


def _anthropic_error(data: str, status: int) -> str:
    """An engine's error body (OpenAI's shape, as vLLM's serving layer writes it) in
    Anthropic's, for ``/v1/messages``."""
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict) and body.get("type") == "error":
        return data  # already Anthropic's
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    text = message if isinstance(message, str) and message.strip() else "The request failed."
    return orjson.dumps(anthropic_error_body(status, text)).decode()


def _model_card(target: Target, created: int) -> dict[str, Any]:
    """A model's card; an adapter's names its base model as ``parent`` (as vllm serve does)."""
    entry, adapter = target
    return {
        "id": target.billed,
        "object": "model",
        "created": created,
        "owned_by": "tollgate",
        "max_model_len": entry.max_model_len,
        "aliases": adapter.aliases if adapter is not None else entry.aliases,
        "parent": entry.id if adapter is not None else None,
    }


async def list_models(request: web.Request) -> web.Response:
    created = request.app[STARTED_AT]
    catalog: Catalog = request.app[CATALOG]
    principal = _principal(request)
    targets = [Target(e) for e in catalog.models.values()]
    targets += [Target(catalog.models[a.base], a) for a in catalog.adapters.values()]
    data = [_model_card(t, created) for t in targets if _visible(principal, t)]
    return web.json_response({"object": "list", "data": data}, dumps=_dumps)


async def get_model(request: web.Request) -> web.Response:
    name = request.match_info["model"]
    target = request.app[CATALOG].target(name)
    principal = _principal(request)  # 401 comes before 404
    if target is None or not _visible(principal, target):
        return error_response(ModelNotFound(name))
    return web.json_response(_model_card(target, request.app[STARTED_AT]), dumps=_dumps)


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()
