"""Metering service factory: ClickHouse schema, the usage writer and the query responder.

The HTTP side only serves ``/healthz``, ``/readyz`` and ``/metrics``; the work
comes over NATS.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator

from aiohttp import web

from services.metering.exchanges import exchange_ingests
from services.metering.ingest import UsageIngest
from services.metering.metrics import MeteringMetrics
from services.metering.queries import QueryResponder
from services.metering.settings import MeteringSettings
from services.metering.store import UsageStore
from tollgate.models.catalog import Catalog
from tollgate.runtime.ops import add_ops_routes
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus
from tollgate.wire.topology import Role

log = logging.getLogger("tollgate.metering")

INGEST = web.AppKey("ingest", UsageIngest)


def open_store(settings: MeteringSettings, common: CommonSettings) -> UsageStore:
    query_dsn = settings.query_dsn.get_secret_value() if settings.query_dsn else None
    return UsageStore(
        settings.dsn(common.var_dir),
        settings.database,
        settings.query_timeout_s,
        query_dsn=query_dsn,
        query_max_memory_bytes=settings.query_max_memory_bytes,
        fault_file=settings.fault_file,
    ).open()


def _exit_if_failed(task: asyncio.Task[None]) -> None:
    """A writer that stopped on its own must not leave a healthy-looking process."""
    if task.cancelled() or task.exception() is None:
        return
    log.critical("usage writer stopped", exc_info=task.exception())
    os.kill(os.getpid(), signal.SIGTERM)  # stop; the supervisor starts it again


def create_app(
    settings: MeteringSettings, common: CommonSettings, catalog: Catalog
) -> web.Application:
    app = web.Application()
    metrics = MeteringMetrics()

    async def service_ctx(app: web.Application) -> AsyncIterator[None]:
        store = await asyncio.to_thread(open_store, settings, common)
        applied = await asyncio.to_thread(store.migrate)
        prices = await asyncio.to_thread(store.sync_prices, catalog)
        await asyncio.to_thread(store.repair_rollups, settings.rollup_check_days)
        await asyncio.to_thread(store.set_capture_retention, settings.capture_retention_days)
        log.info(
            "ClickHouse schema ready",
            extra={
                "embedded": store.embedded,
                "migrations_applied": len(applied),
                "prices": prices,
            },
        )
        nc = await common.connect(Role.METERING, "metering")
        ingest = UsageIngest(nc, store, common.subjects, settings, metrics)
        app[INGEST] = ingest
        await QueryResponder(nc, store, common.subjects, settings.query_max_rows, metrics).start()
        task = asyncio.create_task(ingest.run(), name="ingest")
        task.add_done_callback(_exit_if_failed)
        # Captured exchanges and replay results share the usage writer's thread.
        exchanges = exchange_ingests(nc, store, ingest.write, common.topology)
        side = [asyncio.create_task(e.run(), name=e.table) for e in exchanges]
        for t in side:
            t.add_done_callback(_exit_if_failed)
        yield
        # Finish the batch in hand (insert, then ack) before leaving.
        ingest.stop()
        for e in exchanges:
            e.stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(task, *side), timeout=60)
        await bus.close(nc)
        await asyncio.to_thread(store.close)

    def ingesting(app: web.Application) -> bool:
        ingest = app.get(INGEST)
        return ingest is not None and ingest.running

    app.cleanup_ctx.append(service_ctx)
    add_ops_routes(app, metrics.registry, {"ingest": ingesting})
    return app
