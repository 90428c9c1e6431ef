"""Baseline for the gateway benchmark: the simulated engine behind a bare HTTP server.

Same engine code as a Tollgate worker, with no router, NATS or worker hop, so
the difference between the two is what the hop adds.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from services.worker.engine import ErrorResult, FullResult
from services.worker.simulated import SimulatedEngine
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings
from tollgate.wire.contracts import Endpoint

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


async def serve(model: str, port: int) -> None:
    common = CommonSettings()
    entry = load_catalog(common.catalog).get(model)
    engine = SimulatedEngine(entry, prepare_model(entry, common.model_cache_dir))
    await engine.start()

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        result = await engine.run(Endpoint.CHAT, body, "direct")
        if isinstance(result, ErrorResult):
            return web.Response(status=result.status, text=result.body)
        if isinstance(result, FullResult):
            return web.Response(body=result.body.encode(), content_type="application/json")
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        async for event in result.events:
            await response.write(event.text.encode())
        return response

    async def ready(request: web.Request) -> web.Response:
        return web.json_response({"status": "ready"})

    await serve_chat(port, chat, ready)


async def serve_chat(port: int, chat: Handler, ready: Handler) -> None:
    """Serve ``chat`` at the chat path and ``ready`` at ``/readyz`` on loopback, for good."""
    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/readyz", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args()
    import uvloop

    uvloop.run(serve(ns.model, ns.port))
