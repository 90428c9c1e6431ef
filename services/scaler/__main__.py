"""``python -m services.scaler``: run the scaler; ``… simulate``: replay a demand trace."""

from __future__ import annotations

import argparse
import os
import sys

from aiohttp import web

from services.scaler.app import create_app
from services.scaler.backends import worker_environment
from services.scaler.settings import ScalerSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.service import cli_overrides, run_service
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "simulate":
        from services.scaler.simulate import main as simulate

        return simulate(argv[1:])
    parser = argparse.ArgumentParser(prog="tollgate scaler", description=__doc__)
    parser.add_argument("action", nargs="?", choices=["run"], default="run")
    parser.add_argument("--port", type=int)
    settings = ScalerSettings(**cli_overrides(parser.parse_args(argv), "port"))

    def start(common: CommonSettings) -> web.Application | int:
        catalog = load_catalog(common.catalog)
        for model in [*(settings.models or []), *settings.warm]:
            if catalog.resolve(model) is None:
                print(f"error: model {model!r} is not in the catalog", file=sys.stderr)
                return 2
        # Workers get the settings they need (NATS URL, catalog, var dir, ...), not all of ours.
        env = worker_environment(os.environ, settings.worker_nkey_file)
        return create_app(settings, common, catalog, env)

    return run_service("scaler", start, host=settings.host, port=settings.port, shutdown_timeout=5)


if __name__ == "__main__":
    sys.exit(main())
