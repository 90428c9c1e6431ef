"""The metering service's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LAG_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30, 60, 300)


class MeteringMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.consumed = Counter(
            "tollgate_metering_events_consumed", "Usage messages read from the stream.", registry=r
        )
        self.inserted = Counter(
            "tollgate_metering_events_inserted", "Usage rows inserted into ClickHouse.", registry=r
        )
        self.duplicates = Counter(
            "tollgate_metering_events_duplicate",
            "Usage events skipped because their request id was already stored.",
            registry=r,
        )
        self.dead_lettered = Counter(
            "tollgate_metering_events_dead_lettered",
            "Usage messages sent to the dead-letter stream.",
            registry=r,
        )
        self.insert_failures = Counter(
            "tollgate_metering_insert_failures",
            "Inserts that failed because ClickHouse was unavailable (then retried).",
            registry=r,
        )
        self.insert_seconds = Histogram(
            "tollgate_metering_insert_seconds", "Time to insert one batch.", registry=r
        )
        self.lag = Histogram(
            "tollgate_metering_lag_seconds",
            "From a batch's newest request end to its rows being stored.",
            buckets=_LAG_BUCKETS,
            registry=r,
        )
        self.pending = Gauge(
            "tollgate_metering_consumer_pending",
            "Usage events in the stream not yet delivered to the writer (consumer lag).",
            registry=r,
        )
        self.queries = Counter(
            "tollgate_metering_queries", "Read-only queries answered.", ["result"], registry=r
        )
