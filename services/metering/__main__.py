"""``python -m services.metering``: usage events into ClickHouse.

``python -m services.metering migrate`` applies the schema migrations and exits.
"""

from __future__ import annotations

import argparse
import functools
import sys

from services.metering.app import create_app
from services.metering.migrate import migrate
from services.metering.settings import MeteringSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.service import cli_overrides, run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate metering", description=__doc__)
    parser.add_argument("action", nargs="?", choices=["run", "migrate"], default="run")
    parser.add_argument("--port", type=int)
    ns = parser.parse_args(argv)
    settings = MeteringSettings(**cli_overrides(ns, "port"))
    if ns.action == "migrate":
        return run_service("metering", functools.partial(migrate, settings))
    return run_service(
        "metering",
        lambda common: create_app(settings, common, load_catalog(common.catalog)),
        host=settings.host,
        port=settings.port,
        nice=settings.nice,  # request serving gets the CPU first; rows may lag, never drop
    )


if __name__ == "__main__":
    sys.exit(main())
