"""Prometheus metrics of the scaler (names in docs/metrics.md)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ScalerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.desired = Gauge(
            "tollgate_scaler_desired_replicas", "Workers the scaler wants.", ["model"], registry=r
        )
        self.ready = Gauge(
            "tollgate_scaler_ready_replicas", "Workers ready (heartbeats).", ["model"], registry=r
        )
        self.starting = Gauge(
            "tollgate_scaler_starting_replicas", "Workers starting.", ["model"], registry=r
        )
        self.draining = Gauge(
            "tollgate_scaler_draining_replicas", "Workers draining.", ["model"], registry=r
        )
        self.queued = Gauge(
            "tollgate_scaler_queued_requests",
            "Requests waiting in the model's work queue.",
            ["model"],
            registry=r,
        )
        self.predicted = Gauge(
            "tollgate_scaler_predicted_load",
            "Requests in flight the usage history expects one start-up ahead.",
            ["model"],
            registry=r,
        )
        self.time_to_ready = Gauge(
            "tollgate_scaler_time_to_ready_seconds",
            "Latest measured worker start-up time (process start to ready).",
            ["model"],
            registry=r,
        )
        self.decisions = Counter(
            "tollgate_scaler_decisions_total",
            "Replica changes by reason.",
            ["model", "reason"],
            registry=r,
        )
        self.restarts = Counter(
            "tollgate_scaler_worker_restarts_total",
            "Workers restarted after an unexpected exit (local backend).",
            ["model"],
            registry=r,
        )
