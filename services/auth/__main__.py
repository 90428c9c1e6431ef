"""``python -m services.auth``: the admin API and budget accounting."""

from __future__ import annotations

import argparse
import asyncio

import uvloop
from aiohttp import web

from services.auth.app import create_app
from services.auth.settings import AuthSettings
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tollgate auth", description=__doc__)
    parser.add_argument("--port", type=int)
    ns = parser.parse_args(argv)
    settings = AuthSettings(**({"port": ns.port} if ns.port else {}))
    common = CommonSettings()
    setup_logging("auth", common.log_level)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    web.run_app(
        create_app(settings, common),
        host=settings.host,
        port=settings.port,
        access_log=None,
        print=None,
    )


if __name__ == "__main__":
    main()
