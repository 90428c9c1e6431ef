"""``python -m services.router``: run the OpenAI-compatible edge."""

from __future__ import annotations

import argparse
import ssl
import sys

from services.router.app import create_app
from services.router.settings import RouterSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.service import cli_overrides, run_service
from tollgate.runtime.settings import SettingError


def https_context(settings: RouterSettings) -> ssl.SSLContext | None:
    """The router's own HTTPS, for deployments without a TLS-terminating ingress."""
    if settings.tls_cert is None and settings.tls_key is None:
        return None
    if settings.tls_cert is None:
        raise SettingError("TOLLGATE_ROUTER_TLS_CERT: set it with TOLLGATE_ROUTER_TLS_KEY")
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        key = str(settings.tls_key) if settings.tls_key else None
        context.load_cert_chain(str(settings.tls_cert), key)
    except (OSError, ssl.SSLError) as exc:
        raise SettingError(f"TOLLGATE_ROUTER_TLS_CERT/_KEY: cannot load: {exc}") from None
    return context


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
        tls=lambda: https_context(settings),
        # on SIGTERM a request in flight gets its whole timeout before NATS is drained
        shutdown_timeout=settings.request_timeout_s,
        traced=True,
        http=settings,
    )


if __name__ == "__main__":
    sys.exit(main())
