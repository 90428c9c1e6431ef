"""A worker's /healthz, /readyz and /metrics: the counters equal what it served."""

from __future__ import annotations

import asyncio

import httpx
import openai
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import OBSERVED_MODEL, Stack, free_port, wait_ready


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_worker_metrics_count_what_it_served(
    stack: Stack, router_url: str, api_key: str
) -> None:
    port = free_port()
    worker = stack.worker(OBSERVED_MODEL, TOLLGATE_WORKER_PORT=str(port))
    await wait_ready(stack.nats, OBSERVED_MODEL, timeout=120)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{base}/healthz")).status_code == 200
        ready = await http.get(f"{base}/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"ready": True, "checks": {"pulling": True}}
        client = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)
        replies = await asyncio.gather(
            *(
                client.chat.completions.create(
                    model=OBSERVED_MODEL,
                    messages=[{"role": "user", "content": "hi"}],
                    max_tokens=3 + i,
                )
                for i in range(5)
            )
        )
        got = samples((await http.get(f"{base}/metrics")).text)
    m = (("model", OBSERVED_MODEL),)
    assert got[("tollgate_worker_requests_total", (*m, ("outcome", "completed")))] == 5
    completion = sum(r.usage.completion_tokens for r in replies if r.usage)
    prompt = sum(r.usage.prompt_tokens for r in replies if r.usage)
    assert completion == 3 + 4 + 5 + 6 + 7
    kinds = {
        k: got[("tollgate_worker_tokens_total", (("kind", k), *m))]
        for k in ("prompt", "completion")
    }
    assert kinds == {"prompt": prompt, "completion": completion}
    # where they waited: cache-aware routing sends to the one worker while it has room
    claims = {
        source: got.get(("tollgate_worker_claims_total", (*m, ("source", source))), 0)
        for source in ("direct", "shared", "spilled")
    }
    assert sum(claims.values()) == 5 and claims["direct"] >= 1 and claims["spilled"] == 0, claims
    assert got[("tollgate_worker_slots_total", m)] == 4
    assert got[("tollgate_worker_slots_used", m)] == 0
    total = got[("tollgate_worker_startup_seconds", m)]
    parts = {
        part: got[("tollgate_worker_startup_part_seconds", (*m, ("part", part)))]
        for part in ("process", "fetch", "convert", "engine", "warmup")
    }
    assert total > 0 and all(v >= 0 for v in parts.values())
    assert sum(parts.values()) <= total + 0.01, "the parts fit in the whole time-to-ready"
    assert got[("tollgate_worker_state", (*m, ("state", "ready")))] == 1
    assert got[("tollgate_worker_state", (*m, ("state", "draining")))] == 0
    # GET /drain from this machine (loopback): answered once drained; then it exits
    async with httpx.AsyncClient(timeout=60) as http:
        drained = await http.get(f"{base}/drain")
    assert drained.status_code == 200 and drained.json()["state"] in ("draining", "stopped")
    assert await asyncio.to_thread(worker.proc.wait, 30) == 0


async def test_drain_answers_only_on_the_loopback_interface() -> None:
    """A scraper elsewhere reaches the port for metrics; it cannot take the worker out."""
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    from services.worker.metrics import WorkerMetrics, create_http_app
    from tollgate.wire.contracts import WorkerState

    drained: list[bool] = []

    async def drain() -> None:
        drained.append(True)

    app = create_http_app(WorkerMetrics(), lambda: WorkerState.READY, drain)
    handler = next(r for r in app.router.routes() if r.resource.canonical == "/drain").handler

    def from_peer(address: str) -> web.Request:
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: (
            (address, 40000) if name == "peername" else default
        )
        return make_mocked_request("GET", "/drain", app=app, transport=transport)

    refused = await handler(from_peer("10.1.2.3"))
    assert refused.status == 403 and not drained
    for local in ("127.0.0.1", "::1"):
        assert (await handler(from_peer(local))).status == 200
    assert drained == [True, True]
