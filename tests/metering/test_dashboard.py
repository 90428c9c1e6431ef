"""The analysts' Grafana dashboard: every query it sends runs on Tollgate's schema.

Each panel's and variable's SQL is expanded as the ClickHouse data source
expands its macros (``$__timeFilter``, ``$__timeInterval``, multi-value
variables quoted) and run on a real engine holding a few usage rows, through
the metering service's read-only query path: each runs and returns rows.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from services.metering.store import UsageStore
from tests.metering.test_invoice import insert_prices
from tests.metering.test_store import event

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tollgate-billing.json"
START = datetime(2026, 11, 1, tzinfo=UTC)
END = datetime(2026, 12, 1, tzinfo=UTC)
VALUES = {"tenant": ["acme", "globex"], "model": ["m/a", "m/b", "m/free"]}


def expand(sql: str) -> str:
    """What the data source sends for the range [START, END] and the VALUES."""
    sql = re.sub(
        r"\$__timeFilter\(([\w.]+)\)",
        lambda m: (
            f"{m[1]} >= toDateTime({int(START.timestamp())})"
            f" AND {m[1]} <= toDateTime({int(END.timestamp())})"
        ),
        sql,
    )
    sql = re.sub(
        r"\$__timeInterval\(([\w.]+)\)",
        lambda m: f"toStartOfInterval(toDateTime({m[1]}), INTERVAL 3600 second)",
        sql,
    )
    for name, values in VALUES.items():
        sql = sql.replace(f"${{{name}:singlequote}}", ",".join(f"'{v}'" for v in values))
    assert "$" not in sql, sql
    return sql


def queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    found = [(f"variable {v['name']}", v["query"]) for v in dash["templating"]["list"]]
    found = [(what, sql) for what, sql in found if isinstance(sql, str) and "SELECT" in sql]
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            found.append((panel["title"], target["rawSql"]))
    return found


@pytest.fixture
def used(store: UsageStore) -> UsageStore:
    rows = [
        event(i, time=START.timestamp() + 3600 * i + 60, model=("m/a", "m/b", "m/free")[i % 3])
        for i in range(30)
    ]
    rows[4]["outcome"] = "client_disconnected"
    rows[5]["http_status"] = 502
    store.insert(rows)
    insert_prices(
        store,
        [[m, START, None, "0.5", "1.5", "USD"] for m in ("m/a", "m/b")],
    )
    return store


def test_the_dashboard_has_a_query_for_each_question() -> None:
    titles = " ".join(what.lower() for what, _ in queries())
    for question in ("tokens by tenant", "cost by tenant", "by model", "top keys"):
        assert question in titles, question
    assert "disconnects and errors" in titles and "no price" in titles


@pytest.mark.parametrize(("what", "sql"), queries(), ids=[w for w, _ in queries()])
def test_every_query_runs_on_the_schema(used: UsageStore, what: str, sql: str) -> None:
    result = used.query(expand(sql), {}, 1000)
    assert result.error is None, f"{what}: {result.error}"
    assert result.rows, f"{what}: no rows"
    named: dict[str, Any] = dict(zip(result.columns, result.rows[0], strict=True))
    assert all(not name.startswith("$") for name in named), named
