"""The Grafana dashboards are valid dashboard JSON models over data that exists.

The operators' dashboard reads Prometheus metrics; the analysts' billing
dashboard reads ClickHouse (its queries run on the schema in
``tests/metering/test_dashboard.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tollgate.json"
BILLING = ROOT / "deploy" / "grafana" / "tollgate-billing.json"


def documented_metrics() -> set[str]:
    return set(re.findall(r"`(tollgate_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))


def check_model(dash: dict[str, Any], query: str) -> None:
    """Keys, unique ids, panels within the grid and apart, a query in each, variables defined."""
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, key
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert "datasource" in variables
    occupied: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & occupied, f"panel {panel['title']!r} overlaps another"
        occupied |= cells
        if panel["type"] == "row":
            continue
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and target[query]
            for var in re.findall(r"\$\{?(\w+)", target[query]):
                assert var in variables or var.startswith("__"), var


def test_dashboard_model_is_complete() -> None:
    dash = json.loads(DASHBOARD.read_text())
    check_model(dash, "expr")
    assert "model" in {v["name"] for v in dash["templating"]["list"]}


def test_the_billing_dashboard_reads_clickhouse() -> None:
    dash = json.loads(BILLING.read_text())
    check_model(dash, "rawSql")
    assert dash["uid"] != json.loads(DASHBOARD.read_text())["uid"]
    source = dash["templating"]["list"][0]
    assert source["name"] == "datasource" and source["query"] == "grafana-clickhouse-datasource"
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            assert target["datasource"] == {
                "type": "grafana-clickhouse-datasource",
                "uid": "${datasource}",
            }


def test_every_metric_in_the_dashboard_is_documented() -> None:
    dash = json.loads(DASHBOARD.read_text())
    documented = documented_metrics()
    used = set()
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            for name in re.findall(r"\b(tollgate_[a-z_]+)", target["expr"]):
                used.add(re.sub(r"_(bucket|count|sum)$", "", name))
    assert used, "the dashboard queries Tollgate's metrics"
    assert used <= documented, sorted(used - documented)
    # the golden signals per model: traffic, errors, latency, saturation
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    for signal in ("requests/s", "error", "first token", "queued"):
        assert signal in titles, signal
