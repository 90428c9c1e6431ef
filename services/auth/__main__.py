"""``python -m services.auth``: the admin API and budget accounting."""

from __future__ import annotations

import argparse
import sys

from services.auth.app import create_app
from services.auth.settings import AuthSettings
from tollgate.runtime.service import cli_overrides, run_service


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate auth", description=__doc__)
    parser.add_argument("--port", type=int)
    settings = AuthSettings(**cli_overrides(parser.parse_args(argv), "port"))
    return run_service(
        "auth",
        lambda common: create_app(settings, common),
        host=settings.host,
        port=settings.port,
        http=settings,
    )


if __name__ == "__main__":
    sys.exit(main())
