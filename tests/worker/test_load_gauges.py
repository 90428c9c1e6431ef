"""The worker's load gauges read a heartbeat: no consumer needed, no import circle."""

from __future__ import annotations

import grimp
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker.metrics import WorkerMetrics
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState


def test_gauges_show_what_the_worker_beats() -> None:
    beat = WorkerHeartbeat(
        worker_id="w1",
        model="org/m",
        engine="simulated",
        state=WorkerState.DRAINING,
        slots_used=2,
        slots_total=8,
        queue=3,
        kv_cache_usage=0.25,
        interval_s=1.0,
        sent_at=0.0,
        startup_s=4.5,
        startup_parts={"process": 1.0, "engine": 3.5},
    )
    metrics = WorkerMetrics()
    metrics.watch(lambda: beat)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for s in family.samples
    }
    m = (("model", "org/m"),)
    assert got[("tollgate_worker_slots_used", m)] == 2
    assert got[("tollgate_worker_slots_total", m)] == 8
    assert got[("tollgate_worker_requests_waiting", m)] == 3
    assert got[("tollgate_worker_kv_cache_usage_ratio", m)] == 0.25
    assert got[("tollgate_worker_startup_seconds", m)] == 4.5
    assert got[("tollgate_worker_startup_part_seconds", (*m, ("part", "engine")))] == 3.5
    assert got[("tollgate_worker_state", (*m, ("state", "draining")))] == 1
    assert got[("tollgate_worker_state", (*m, ("state", "ready")))] == 0


def test_worker_modules_import_no_circle() -> None:
    graph = grimp.build_graph("services", cache_dir=None)
    modules = sorted(m for m in graph.modules if m.startswith("services.worker."))
    for a in modules:
        for b in modules:
            if a < b and graph.chain_exists(a, b) and graph.chain_exists(b, a):
                raise AssertionError(f"{a} and {b} import each other")
