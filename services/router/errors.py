"""One error hierarchy for the edge and one function that renders it.

Every error a client sees is OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}`` with the right status.
Nothing internal (tracebacks, reprs) is ever rendered.
"""

from __future__ import annotations

import orjson
from aiohttp import web

from tollgate.wire import errors as wire_errors


class TollgateError(Exception):
    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code
        self.headers = headers or {}

    def body(self) -> wire_errors.ErrorBody:
        return wire_errors.error_body(self.message, self.type, self.param, self.code)


class InvalidRequest(TollgateError):
    status = 400
    type = "invalid_request_error"


class PermissionDenied(TollgateError):
    """The key is valid but may not do what the request asks (403)."""

    status = 403
    type = "invalid_request_error"
    code = "permission_denied"


class ModelNotFound(TollgateError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"

    def __init__(self, model: str) -> None:
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.",
            param="model",
        )


class NotFound(TollgateError):
    status = 404
    type = "invalid_request_error"
    code = "not_found"


class MethodNotAllowed(TollgateError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class RequestTimeout(TollgateError):
    """The request body did not arrive in time (a client trickling it)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class ClientClosedRequest(TollgateError):
    """The client went away before its request was read: nobody reads the answer (499)."""

    status = 499
    type = "invalid_request_error"
    code = "client_closed_request"


class PayloadTooLarge(TollgateError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class UnsupportedMediaType(TollgateError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class RateLimited(TollgateError):
    status = 429
    type = "requests"
    code = "rate_limit_exceeded"


class QuotaExceeded(TollgateError):
    status = 429
    type = "insufficient_quota"
    code = "insufficient_quota"


class ServiceUnavailable(TollgateError):
    status = 503
    type = "service_unavailable"
    code = "no_capacity"


class UsageUnrecorded(ServiceUnavailable):
    """The router cannot journal the call's usage (its outbox cannot be written):
    the call is stopped, as a call this router could not bill must not run."""

    code = "usage_unavailable"

    def __init__(self, retry_after_s: int) -> None:
        super().__init__(
            "This request cannot be served right now: its usage cannot be recorded. Please retry.",
            headers={"Retry-After": str(retry_after_s)},
        )


class Overloaded(TollgateError):
    """The model's queue is full: refused at once, with a Retry-After (not accepted)."""

    status = 503
    type = "service_unavailable"
    code = "model_overloaded"


class WorkerLost(TollgateError):
    status = 502
    type = "server_error"
    code = "worker_lost"


class DeadlineExceeded(TollgateError):
    status = 504
    type = "timeout"
    code = "deadline_exceeded"


class InternalError(TollgateError):
    status = 500
    type = "server_error"
    code = "internal_error"


def error_body(exc: BaseException, anthropic: bool = False) -> tuple[int, bytes, dict[str, str]]:
    """Status, JSON body and headers for any exception (``anthropic``: Anthropic's shape)."""
    if not isinstance(exc, TollgateError):
        exc = InternalError("The server had an error while processing your request.")
    if anthropic:
        body = wire_errors.anthropic_error_body(exc.status, exc.message)
        return exc.status, orjson.dumps(body), exc.headers
    return exc.status, orjson.dumps(exc.body()), exc.headers


def error_response(
    exc: BaseException, request_id: str | None = None, anthropic: bool = False
) -> web.Response:
    status, body, headers = error_body(exc, anthropic)
    if request_id:
        headers = {**headers, "x-request-id": request_id}
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def sse_error_event(exc: BaseException, anthropic: bool = False) -> bytes:
    """The same error as an SSE event, for a stream whose headers are sent."""
    _, body, _ = error_body(exc, anthropic)
    if anthropic:
        return b"event: error\ndata: " + body + b"\n\n"
    return b"data: " + body + b"\n\n"
