"""The worker's optional HTTP side: ``/healthz``, ``/readyz``, ``/metrics``, ``/drain``.

Off unless ``TOLLGATE_WORKER_PORT`` is set (on Kubernetes it backs the
readiness probe; under the local scaler many workers share a host). Metrics
are Tollgate's own (names in docs/metrics.md) plus, for vLLM workers, vLLM's
own ``vllm:*`` series (KV-cache use, preemptions, running and waiting
requests, token counts), which vLLM keeps in the default registry.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterator

from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tollgate.runtime.ops import add_ops_routes
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.errors import error_body


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tollgate_worker_requests_total",
            "Requests this worker ended, by outcome.",
            ["model", "outcome"],
            registry=self.registry,
        )
        self.claims = Counter(
            "tollgate_worker_claims_total",
            "Requests this worker took from the work queue, by where they waited: direct (its "
            "own direct lane), shared, or spilled (another worker's direct lane, after the wait).",
            ["model", "source"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "tollgate_worker_tokens_total",
            "Tokens of the requests this worker ended (rate() gives tokens/s).",
            ["model", "kind"],
            registry=self.registry,
        )

    def watch(self, load: Callable[[], WorkerHeartbeat]) -> None:
        """Gauges read at each scrape from ``load()``: the numbers the worker also beats."""
        self.registry.register(_LoadCollector(load))


class _LoadCollector(Collector):
    def __init__(self, load: Callable[[], WorkerHeartbeat]) -> None:
        self.load = load

    def collect(self) -> Iterator[Metric]:
        beat = self.load()
        model = beat.model

        def gauge(name: str, doc: str, value: float | None) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            if value is not None:
                family.add_metric([model], value)
            return family

        yield gauge("tollgate_worker_slots_used", "Requests running.", beat.slots_used)
        yield gauge("tollgate_worker_slots_total", "Most requests at once.", beat.slots_total)
        yield gauge("tollgate_worker_requests_waiting", "Waiting inside the engine.", beat.queue)
        yield gauge(
            "tollgate_worker_kv_cache_usage_ratio", "KV cache in use, 0..1.", beat.kv_cache_usage
        )
        yield gauge("tollgate_worker_startup_seconds", "Process start to ready.", beat.startup_s)
        parts = GaugeMetricFamily(
            "tollgate_worker_startup_part_seconds",
            "Time-to-ready by part: process, fetch, convert, engine, warmup.",
            labels=["model", "part"],
        )
        for part, seconds in (beat.startup_parts or {}).items():
            parts.add_metric([model, part], seconds)
        yield parts
        state = GaugeMetricFamily(
            "tollgate_worker_state", "1 for the current lifecycle state.", labels=["model", "state"]
        )
        for s in WorkerState:
            state.add_metric([model, s.value], 1.0 if beat.state is s else 0.0)
        yield state
        yield from _prefix_cache(beat)


def _prefix_cache(beat: WorkerHeartbeat) -> Iterator[Metric]:
    """The engine's prefix-cache counters as it reports them, by model and worker.

    Labelled by worker too: cache-aware routing is judged worker by worker,
    and several local workers of one model can share a scrape target's host.
    """
    labels = ["model", "worker"]
    values = [beat.model, beat.worker_id]
    queries = CounterMetricFamily(
        "tollgate_worker_prefix_cache_queries",
        "Prompt tokens looked up in the engine's prefix cache.",
        labels=labels,
    )
    hits = CounterMetricFamily(
        "tollgate_worker_prefix_cache_hits",
        "Prompt tokens found in the engine's prefix cache (not computed again).",
        labels=labels,
    )
    rate = GaugeMetricFamily(
        "tollgate_worker_prefix_cache_hit_rate",
        "Prefix-cache hits / queries over the last 10 s, as the worker beats it.",
        labels=labels,
    )
    if beat.prefix_cache_queries is not None and beat.prefix_cache_hits is not None:
        queries.add_metric(values, beat.prefix_cache_queries)
        hits.add_metric(values, beat.prefix_cache_hits)
    if beat.prefix_cache_hit_rate is not None:
        rate.add_metric(values, beat.prefix_cache_hit_rate)
    yield queries
    yield hits
    yield rate


def _loopback(peer: str | None) -> bool:
    try:
        return peer is not None and ipaddress.ip_address(peer).is_loopback
    except ValueError:
        return False


def create_http_app(
    metrics: WorkerMetrics,
    state: Callable[[], WorkerState],
    drain: Callable[[], Awaitable[None]],
) -> web.Application:
    async def drain_endpoint(request: web.Request) -> web.Response:
        """Stop fetching and answer once in-flight requests are done.

        Only from this machine (or this pod): the port also serves metrics to
        a scraper elsewhere, and nothing elsewhere may take a worker out of
        service. Across the network workers drain on SIGTERM, or on a drain
        order over NATS, which only the scaler and the operator may send.
        """
        if not _loopback(request.remote):
            return web.json_response(
                error_body("/drain only answers on the loopback interface", "permission_error"),
                status=403,
            )
        await drain()
        return web.json_response({"state": state().value})

    app = web.Application()
    app.router.add_get("/drain", drain_endpoint)
    app.router.add_post("/drain", drain_endpoint)
    # ready = pulling from its model's work queue
    pulling = {"pulling": lambda app: state() is WorkerState.READY}
    add_ops_routes(app, [metrics.registry, REGISTRY], pulling)
    return app
