"""``python -m services.router``: run the OpenAI-compatible edge."""

from __future__ import annotations

import argparse
import sys

from services.router.app import create_app
from services.router.settings import RouterSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.service import cli_overrides, run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate router", description=__doc__)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    settings = RouterSettings(**cli_overrides(parser.parse_args(argv), "host", "port"))
    return run_service(
        "router",
        lambda common: create_app(settings, common, load_catalog(common.catalog)),
        host=settings.host,
        port=settings.port,
        # on SIGTERM a request in flight gets its whole timeout before NATS is drained
        shutdown_timeout=settings.request_timeout_s,
        traced=True,
    )


if __name__ == "__main__":
    sys.exit(main())
