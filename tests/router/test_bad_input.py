"""Bad input gets a clear OpenAI-shaped 4xx error, never a 500 or a traceback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import orjson
import pytest

from tests.conftest import SIM_MODEL

CHAT = "/v1/chat/completions"
GOOD = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]}


Post = Callable[..., httpx.Response]


@pytest.fixture
def post(router_url: str, auth_headers: dict[str, str]) -> Post:
    """POST to the router with a valid key (extra headers are added to it)."""

    def _post(path: str, **kwargs: Any) -> httpx.Response:
        headers = {**auth_headers, **kwargs.pop("headers", {})}
        return httpx.post(f"{router_url}{path}", timeout=10, headers=headers, **kwargs)

    return _post


def assert_openai_error(r: httpx.Response, status: int, *, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and "Traceback" not in r.text and 'File "' not in r.text
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"messages": GOOD["messages"]}, "model", "Missing required parameter"),
        ({"model": SIM_MODEL}, "messages", "Missing required parameter"),
        ({**GOOD, "messages": []}, "messages", "at least 1"),
        ({**GOOD, "messages": "hi"}, "messages", "valid list"),
        ({**GOOD, "messages": [{"content": "no role"}]}, "messages.0.role", "Missing"),
        ({**GOOD, "max_tokens": "five"}, "max_tokens", "integer"),
        ({**GOOD, "max_tokens": 5.5}, "max_tokens", "integer"),
        ({**GOOD, "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
        ({**GOOD, "max_tokens": 100000}, "max_tokens", "larger than the context"),
        ({**GOOD, "max_completion_tokens": 4096}, "max_completion_tokens", "context"),
        ({**GOOD, "stream": "yes"}, "stream", "boolean"),
        ({**GOOD, "n": 0}, "n", "greater than or equal to 1"),
        ({**GOOD, "stream_options": {"include_usage": "y"}}, "stream_options.include_usage", ""),
        ({**GOOD, "model": 7}, "model", "string"),
    ],
)
def test_invalid_chat_bodies(
    post: Post, router_url: str, body: dict, param: str, needle: str
) -> None:
    error = assert_openai_error(post(CHAT, json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert needle in error["message"]


@pytest.mark.parametrize(
    "body",
    [
        {"model": SIM_MODEL},
        {"model": SIM_MODEL, "prompt": ""},
        {"model": SIM_MODEL, "prompt": []},
        {"model": SIM_MODEL, "prompt": [1, "a"]},
        {"model": SIM_MODEL, "prompt": {"text": "x"}},
    ],
)
def test_invalid_completion_bodies(post: Post, body: dict) -> None:
    error = assert_openai_error(post("/v1/completions", json=body), 400)
    assert error["param"] == "prompt"


def test_invalid_json(post: Post, router_url: str) -> None:
    r = post(CHAT, content=b'{"model": ', headers={"content-type": "application/json"})
    assert "valid JSON" in assert_openai_error(r, 400)["message"]


def test_json_that_is_not_an_object(post: Post, router_url: str) -> None:
    r = post(CHAT, content=b"[1, 2]", headers={"content-type": "application/json"})
    assert "JSON object" in assert_openai_error(r, 400)["message"]


def test_wrong_content_type(post: Post, router_url: str) -> None:
    r = post(CHAT, content=b"model=x", headers={"content-type": "text/plain"})
    assert assert_openai_error(r, 415)["code"] == "unsupported_media_type"


@pytest.mark.parametrize(
    "content_type", ["application/json", "application/json; charset=utf-8", "Application/JSON"]
)
def test_a_json_content_type_is_accepted_in_any_form(
    post: Post, sim_workers: None, content_type: str
) -> None:
    body = orjson.dumps({**GOOD, "max_tokens": 1})
    r = post(CHAT, content=body, headers={"content-type": content_type})
    assert r.status_code == 200, r.text


def test_body_over_the_limit(post: Post, router_url: str) -> None:
    big = {**GOOD, "messages": [{"role": "user", "content": "x" * (5 * 1024 * 1024)}]}
    r = post(CHAT, json=big)
    assert assert_openai_error(r, 413)["code"] == "request_too_large"


def test_unknown_model(post: Post, router_url: str) -> None:
    r = post(CHAT, json={**GOOD, "model": "no/such-model"})
    error = assert_openai_error(r, 404, param="model")
    assert error["code"] == "model_not_found" and "no/such-model" in error["message"]


def test_unknown_path_and_wrong_method(
    post: Post, router_url: str, auth_headers: dict[str, str]
) -> None:
    assert_openai_error(post("/v1/nothing", json=GOOD), 404)
    r = httpx.get(f"{router_url}{CHAT}", timeout=10, headers=auth_headers)
    assert_openai_error(r, 405)


def test_every_error_carries_a_request_id(post: Post, router_url: str) -> None:
    r = post(CHAT, json={**GOOD, "model": "no/such-model"})
    assert len(r.headers["x-request-id"]) == 32


def test_unknown_openai_fields_are_accepted(post: Post, sim_workers: None) -> None:
    r = post(CHAT, json={**GOOD, "max_tokens": 2, "some_future_field": {"a": 1}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(
    "prompt",
    [["hi"] * 65, [[1, 2, 3]] * 65],
    ids=["strings", "token-arrays"],
)
def test_too_many_prompts_in_one_completion_request(post: Post, prompt: list[Any]) -> None:
    body = {"model": SIM_MODEL, "prompt": prompt, "max_tokens": 8}
    r = post("/v1/completions", json=body)
    error = assert_openai_error(r, 400, param="prompt")
    assert error["type"] == "invalid_request_error"
    assert "65 prompts" in error["message"] and "at most 64" in error["message"]
