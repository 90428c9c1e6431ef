"""The OpenAI error body, built in one place.

Every error a client sees, whoever writes it (the router's edge, the auth
admin API, a worker's serving layer relayed untouched), has the shape
``{"error": {"message", "type", "param", "code"}}``. ``code`` is a string for
Tollgate's own errors; vLLM's serving layer puts the HTTP status there as an
int, and a worker that mimics it does the same.
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
