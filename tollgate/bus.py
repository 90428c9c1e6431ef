"""NATS connection helper: reconnect forever, log state changes, drain on exit."""

from __future__ import annotations

import asyncio
import logging

import nats
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError

from tollgate.subjects import Subjects

log = logging.getLogger("tollgate.bus")


async def connect(url: str, name: str) -> NATS:
    """Connect to NATS, retrying the first connect and every later disconnect."""

    async def on_error(exc: Exception) -> None:
        log.warning("nats error: %s", type(exc).__name__, extra={"detail": str(exc)})

    async def on_disconnected() -> None:
        log.warning("nats disconnected")

    async def on_reconnected() -> None:
        log.info("nats reconnected")

    delay = 0.2
    while True:
        try:
            return await nats.connect(
                servers=url.split(","),
                name=name,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                connect_timeout=2,
                allow_reconnect=True,
                error_cb=on_error,
                disconnected_cb=on_disconnected,
                reconnected_cb=on_reconnected,
            )
        except (OSError, nats.errors.NoServersError, TimeoutError) as exc:
            # The first connect is retried too: services may start before NATS.
            log.warning("nats not reachable yet: %s", type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def close(nc: NATS) -> None:
    """Drain subscriptions and flush publishes, then close."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except Exception as exc:  # a broken connection cannot be drained
        log.warning("nats drain failed: %s", type(exc).__name__)
        try:
            await nc.close()
        except Exception as close_exc:  # the server is gone: nothing left to flush
            log.warning("nats close failed: %s", type(close_exc).__name__)


async def ensure_infer_stream(
    js: JetStreamContext, subjects: Subjects, model_id: str, max_age_s: float = 600.0
) -> None:
    """Create (or update) the work-queue stream that holds a model's requests.

    Requests live in memory: each one belongs to an open client connection on
    a router, so there is nothing to recover from disk after a NATS restart.
    ``duplicate_window`` drops a request published twice with the same id.
    """
    config = StreamConfig(
        name=subjects.infer_stream(model_id),
        subjects=[subjects.infer(model_id)],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.MEMORY,
        max_age=max_age_s,
        duplicate_window=min(120.0, max_age_s),
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)


async def ensure_usage_stream(js: JetStreamContext, subjects: Subjects) -> None:
    """The stream of usage events: file storage, duplicates dropped by request id."""
    config = StreamConfig(
        name=subjects.usage_stream,
        subjects=[subjects.usage_all],
        storage=StorageType.FILE,
        duplicate_window=600.0,
    )
    try:
        await js.add_stream(config)
    except BadRequestError:
        await js.update_stream(config)
