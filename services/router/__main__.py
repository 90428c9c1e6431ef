"""``python -m services.router``: run the OpenAI-compatible edge."""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web

from services.router.app import create_app
from services.router.settings import RouterSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime import tracing
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tollgate router", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    ns = parser.parse_args(argv)
    overrides = {k: v for k, v in (("host", ns.host), ("port", ns.port)) if v is not None}
    settings = RouterSettings(**overrides)
    common = CommonSettings()
    setup_logging("router", common.log_level)
    tracing.setup_tracing("router")
    app = create_app(settings, common, load_catalog(common.catalog))
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    # aiohttp's run_app stops taking connections on SIGTERM/SIGINT and waits
    # for in-flight requests (shutdown_timeout) before the cleanup contexts
    # drain NATS.
    web.run_app(
        app,
        host=settings.host,
        port=settings.port,
        access_log=None,
        print=None,
        shutdown_timeout=settings.request_timeout_s,
    )
    tracing.shutdown()


if __name__ == "__main__":
    main()
