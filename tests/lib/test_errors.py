"""One OpenAI error body: the library builds it, every service that writes one uses it."""

from __future__ import annotations

import orjson
from aiohttp import web

from services.auth.app import _error as auth_error
from services.router.errors import InvalidRequest, ModelNotFound
from services.worker.simulated import Refused
from tollgate.wire.errors import error_body, error_json

KEYS = {"message", "type", "param", "code"}


def test_every_key_is_present_even_when_empty() -> None:
    body = error_body("bad", "invalid_request_error")
    assert body == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": None, "code": None}
    }


def test_json_variant_is_the_same_body() -> None:
    args = ("too long", "invalid_request_error", "max_tokens", "context_length_exceeded")
    assert orjson.loads(error_json(*args)) == error_body(*args)


def test_router_errors_use_the_builder() -> None:
    assert InvalidRequest("bad", param="n").body() == error_body(
        "bad", "invalid_request_error", "n"
    )
    error = ModelNotFound("x").body()["error"]
    assert set(error) == KEYS and error["code"] == "model_not_found"


def test_auth_errors_keep_their_status_and_shape() -> None:
    response = auth_error(404, "No such key.", "not_found")
    assert response.status == 404 and response.content_type == "application/json"
    assert orjson.loads(_body(response)) == error_body(
        "No such key.", "invalid_request_error", code="not_found"
    )
    failed = orjson.loads(_body(auth_error(500, "The auth service had an error.")))
    assert failed["error"]["type"] == "server_error"


def test_simulated_engine_mimics_vllm_with_an_int_code() -> None:
    result = Refused("messages must be a non-empty list", param="messages").result()
    assert result.status == 400
    assert orjson.loads(result.body) == error_body(
        "messages must be a non-empty list", "BadRequestError", "messages", 400
    )


def _body(response: web.Response) -> bytes:
    assert isinstance(response.body, bytes)
    return response.body
