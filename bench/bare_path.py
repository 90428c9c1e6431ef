"""Second baseline for the stack benchmark: the bare router -> NATS -> worker path.

The fewest steps a call through a router and a worker over NATS takes with the
packages Tollgate is built on, and nothing else: an aiohttp handler publishes
the body to a JetStream work queue (file storage) that republishes it to the
worker's subscription, as Tollgate's work queue does; the worker runs the same
simulated engine as ``bench/direct_sim.py`` and publishes the answer to the
router's inbox. No keys, admission, limits, claims, billing, logs or metrics.

Beside the engine alone (``direct_sim``) it tells what the hops and the
packages cost on this machine, so the stack's own share of its added latency
is the rest. A benchmark baseline, not a service: it trusts everything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools

import nats
import orjson
from aiohttp import web
from nats.aio.msg import Msg
from nats.js.api import RePublish, RetentionPolicy, StorageType, StreamConfig

from bench.direct_sim import serve_chat
from services.worker.engine import FullResult
from services.worker.simulated import SimulatedEngine
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings
from tollgate.wire.contracts import Endpoint

STREAM = "BARE"
QUEUED = "bare.queue"
OFFERED = "bare.offer"
READY = "bare.ready"
REPLY_HEADER = "Bare-Reply"


async def router(url: str, port: int) -> None:
    nc = await nats.connect(url)
    js = nc.jetstream()
    with contextlib.suppress(Exception):
        await js.delete_stream(STREAM)
    await js.add_stream(
        StreamConfig(
            name=STREAM,
            subjects=[QUEUED],
            storage=StorageType.FILE,
            retention=RetentionPolicy.WORK_QUEUE,
            republish=RePublish(src=QUEUED, dest=OFFERED),
        )
    )
    waiting: dict[str, asyncio.Future[bytes]] = {}
    inbox = nc.new_inbox()
    ids = itertools.count()

    async def answered(msg: Msg) -> None:
        future = waiting.pop(msg.subject, None)
        if future is not None and not future.done():
            future.set_result(msg.data)

    await nc.subscribe(f"{inbox}.*", cb=answered)

    async def chat(request: web.Request) -> web.Response:
        raw = await request.read()
        orjson.loads(raw)  # the router reads the body, as Tollgate's does
        reply = f"{inbox}.{next(ids)}"
        future = waiting[reply] = asyncio.get_running_loop().create_future()
        ack = asyncio.ensure_future(js.publish(QUEUED, raw, headers={REPLY_HEADER: reply}))
        body = await future
        await ack
        return web.Response(body=body, content_type="application/json")

    async def ready(request: web.Request) -> web.Response:
        try:  # ready once the worker listens: an offer before that would be lost
            await nc.request(READY, b"", timeout=1)
        except Exception:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ready"})

    await serve_chat(port, chat, ready)


async def worker(url: str, model: str) -> None:
    common = CommonSettings()
    entry = load_catalog(common.catalog).get(model)
    engine = SimulatedEngine(entry, prepare_model(entry, common.model_cache_dir))
    await engine.start()
    nc = await nats.connect(url)
    tasks: set[asyncio.Task[None]] = set()

    async def serve(msg: Msg) -> None:
        result = await engine.run(Endpoint.CHAT, orjson.loads(msg.data), "bare")
        body = result.body.encode() if isinstance(result, FullResult) else b"{}"
        await nc.publish((msg.headers or {})[REPLY_HEADER], body)

    async def offered(msg: Msg) -> None:
        task = asyncio.create_task(serve(msg))
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def ready(msg: Msg) -> None:
        await msg.respond(b"ready")

    await nc.subscribe(OFFERED, cb=offered)
    await nc.subscribe(READY, cb=ready)
    await nc.flush()
    await asyncio.Event().wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["router", "worker"])
    parser.add_argument("--nats", required=True)
    parser.add_argument("--port", type=int)
    parser.add_argument("--model")
    ns = parser.parse_args()
    import uvloop

    if ns.role == "router":
        uvloop.run(router(ns.nats, ns.port))
    else:
        uvloop.run(worker(ns.nats, ns.model))
