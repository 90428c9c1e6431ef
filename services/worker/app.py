"""Worker factory: settings in, a running worker out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from services.worker.adapters import Adapters, Prepare
from services.worker.consumer import WorkerConsumer
from services.worker.engine import Engine, ErrorResult, LoadingEngine
from services.worker.lifetime import StartInterrupted, kill_engine_processes
from services.worker.metrics import WorkerMetrics, create_http_app
from services.worker.settings import WorkerSettings
from tollgate.models.cache import hold_entry, prepare_model
from tollgate.models.catalog import AdapterEntry, ModelEntry, load_catalog
from tollgate.models.sources import FetchOptions
from tollgate.runtime import httpserver
from tollgate.runtime.httpserver import HttpLimits
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus
from tollgate.wire.contracts import Endpoint
from tollgate.wire.topology import Role

log = logging.getLogger("tollgate.worker")


class ProgressLog:
    """Log a model download or conversion every ``every_s`` seconds (bytes, rate, ETA)."""

    def __init__(self, model: str, every_s: float = 10.0) -> None:
        self.model = model
        self.every_s = every_s
        self._phase = ""
        self._started = self._logged = 0.0

    def __call__(self, phase: str, done: int, total: int | None) -> None:
        now = time.monotonic()
        if phase != self._phase:
            self._phase, self._started, self._logged = phase, now, now
            return
        if now - self._logged < self.every_s and done != total:
            return
        self._logged = now
        rate = done / max(now - self._started, 1e-6)
        extra: dict[str, object] = {"model": self.model, "phase": phase, "bytes": done}
        extra["mb_per_s"] = round(rate / 1e6, 1)
        if total:
            extra["total_bytes"] = total
            extra["eta_s"] = round(max(total - done, 0) / rate, 1) if rate else None
        log.info("preparing model", extra=extra)


def create_engine(
    entry: ModelEntry,
    common: CommonSettings,
    parts: dict[str, float] | None = None,
    cache_dir: Path | None = None,
    adapters: Sequence[AdapterEntry] = (),
) -> Engine:
    """Prepare the weights (fetch, convert) and build the engine (not started yet)."""
    timings: dict[str, float] = {}
    model_path = prepare_model(
        entry,
        cache_dir or common.model_cache_dir,
        options=FetchOptions.from_settings(common),
        budget_bytes=common.model_cache_budget,
        timings=timings,
        progress=ProgressLog(entry.id),
    )
    if parts is not None:
        parts["fetch"] = timings.get("fetch", 0.0)
        parts["convert"] = timings.get("convert", 0.0)
    if entry.engine == "simulated":
        from services.worker.simulated import SimulatedEngine

        return SimulatedEngine(entry, model_path)
    from services.worker.vllm_engine import VllmEngine

    return VllmEngine(entry, model_path, adapters)


def adapter_preparer(common: CommonSettings, cache_dir: Path | None = None) -> Prepare:
    """Fetch an adapter's files through the model cache, as a model's weights are."""

    def prepare(adapter: AdapterEntry) -> Path:
        return prepare_model(
            adapter,
            cache_dir or common.model_cache_dir,
            options=FetchOptions.from_settings(common),
            budget_bytes=common.model_cache_budget,
            progress=ProgressLog(adapter.id),
        )

    return prepare


async def warm_up(engine: Engine, entry: ModelEntry) -> None:
    """One short request before taking calls, so no caller pays for the first one."""
    body: dict[str, Any]
    if entry.task == "embed":
        endpoint, body = Endpoint.EMBEDDINGS, {"model": entry.id, "input": "Hello"}
    else:
        endpoint = Endpoint.COMPLETIONS
        body = {"model": entry.id, "prompt": "Hello", "max_tokens": 1, "temperature": 0}
    result = await engine.run(endpoint, body, f"warmup-{os.getpid()}")
    if isinstance(result, ErrorResult):
        log.warning("warm-up request failed", extra={"status": result.status})


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), to report the whole time-to-ready."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            # field 22 (after the parenthesised command name) is the start time in ticks
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
            since_boot = float(uptime.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, since_boot - start_ticks / os.sysconf("SC_CLK_TCK"))


async def start_or_stop(
    engine: Engine, entry: ModelEntry, parts: dict[str, float], stop: asyncio.Event
) -> bool:
    """Start the engine and warm it up, unless told to stop first: then give the start up.

    Returns whether the engine is ready. A stop arrives as ``stop`` while the
    event loop runs, or as :class:`StartInterrupted` out of the engine's own
    blocking start; either way the caller's ``engine.stop()`` shuts down what
    did start.
    """

    async def start() -> None:
        engine_started = time.monotonic()
        await engine.start()
        parts["engine"] = round(time.monotonic() - engine_started, 3)
        warm_started = time.monotonic()
        await warm_up(engine, entry)
        parts["warmup"] = round(time.monotonic() - warm_started, 3)

    starting = asyncio.create_task(start(), name="engine-start")
    signalled = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([starting, signalled], return_when=asyncio.FIRST_COMPLETED)
    finally:
        signalled.cancel()
    if not starting.done():
        starting.cancel()
    try:
        await starting
    except (StartInterrupted, asyncio.CancelledError):
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise  # we are cancelled ourselves, not the start
        return False
    return not stop.is_set()


async def run_worker(settings: WorkerSettings, common: CommonSettings) -> None:
    """Serve one model until SIGTERM/SIGINT or a drain request, then drain."""
    catalog = load_catalog(common.catalog)
    entry = catalog.get(settings.model)
    adapters = catalog.adapters_of(entry.id)
    nc = await common.connect(Role.WORKER, f"worker-{settings.worker_id}")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    started = time.monotonic()
    age = process_age_s()
    born = started - (age if age is not None else 0.0)
    parts: dict[str, float] = {"process": round(started - born, 3)}  # interpreter + imports
    # Stateless mode: a private cache folder, fetched on every start and removed at exit.
    private = None
    if entry.cache == "none":
        common.model_cache_dir.mkdir(parents=True, exist_ok=True)
        private = Path(tempfile.mkdtemp(prefix=".worker-", dir=common.model_cache_dir))
    # Announced (state starting) before the weights and the engine load, so
    # routers hold calls for this worker and know since when it starts.
    metrics = WorkerMetrics()
    loading = LoadingEngine(entry.engine, common.model_cache_dir)
    consumer = WorkerConsumer(nc, loading, settings, common.subjects, entry.id, metrics)
    consumer.started_at = time.time() - (time.monotonic() - born)
    metrics.watch(consumer.heartbeat)
    await consumer.announce()
    # In a thread: a long download must not stall NATS pings and heartbeats.
    try:
        engine = await asyncio.to_thread(create_engine, entry, common, parts, private, adapters)
    except BaseException:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        await consumer.drain()
        raise
    consumer.engine = engine
    consumer.adapters = Adapters(entry.id, adapters, adapter_preparer(common, private))
    # the cached weights stay ours while we run: eviction and `models rm` skip them
    lease = hold_entry(engine.model_path)

    async def drain() -> None:
        consumer.stopped.set()  # run_worker drains; answer once nothing is in flight
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(consumer.drained.wait(), settings.drain_timeout_s)

    http: web.AppRunner | None = None
    if settings.port is not None:
        app = create_http_app(metrics, lambda: consumer.state, drain)
        # the same HTTP layer as every service (client bounds, no echoed bytes)
        http = await httpserver.start(app, settings.host, settings.port, limits=HttpLimits())
    try:
        if engine.start_blocks_loop:
            # the next beat comes once the engine has loaded
            await consumer.fall_silent(entry.scaling.time_to_ready_s)
        ready = await start_or_stop(engine, entry, parts, stop)
        consumer.silent_for_s = None
        if not ready:
            log.info("stopped while the engine was starting", extra={"model": entry.id})
            await consumer.drain()
            return
        log.info(
            "engine ready",
            extra={
                "model": entry.id,
                "engine": engine.name,
                "seconds": round(time.monotonic() - started, 2),
            },
        )
        consumer.startup_s = round(time.monotonic() - born, 3)
        consumer.startup_parts = parts
        await consumer.start()
        stopped = asyncio.create_task(consumer.stopped.wait())
        signalled = asyncio.create_task(stop.wait())
        await asyncio.wait([stopped, signalled], return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        signalled.cancel()
        await consumer.drain()
    finally:
        await engine.stop()
        left = kill_engine_processes()
        if left:
            log.warning("engine processes left after its shutdown, killed", extra={"pids": left})
        await bus.close(nc)
        if http is not None:
            await http.cleanup()
        if lease is not None:
            lease.close()
        consumer.adapters.close()
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
        log.info("worker stopped")
