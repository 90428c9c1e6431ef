"""Router app factory: settings in, aiohttp application out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from services.router import handlers
from services.router.appkeys import (
    CATALOG,
    DISPATCHER,
    KEYS,
    METRICS,
    SERVING,
    SETTINGS,
    STARTED_AT,
    WORKERS,
)
from services.router.auth import KeyMirror
from services.router.capture import Capturer
from services.router.dispatch import Dispatcher
from services.router.endpoints import SPECS
from services.router.errors import (
    InternalError,
    MethodNotAllowed,
    NotFound,
    TollgateError,
    error_response,
)
from services.router.limits import Limiter
from services.router.metrics import RouterMetrics
from services.router.openapi import router_api
from services.router.serving import OpenAIServing
from services.router.settings import RouterSettings
from services.router.settlement import Settler
from services.router.usage import LostCalls, Outbox, UsagePublisher
from tollgate.models.catalog import Catalog
from tollgate.runtime.openapi import add_openapi_route, build_document
from tollgate.runtime.ops import Check, add_ops_routes
from tollgate.runtime.settings import CommonSettings
from tollgate.runtime.workers import WorkerView
from tollgate.wire import bus
from tollgate.wire.topology import Role

log = logging.getLogger("tollgate.router")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def openai_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves as an OpenAI-shaped body; nothing internal leaks."""
    try:
        return await handler(request)
    except TollgateError as exc:
        return error_response(exc)
    except web.HTTPNotFound:
        return error_response(NotFound(f"Unknown path {request.path}."))
    except web.HTTPMethodNotAllowed as exc:
        return error_response(
            MethodNotAllowed(
                f"Method {request.method} is not allowed for {request.path}.",
                headers={"Allow": ", ".join(sorted(exc.allowed_methods))},
            )
        )
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        error = TollgateError(exc.reason)
        error.status = exc.status
        error.type = "invalid_request_error" if exc.status < 500 else "server_error"
        return error_response(error)
    except ConnectionResetError:
        # the client went away mid-request (an aborted upload): an ending, not an error
        log.info("client closed the request", extra={"status": 499, "path": request.path})
        return web.Response(status=499)
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        return error_response(InternalError("The server had an error processing your request."))


def create_app(
    settings: RouterSettings, common: CommonSettings, catalog: Catalog
) -> web.Application:
    app = web.Application(middlewares=[openai_errors], client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[CATALOG] = catalog
    app[STARTED_AT] = int(time.time())
    metrics = RouterMetrics(tenant_label=settings.metrics_tenant_label)
    app[METRICS] = metrics

    async def nats_ctx(app: web.Application) -> AsyncIterator[None]:
        nc = await common.connect(Role.ROUTER, f"router-{settings.router_id}")
        js = nc.jetstream()
        topology = common.topology
        await topology.ensure(js, Role.ROUTER)
        workers = WorkerView(settings.heartbeat_misses)
        await workers.start(nc, common.subjects)
        dispatcher = Dispatcher(nc, topology, settings.router_id)
        workers.on_beat = lambda beat: dispatcher.heard(beat.worker_id)
        await dispatcher.start(catalog.models, body_limit=settings.max_body_bytes)
        metrics.track(lambda: dispatcher.in_flight, lambda: dispatcher.queued)
        app[WORKERS] = workers
        app[DISPATCHER] = dispatcher
        outbox = Outbox(settings.outbox or common.var_dir / "outbox" / f"router-{settings.port}.db")
        usage = UsagePublisher(js, common.subjects, outbox)
        await usage.start()
        limiter = await Limiter.open(js, topology)
        # settlements an earlier run on this outbox left unmade, then the calls
        # it accepted and never finished (it was killed)
        settler = Settler(limiter, usage)
        settler.start()
        lost = LostCalls(
            usage, outbox.opened(), lambda: topology.bucket(js, topology.orphans), settler
        )
        lost.start()
        capturer = Capturer(
            js, common.subjects, settings.capture_tenants, settings.capture_max_bytes
        )
        serving = OpenAIServing(
            catalog, dispatcher, workers, settings, limiter, usage, metrics, capturer, settler
        )
        app[SERVING] = serving
        keys = KeyMirror(
            settings.hs256_secrets, settings.whitelist_max_lag_s, settings.retry_after_s
        )
        metrics.track_whitelist(lambda: keys.lag_s, lambda: keys.stale)
        app[KEYS] = keys
        if settings.auth:
            await keys.start(nc, topology)
            if not await keys.wait_synced(timeout=10):
                log.warning("key whitelist not loaded yet; not ready until it is")
        log.info("router started", extra={"router_id": settings.router_id, "auth": settings.auth})
        yield
        await serving.drain()
        await capturer.drain()
        await lost.stop()
        await settler.stop()
        await usage.flush()
        await limiter.close()
        await keys.stop()
        await bus.close(nc)

    app.cleanup_ctx.append(nats_ctx)
    for endpoint in SPECS:
        app.router.add_post(endpoint.path, handlers.call_handler(endpoint))
    app.router.add_get("/v1/models", handlers.list_models)
    app.router.add_get("/v1/models/{model:.+}", handlers.get_model)
    ready: dict[str, Check] = {
        "nats": lambda app: DISPATCHER in app and app[DISPATCHER].nc.is_connected
    }
    if settings.auth:
        ready["keys"] = lambda app: KEYS in app and app[KEYS].ready
    add_ops_routes(app, metrics.registry, ready)
    add_openapi_route(app, build_document(router_api(settings.auth)))
    return app
