"""``python -m services.scaler``: run the scaler; ``… simulate``: replay a demand trace."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import uvloop
from aiohttp import web

from services.scaler.app import create_app
from services.scaler.settings import ScalerSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "simulate":
        from services.scaler.simulate import main as simulate

        return simulate(argv[1:])
    parser = argparse.ArgumentParser(prog="tollgate scaler", description=__doc__)
    parser.add_argument("action", nargs="?", choices=["run"], default="run")
    parser.add_argument("--port", type=int)
    ns = parser.parse_args(argv)
    settings = ScalerSettings(**({"port": ns.port} if ns.port else {}))
    common = CommonSettings()
    setup_logging("scaler", common.log_level)
    catalog = load_catalog(common.catalog)
    for model in [*(settings.models or []), *settings.warm]:
        if catalog.resolve(model) is None:
            print(f"error: model {model!r} is not in the catalog", file=sys.stderr)
            return 2
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    # Workers inherit this environment (NATS URL, catalog, var dir, ...).
    web.run_app(
        create_app(settings, common, catalog, dict(os.environ)),
        host=settings.host,
        port=settings.port,
        access_log=None,
        print=None,
        shutdown_timeout=5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
