"""Every number a client sends is checked at the edge as ``vllm serve`` checks it,
before any reservation; the body limit is one the bus can carry."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.conftest import SIM_MODEL, Stack
from tests.lib.net import free_port
from tests.router.test_auth import make_key, wait_status
from tests.router.test_bad_input import assert_openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "hi"}]

# (path, extra body fields, the param the error names)
REFUSED = [
    *[
        (path, {"max_tokens": bad}, "max_tokens")
        for path in (CHAT, COMPLETIONS)
        for bad in ("abc", [1], {}, "inf", -5, 16.5, 2**70)
    ],
    *[(CHAT, {"max_completion_tokens": bad}, "max_completion_tokens") for bad in ("abc", -5, 0)],
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),  # 0 is for echo only
    *[(path, {"n": bad}, "n") for path in (CHAT, COMPLETIONS) for bad in (0, -1, 129, "x")],
    (COMPLETIONS, {"best_of": 0}, "best_of"),
    (COMPLETIONS, {"logprobs": -2}, "logprobs"),
    (CHAT, {"logprobs": True, "top_logprobs": -2}, "top_logprobs"),
    (CHAT, {"top_logprobs": 5}, "top_logprobs"),  # without logprobs
    (CHAT, {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),  # vLLM: a number only
    (CHAT, {"prompt_logprobs": -2}, "prompt_logprobs"),
    (CHAT, {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    (CHAT, {"min_tokens": -1}, "min_tokens"),
    (CHAT, {"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    (CHAT, {"temperature": 2.5}, "temperature"),
    (CHAT, {"temperature": "nan"}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_k": -2}, "top_k"),
    (CHAT, {"min_p": 1.5}, "min_p"),
    (CHAT, {"presence_penalty": -3}, "presence_penalty"),
    (CHAT, {"frequency_penalty": "inf"}, "frequency_penalty"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"seed": 2**64}, "seed"),
    (CHAT, {"seed": 2**63}, "seed"),
    (CHAT, {"seed": -(2**63) - 1}, "seed"),
    # beyond 64 bits: what orjson would round to a float, or refuse as not JSON
    (CHAT, {"max_tokens": 10**400}, "max_tokens"),
    (CHAT, {"top_k": 2**64}, "top_k"),
    (COMPLETIONS, {"logprobs": 10**30}, "logprobs"),
    (COMPLETIONS, {"prompt": [1, 2**64]}, "prompt.1"),
    (COMPLETIONS, {"prompt": [[1], [-(2**63) - 1]]}, "prompt.1.0"),
]


def _body(path: str, **extra: Any) -> dict[str, Any]:
    prompt = {"messages": MESSAGES} if path == CHAT else {"prompt": "hi"}
    return {"model": SIM_MODEL, **prompt, **extra}


@pytest.fixture(scope="module")
async def tiny_key(stack: Stack, router_url: str) -> str:
    """A key whose tokens/min no request fits: one that reaches a reservation gets a 429."""
    token, _ = await make_key(stack, tpm=1)
    await wait_status(router_url, token, 200)
    return token


@pytest.mark.parametrize(("path", "extra", "param"), REFUSED)
def test_bad_numbers_are_refused_before_any_reservation(
    router_url: str, tiny_key: str, path: str, extra: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        f"{router_url}{path}",
        json=_body(path, **extra),
        headers={"Authorization": f"Bearer {tiny_key}"},
        timeout=10,
    )
    # a 400, not the 429 a reservation would have given
    error = assert_openai_error(r, 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert "x-ratelimit-remaining-tokens" not in r.headers


# Integers beyond 64 bits anywhere in a body, and the field each error names.
BEYOND_64_BITS = [
    ({"extra": {"a": [1, 2**64]}}, "extra.a.1"),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "x": -(2**70)}]}]},
        "messages.0.content.0.x",
    ),
    ({"stop_token_ids": [10**4000]}, "stop_token_ids.0"),
]


@pytest.mark.parametrize(("extra", "param"), BEYOND_64_BITS)
def test_an_integer_beyond_64_bits_anywhere_is_refused_by_name(
    router_url: str, tiny_key: str, extra: dict[str, Any], param: str
) -> None:
    """Not rounded to a float on its way to the engine, nor called invalid JSON."""
    r = httpx.post(
        f"{router_url}{CHAT}",
        content=json.dumps(_body(CHAT, **extra)),
        headers={"Authorization": f"Bearer {tiny_key}", "Content-Type": "application/json"},
        timeout=10,
    )
    error = assert_openai_error(r, 400, param=param)
    assert error["message"] == (
        f"Invalid value for '{param}': Input should be an integer from "
        "-9223372036854775808 to 18446744073709551615 (64 bits)."
    )


def test_integers_within_64_bits_and_long_digit_strings_pass_the_edge(
    router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    """The widest integers the edge reads reach the engine as sent."""
    body = _body(
        COMPLETIONS,
        max_tokens=2,
        top_k=2**64 - 1,  # vLLM: past the vocabulary, every token
        seed=-(2**63),
        extra=[2**64 - 1, -(2**63)],
    )
    body["prompt"] = "digits " + "1234567890" * 5  # a run of digits in a string is text
    r = httpx.post(f"{router_url}{COMPLETIONS}", json=body, headers=auth_headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("value", [2.0, "2"], ids=["float", "string"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_whole_numbers_are_accepted_as_vllm_accepts_them(
    router_url: str, auth_headers: dict[str, str], sim_workers: None, path: str, value: Any
) -> None:
    r = httpx.post(
        f"{router_url}{path}", json=_body(path, max_tokens=value), headers=auth_headers, timeout=30
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def test_a_field_completions_do_not_have_is_ignored_as_vllm_ignores_it(
    router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    """/v1/completions has no max_completion_tokens: never read, never billed negative."""
    for bad in (-5, "abc", [1], {}, "inf"):
        r = httpx.post(
            f"{router_url}{COMPLETIONS}",
            json=_body(COMPLETIONS, max_completion_tokens=bad),
            headers=auth_headers,
            timeout=30,
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert 0 < usage["completion_tokens"] <= 16  # the default limit
        assert usage["prompt_tokens"] > 0


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth - 1):
        value = [value]
    return value


@pytest.mark.parametrize("depth", [129, 300, 1000])
def test_json_nested_past_the_limit_is_refused(
    router_url: str, auth_headers: dict[str, str], depth: int
) -> None:
    body = b'{"model":"%s","messages":[],"extra":%s1%s}' % (
        SIM_MODEL.encode(),
        b"[" * (depth - 1),
        b"]" * (depth - 1),
    )
    headers = {**auth_headers, "Content-Type": "application/json"}
    r = httpx.post(f"{router_url}{CHAT}", content=body, headers=headers, timeout=10)
    assert "128 levels" in assert_openai_error(r, 400)["message"]


def test_json_nested_within_the_limit_is_served(
    router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    # the body is one level, the field's list the rest
    body = _body(CHAT, max_tokens=1, extra=_nested(127))
    r = httpx.post(f"{router_url}{CHAT}", json=body, headers=auth_headers, timeout=30)
    assert r.status_code == 200, r.text


def test_a_three_mib_prompt_reaches_the_engine(
    router_url: str, auth_headers: dict[str, str], sim_workers: None
) -> None:
    """Larger than NATS's default 1 MiB message: the bus carries it, the engine answers."""
    prompt = "tollgate " * (3 * 1024 * 1024 // 9)
    r = httpx.post(
        f"{router_url}{COMPLETIONS}",
        json=_body(COMPLETIONS, max_tokens=1) | {"prompt": prompt},
        headers=auth_headers,
        timeout=120,
    )
    # the engine's own answer: the prompt is longer than the model's context
    assert r.status_code == 400, r.text
    assert "maximum context length" in r.json()["error"]["message"]


def test_a_body_limit_the_bus_cannot_carry_stops_the_router(stack: Stack) -> None:
    router = stack.spawn(
        "router",
        ["-m", "services.router", "--port", str(free_port())],
        TOLLGATE_ROUTER_MAX_BODY_BYTES=str(9 * 1024 * 1024),
    )
    assert router.proc.wait(60) == 78
    log = router.log_text()
    assert "TOLLGATE_ROUTER_MAX_BODY_BYTES=9437184" in log and "max_payload" in log
