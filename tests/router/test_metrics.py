"""The router's /metrics after a known sequence of requests (parsed, not string-matched)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import SIM_MODEL

pytestmark = pytest.mark.usefixtures("sim_workers")

MESSAGES = [{"role": "user", "content": "hello"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(router_url: str) -> Samples:
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def until(check: Callable[[], bool], timeout: float = 10) -> None:
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110 - polls an HTTP endpoint
            await asyncio.sleep(0.05)


async def test_counters_and_histograms_match_the_requests_sent(
    router_url: str, auth_headers: dict[str, str]
) -> None:
    before = scrape(router_url)
    completion = 0
    async with httpx.AsyncClient(base_url=router_url, headers=auth_headers, timeout=30) as http:
        for max_tokens in (1, 2, 3, 4, 5):
            body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": max_tokens}
            r = await http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200
            completion += r.json()["usage"]["completion_tokens"]
        chunks = 0
        for _ in range(3):
            body = {"model": SIM_MODEL, "messages": MESSAGES, "max_tokens": 6, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [ln async for ln in r.aiter_lines() if ln.startswith("data: {")]
            chunks += len(lines)
            completion += 6
        bad = {"Authorization": "Bearer tg-not-a-key"}
        for _ in range(2):
            r = await http.post(
                "/v1/chat/completions", json={"model": SIM_MODEL, "messages": MESSAGES}, headers=bad
            )
            assert r.status_code == 401
        r = await http.post("/v1/chat/completions", json={"model": "nope", "messages": MESSAGES})
        assert r.status_code == 404

    def delta(name: str, **labels: str) -> float:
        return value(scrape(router_url), name, **labels) - value(before, name, **labels)

    done = {
        "model": SIM_MODEL,
        "endpoint": "chat.completions",
        "status": "200",
        "outcome": "completed",
    }
    await until(lambda: delta("tollgate_router_requests_total", **done) == 8)
    after = scrape(router_url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    model = {"model": SIM_MODEL}
    chat = {**model, "endpoint": "chat.completions"}
    assert grew("tollgate_router_request_duration_seconds_count", **chat) == 8
    assert grew("tollgate_router_time_to_first_token_seconds_count", **model) == 8
    assert grew("tollgate_router_queue_wait_seconds_count", **model, priority="interactive") == 8
    completion_tokens = {"model": SIM_MODEL, "kind": "completion"}
    assert grew("tollgate_router_tokens_total", **completion_tokens) == completion
    assert grew("tollgate_router_tokens_total", model=SIM_MODEL, kind="prompt") > 0
    # Every gap between two streamed chunks of a request: chunks - 1 per stream.
    assert grew("tollgate_router_inter_token_latency_seconds_count", **model) == chunks - 3
    assert grew("tollgate_router_rejected_requests_total", code="invalid_api_key") == 2
    assert grew("tollgate_router_rejected_requests_total", code="model_not_found") == 1
    assert value(after, "tollgate_router_requests_in_flight") >= 0
