"""The one way a service process starts, runs and stops.

``python -m services.<name>`` parses its own options and settings, then hands
``run_service`` a function that builds what to run from the common settings.
That function returns one of:

- an aiohttp application, served on ``host:port`` on uvloop by
  :func:`tollgate.runtime.httpserver.serve` (aiohttp's server with
  OpenAI-shaped protocol errors, read timeouts and a connection cap, as
  ``http`` sets them). SIGTERM and SIGINT stop it as aiohttp's ``run_app``
  does: it stops taking connections, waits up to ``shutdown_timeout`` for the
  requests in flight, then runs the app's cleanup contexts, which drain NATS;
- a coroutine, run on uvloop until it returns. It owns its
  signals: the worker stops taking work on SIGTERM, finishes what it holds
  and drains NATS itself;
- an int: an exit status, returned without running anything (a failed
  start-up check, or a one-shot action such as ``metering migrate``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import ssl
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from aiohttp import web

from tollgate.runtime import httpserver, tracing
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings, SettingError

Start = Callable[[CommonSettings], web.Application | Coroutine[Any, Any, None] | int]


def cli_overrides(ns: argparse.Namespace, *names: str) -> dict[str, Any]:
    """The options among ``names`` given on the command line, as settings overrides."""
    return {name: value for name in names if (value := getattr(ns, name)) is not None}


def run_service(
    name: str,
    start: Start,
    *,
    host: str | None = None,
    port: int | None = None,
    shutdown_timeout: float = 60.0,
    traced: bool = False,
    nice: int = 0,
    tls: ssl.SSLContext | Callable[[], ssl.SSLContext | None] | None = None,
    http: httpserver.HttpLimits | None = None,
) -> int:
    """Load the common settings once, set up logging (and tracing), run, return the exit status.

    ``nice`` is CPU niceness added before running, for a background service
    that should leave the CPU to request serving. ``tls`` serves HTTPS (a
    context, or a function that builds one and may raise :class:`SettingError`).
    ``http`` bounds the clients of an application (its defaults when not given).
    """
    common = CommonSettings()
    setup_logging(name, common.log_level)
    if traced:
        tracing.setup_tracing(name)
    try:
        target = start(common)
        if isinstance(target, int):
            return target
        if nice:
            os.nice(nice)
            # SCHED_BATCH: a waking background service does not preempt request serving.
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        import uvloop

        # every service on uvloop: less CPU per message than asyncio's own loop
        # (the worker's CPU per request: 14% less at concurrency 1, docs/benchmarks.md)
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        if isinstance(target, web.Application):
            httpserver.serve(
                target,
                host,
                port,
                limits=http or httpserver.HttpLimits(),
                ssl_context=tls() if callable(tls) else tls,
                shutdown_timeout=shutdown_timeout,
            )
        else:
            asyncio.run(target)
    except SettingError as exc:
        # A setting that cannot work (a refused identity, an unreadable key):
        # restarting would not help, so say which one and stop.
        logging.getLogger(f"tollgate.{name}").error("cannot start: %s", exc)
        print(f"{name}: cannot start: {exc}", file=sys.stderr)
        return 78  # EX_CONFIG
    finally:
        tracing.shutdown()
    return 0
