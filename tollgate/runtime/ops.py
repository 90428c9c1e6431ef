"""The operations endpoints of every service: ``/healthz``, ``/readyz`` and ``/metrics``.

One implementation, so that every service answers a probe the same way:

- ``GET /healthz``: ``200 {"status": "ok"}`` while the process answers
  (liveness);
- ``GET /readyz``: ``{"ready": bool, "checks": {name: bool}}``, 200 when
  every check passes, 503 otherwise (readiness). Each service names its own
  checks (the router: ``nats`` and ``keys``), so the body says why a service
  is not ready; a probe reads only the status;
- ``GET /metrics``: the Prometheus text of the service's registries, after an
  optional ``before_scrape`` hook has refreshed gauges that are cheaper to
  compute on demand than to keep current.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Check = Callable[[web.Application], bool | Awaitable[bool]]
"""One readiness condition, read from the application at each probe."""

BeforeScrape = Callable[[web.Application], Awaitable[None]]
"""Refreshes gauges just before ``/metrics`` renders them."""


async def readiness(app: web.Application, checks: Mapping[str, Check]) -> dict[str, object]:
    """``{"ready": bool, "checks": {name: bool}}``: ready when every check passes."""
    results: dict[str, bool] = {}
    for name, check in checks.items():
        value = check(app)
        if inspect.isawaitable(value):
            value = await value
        results[name] = bool(value)
    return {"ready": all(results.values()), "checks": results}


def add_ops_routes(
    app: web.Application,
    registry: CollectorRegistry | Sequence[CollectorRegistry],
    checks: Mapping[str, Check],
    *,
    before_scrape: BeforeScrape | None = None,
) -> None:
    """Add ``/healthz``, ``/readyz`` (``checks``) and ``/metrics`` (``registry``) to ``app``.

    ``registry`` may be several registries, rendered one after the other (a
    vLLM worker adds vLLM's own default registry to Tollgate's).
    """
    registries = [registry] if isinstance(registry, CollectorRegistry) else list(registry)
    named = dict(checks)

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        body = await readiness(request.app, named)
        return web.json_response(body, status=200 if body["ready"] else 503)

    async def metrics(request: web.Request) -> web.Response:
        if before_scrape is not None:
            await before_scrape(request.app)
        body = b"".join(generate_latest(r) for r in registries)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
