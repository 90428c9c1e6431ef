"""Optional OpenTelemetry tracing: one trace from the router through NATS to the worker."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest

from tests.conftest import OBSERVED_MODEL, Service, Stack, wait_ready

OTEL = {"OTEL_TRACES_EXPORTER": "console"}  # spans as JSON lines in each service's output


def spans(service: Service) -> list[dict[str, Any]]:
    out = []
    for line in service.log_text().splitlines():
        if line.startswith("{") and '"trace_id"' in line:
            out.append(json.loads(line))
    return out


@pytest.mark.timeout(180)
async def test_a_request_is_one_trace_across_router_and_worker(stack: Stack, api_key: str) -> None:
    router, url = stack.router(**OTEL)
    worker = stack.worker(OBSERVED_MODEL, **OTEL)
    try:
        await wait_ready(stack.nats, OBSERVED_MODEL, timeout=120)
        r = httpx.post(
            f"{url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {api_key}"},
            json={"model": OBSERVED_MODEL, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200
        request_id = r.headers["x-request-id"]
        deadline = time.monotonic() + 10
        while True:
            edge = [
                s for s in spans(router) if s["attributes"].get("tollgate.request_id") == request_id
            ]
            served = [
                s for s in spans(worker) if s["attributes"].get("tollgate.request_id") == request_id
            ]
            if (edge and served) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert len(edge) == 1 and len(served) == 1, (edge, served)
        assert edge[0]["name"] == "POST /v1/chat/completions"
        assert edge[0]["attributes"]["gen_ai.request.model"] == OBSERVED_MODEL
        assert served[0]["name"] == "worker.serve"
        # the worker's span continues the router's trace, as its child
        assert served[0]["context"]["trace_id"] == edge[0]["context"]["trace_id"]
        assert served[0]["parent_id"] == edge[0]["context"]["span_id"]
        assert edge[0]["resource"]["attributes"]["service.name"] == "tollgate-router"
        assert served[0]["resource"]["attributes"]["service.name"] == "tollgate-worker"
    finally:
        worker.stop()
        router.stop()


def test_tracing_is_off_without_otel_settings(stack: Stack, router_url: str) -> None:
    port = router_url.rsplit(":", 1)[1]
    router = next(s for s in stack.services if s.name == "router" and port in s.proc.args)
    assert spans(router) == [], "the shared router runs without OTEL_* and exports nothing"
