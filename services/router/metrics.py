"""The router's Prometheus metrics (served on ``/metrics``).

Counters and histograms are labelled by model (the catalog bounds it); the
tenant label on token counters is only there when the operator turns it on
(``TOLLGATE_ROUTER_METRICS_TENANT_LABEL``), since tenants are unbounded.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tollgate.wire.contracts import UsageEvent

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TOKEN_GAP = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class RouterMetrics:
    def __init__(self, tenant_label: bool = False, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.tenant_label = tenant_label
        r = self.registry
        self.requests = Counter(
            "tollgate_router_requests",
            "Accepted requests by model, endpoint, HTTP status and outcome, counted when they end.",
            ["model", "endpoint", "status", "outcome"],
            registry=r,
        )
        self.tokens = Counter(
            "tollgate_router_tokens",
            "Tokens billed, by model and kind (prompt or completion).",
            ["model", "kind", "tenant"] if tenant_label else ["model", "kind"],
            registry=r,
        )
        self.duration = Histogram(
            "tollgate_router_request_duration_seconds",
            "From arrival to the end of the response.",
            ["model", "endpoint"],
            buckets=_LATENCY,
            registry=r,
        )
        self.ttft = Histogram(
            "tollgate_router_time_to_first_token_seconds",
            "From arrival to the first output relayed.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.queue_wait = Histogram(
            "tollgate_router_queue_wait_seconds",
            "From arrival until a worker took the request, by class (interactive, batch).",
            ["model", "priority", "tenant"] if tenant_label else ["model", "priority"],
            buckets=_LATENCY,
            registry=r,
        )
        self.retries = Counter(
            "tollgate_router_retries",
            "Requests queued again because their worker was lost before any output.",
            ["model"],
            registry=r,
        )
        self.affinity = Counter(
            "tollgate_router_affinity",
            "Where cache-aware routing sent requests: direct (the worker their prompt's opening "
            "or session picks), or the shared queue and why (shared_full, shared_no_worker, "
            "shared_no_key, shared_off).",
            ["model", "decision"],
            registry=r,
        )
        self.cold_start_hold = Histogram(
            "tollgate_router_cold_start_hold_seconds",
            "How long requests waited past the queue timeout for a worker that was starting.",
            ["model"],
            buckets=_LATENCY,
            registry=r,
        )
        self.inter_token = Histogram(
            "tollgate_router_inter_token_latency_seconds",
            "Gap between consecutive streamed output chunks.",
            ["model"],
            buckets=_TOKEN_GAP,
            registry=r,
        )
        self.rejected = Counter(
            "tollgate_router_rejected_requests",
            "Requests refused before dispatch, by error code (invalid_api_key, "
            "rate_limit_exceeded, insufficient_quota, model_not_found, ...).",
            ["code"],
            registry=r,
        )
        self.in_flight = Gauge(
            "tollgate_router_requests_in_flight", "Requests dispatched and not ended.", registry=r
        )
        self.queued = Gauge(
            "tollgate_router_requests_queued",
            "Requests dispatched that no worker has taken yet.",
            registry=r,
        )

        self.whitelist_lag = Gauge(
            "tollgate_router_whitelist_lag_seconds",
            "How long the key whitelist mirror has trailed its KV buckets (0: current).",
            registry=r,
        )
        self.whitelist_stale = Gauge(
            "tollgate_router_whitelist_stale",
            "1 while the whitelist mirror trails past its bound (keys refused, not ready).",
            registry=r,
        )

    def track_whitelist(self, lag_s: Callable[[], float], stale: Callable[[], bool]) -> None:
        self.whitelist_lag.set_function(lag_s)
        self.whitelist_stale.set_function(lambda: float(stale()))

    def track(self, in_flight: Callable[[], float], queued: Callable[[], float]) -> None:
        self.in_flight.set_function(in_flight)
        self.queued.set_function(queued)

    def ended(self, event: UsageEvent) -> None:
        """One accepted request is over: count it, its tokens and its timings."""
        model = event.model
        endpoint = event.endpoint
        self.requests.labels(model, endpoint, str(event.http_status), event.outcome).inc()
        for kind, count in (
            ("prompt", event.prompt_tokens),
            ("completion", event.completion_tokens),
        ):
            labels = (model, kind, event.tenant) if self.tenant_label else (model, kind)
            self.tokens.labels(*labels).inc(count)
        self.duration.labels(model, endpoint).observe(event.total_s)
        if event.ttft_s is not None:
            self.ttft.labels(model).observe(event.ttft_s)
        if event.queue_s is not None:
            priority = event.priority.value
            labels = (model, priority, event.tenant) if self.tenant_label else (model, priority)
            self.queue_wait.labels(*labels).observe(event.queue_s)
