"""The operations endpoints of a service: ``/healthz``, ``/readyz`` and ``/metrics``."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


def add_ops_routes(
    app: web.Application, registry: CollectorRegistry, ready: Callable[[web.Application], bool]
) -> None:
    """Liveness (the process answers), readiness (``ready(app)``), Prometheus metrics."""

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        is_ready = ready(request.app)
        return web.json_response({"ready": is_ready}, status=200 if is_ready else 503)

    async def metrics(request: web.Request) -> web.Response:
        body = generate_latest(registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
