"""The auth service's Prometheus metrics (served on ``/metrics``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AuthMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.keys = Gauge(
            "tollgate_auth_keys", "API keys on the whitelist, by state.", ["state"], registry=r
        )
        self.state_changes = Counter(
            "tollgate_auth_key_state_changes",
            "Keys the budget ledger moved to a state (over_budget: a spent budget).",
            ["state"],
            registry=r,
        )
        self.events = Counter(
            "tollgate_auth_usage_events", "Usage events the budget ledger counted.", registry=r
        )
        self.invalid_events = Counter(
            "tollgate_auth_usage_events_invalid",
            "Usage messages the budget ledger skipped: not a valid tg.usage.v1 event "
            "(malformed, or token counts, time or status out of range).",
            registry=r,
        )
