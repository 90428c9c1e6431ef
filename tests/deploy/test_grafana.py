"""The Grafana dashboard is a valid dashboard JSON model over metrics that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "tollgate.json"


def documented_metrics() -> set[str]:
    return set(re.findall(r"`(tollgate_[a-z_]+)`", (ROOT / "docs" / "metrics.md").read_text()))


def test_dashboard_model_is_complete() -> None:
    dash = json.loads(DASHBOARD.read_text())
    for key in ("uid", "title", "schemaVersion", "panels", "templating", "time"):
        assert key in dash, key
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "model"} <= variables
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
            assert target["refId"] and target["expr"]
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var in variables or var.startswith("__"), var


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
