"""The OpenAI error body, built in one place.

Every error a client sees, whoever writes it (the router's edge, the auth
admin API, a worker's serving layer relayed untouched), has the shape
``{"error": {"message", "type", "param", "code"}}``. ``code`` is a string for
Tollgate's own errors; vLLM's serving layer puts the HTTP status there as an
int, and a worker that mimics it does the same.

Anthropic's Messages API (``/v1/messages``) has its own shape,
``{"type": "error", "error": {"type", "message"}}``, with a type per HTTP
status: :func:`anthropic_error_body`.
"""

from __future__ import annotations

import orjson

ErrorBody = dict[str, dict[str, str | int | None]]


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> ErrorBody:
    """``{"error": {"message", "type", "param", "code"}}`` (every key always present)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_json(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> bytes:
    """The same body as JSON bytes."""
    return orjson.dumps(error_body(message, type, param, code))


# Anthropic's error types by HTTP status.
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict[str, object]:
    """``{"type": "error", "error": {"type", "message"}}``, Anthropic's error body."""
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}
