"""``python -m services.metering``: usage events into ClickHouse.

``python -m services.metering migrate`` applies the schema migrations and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys

import uvloop
from aiohttp import web

from services.metering.app import create_app, open_store
from services.metering.settings import MeteringSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings


def migrate(settings: MeteringSettings, common: CommonSettings) -> int:
    try:
        store = open_store(settings, common)
    except Exception as exc:
        # chDB allows one process per data directory: a running service holds it.
        print(f"error: cannot open ClickHouse: {exc}", file=sys.stderr)
        print("(the metering service applies migrations itself when it starts)", file=sys.stderr)
        return 1
    try:
        applied = store.migrate()
        store.sync_prices(load_catalog(common.catalog))
    finally:
        store.close()
    for migration in applied:
        print(f"applied {migration.version:04d}_{migration.name}")
    if not applied:
        print("schema is up to date")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate metering", description=__doc__)
    parser.add_argument("action", nargs="?", choices=["run", "migrate"], default="run")
    parser.add_argument("--port", type=int)
    ns = parser.parse_args(argv)
    settings = MeteringSettings(**({"port": ns.port} if ns.port else {}))
    common = CommonSettings()
    setup_logging("metering", common.log_level)
    if ns.action == "migrate":
        return migrate(settings, common)
    if settings.nice:
        os.nice(settings.nice)
        # SCHED_BATCH: a waking meter does not preempt request serving.
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(
        create_app(settings, common, load_catalog(common.catalog)),
        host=settings.host,
        port=settings.port,
        access_log=None,
        print=None,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
