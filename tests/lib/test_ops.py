"""The operations routes every service shares: /healthz, /readyz and /metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.parser import text_string_to_metric_families

from tollgate.runtime.ops import BeforeScrape, Check, add_ops_routes

FLAG = web.AppKey("flag", dict)


async def _client(
    checks: Mapping[str, Check],
    registry: CollectorRegistry | list[CollectorRegistry] | None = None,
    before_scrape: BeforeScrape | None = None,
) -> TestClient[web.Request, web.Application]:
    app = web.Application()
    app[FLAG] = {"nats": True, "keys": False}
    add_ops_routes(app, registry or CollectorRegistry(), checks, before_scrape=before_scrape)
    client = TestClient(TestServer(app))
    await client.start_server()
    return client


@pytest.fixture
async def flags_client() -> AsyncIterator[TestClient[web.Request, web.Application]]:
    async def keys_loaded(app: web.Application) -> bool:  # an awaitable check
        return bool(app[FLAG]["keys"])

    client = await _client({"nats": lambda app: bool(app[FLAG]["nats"]), "keys": keys_loaded})
    yield client
    await client.close()


async def test_healthz_is_ok_whatever_readiness_says(
    flags_client: TestClient[web.Request, web.Application],
) -> None:
    response = await flags_client.get("/healthz")
    assert response.status == 200 and await response.json() == {"status": "ok"}


async def test_readyz_names_the_failing_check_with_503(
    flags_client: TestClient[web.Request, web.Application],
) -> None:
    response = await flags_client.get("/readyz")
    assert response.status == 503
    assert await response.json() == {"ready": False, "checks": {"nats": True, "keys": False}}
    flags_client.app[FLAG]["keys"] = True
    response = await flags_client.get("/readyz")
    assert response.status == 200
    assert await response.json() == {"ready": True, "checks": {"nats": True, "keys": True}}


async def test_no_checks_means_ready() -> None:
    client = await _client({})
    try:
        response = await client.get("/readyz")
        assert response.status == 200
        assert await response.json() == {"ready": True, "checks": {}}
    finally:
        await client.close()


async def test_metrics_refreshes_gauges_before_rendering_every_registry() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    gauge = Gauge("test_keys", "Keys.", registry=ours)
    Counter("test_engine_steps", "Steps of another library.", registry=theirs).inc(3)
    scrapes = 0

    async def refresh(app: web.Application) -> None:
        nonlocal scrapes
        scrapes += 1
        gauge.set(scrapes * 10)

    client = await _client({}, [ours, theirs], before_scrape=refresh)
    try:
        for expected in (10.0, 20.0):
            response = await client.get("/metrics")
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            samples = {
                s.name: s.value
                for family in text_string_to_metric_families(await response.text())
                for s in family.samples
            }
            assert samples["test_keys"] == expected
            assert samples["test_engine_steps_total"] == 3
    finally:
        await client.close()
