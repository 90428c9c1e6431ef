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
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from services.metering.store import UsageStore
from tests.metering.test_invoice import insert_prices
from tests.metering.test_store import billing_rows, event

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
    rows.append(
        event(99, time=datetime.now(UTC).timestamp(), model="m/a", key_id="key-1", tenant="acme")
    )
    rows[5]["http_status"] = 502
    store.insert(rows)
    insert_prices(
        store,
        [[m, START, None, "0.5", "1.5", "USD"] for m in ("m/a", "m/b")],
    )
    billing_rows(store, START.timestamp() + 86400)  # budgets, and webhook calls in the range
    return store


def test_the_dashboard_has_a_query_for_each_question() -> None:
    titles = " ".join(what.lower() for what, _ in queries())
    for question in ("tokens by tenant", "cost by tenant", "by model", "top keys"):
        assert question in titles, question
    assert "disconnects and errors" in titles and "no price" in titles
    assert "spend against budget" in titles and "webhook deliveries" in titles


@pytest.mark.parametrize(("what", "sql"), queries(), ids=[w for w, _ in queries()])
def test_every_query_runs_on_the_schema(used: UsageStore, what: str, sql: str) -> None:
    result = used.query(expand(sql), {}, 1000)
    assert result.error is None, f"{what}: {result.error}"
    assert result.rows, f"{what}: no rows"
    named: dict[str, Any] = dict(zip(result.columns, result.rows[0], strict=True))
    assert all(not name.startswith("$") for name in named), named


def test_spend_against_budget_counts_each_budgets_current_period(used: UsageStore) -> None:
    (sql,) = [sql for what, sql in queries() if what == "Spend against budget"]
    result = used.query(expand(sql), {}, 100)
    assert result.error is None, result.error
    got = {
        (r["scope"], r["key"]): r
        for r in (dict(zip(result.columns, row, strict=True)) for row in result.rows)
    }
    assert set(got) == {("key", "key-1"), ("tenant", "")}  # globex's limits were cleared

    def tokens(where: str) -> int:
        return int(
            used.writer.query(
                f"SELECT sum(prompt_tokens + completion_tokens) FROM usage_events WHERE {where}"
            ).result_rows[0][0]
        )

    # key-1's budget counts in total: every row of the key
    key = got[("key", "key-1")]
    assert key["spent_tokens"] == tokens("tenant = 'acme' AND key_id = 'key-1'") > 0
    assert key["tokens_pct"] == round(100 * key["spent_tokens"] / 5000, 1)
    # the tenant's money budget counts this month only: the one recent row, on m/a
    tenant = got[("tenant", "")]
    assert tenant["period"] == "month" and tenant["currency"] == "USD"
    recent = used.writer.query(
        "SELECT prompt_tokens, completion_tokens FROM usage_events WHERE request_id = 'req-99'"
    ).result_rows[0]
    assert tenant["spent_tokens"] == sum(recent)
    assert (
        tenant["spent_amount"]
        == (Decimal(recent[0]) * Decimal("0.5") + Decimal(recent[1]) * Decimal("1.5")) / 1_000_000
    )
