"""The ClickHouse schema, rollups, prices and read-only queries on a real engine."""

from __future__ import annotations

import csv
import io
import json
import random
import re
import uuid
from datetime import UTC, date, datetime
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from services.metering import store as store_module
from services.metering.exchanges import BUDGET_KEY
from services.metering.store import Migration, UsageStore, load_migrations
from tollgate.analytics import render, report_parameters, report_sql
from tollgate.models.catalog import AdapterEntry, Catalog, ModelEntry, Price
from tollgate.wire.contracts import BudgetSet, WebhookCall

DAY = datetime(2026, 11, 2, tzinfo=UTC).timestamp()


def event(i: int, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": f"req-{i}",
        "time": DAY + i * 37.0,
        "tenant": "acme" if i % 3 else "globex",
        "key_id": f"key-{i % 4}",
        "model": "m/a" if i % 2 else "m/b",
        "worker_id": "w1",
        "prompt_tokens": 10 + i % 11,
        "completion_tokens": i % 29,
        "outcome": "completed" if i % 10 else "cancelled",
        "finish_reason": "stop",
        "streamed": bool(i % 2),
        "queue_s": 0.01,
        "ttft_s": None if i % 7 == 0 else 0.05 + (i % 5) / 100,
        "total_s": 0.2 + (i % 13) / 10,
        "http_status": 200,
        "stream_seq": i + 1,
    }
    row.update(fields)
    return row


def scalar(store: UsageStore, sql: str) -> Any:
    return store.writer.query(sql).result_rows[0][0]


def test_migrations_apply_once_and_refuse_an_edited_file(
    store: UsageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert store.migrate() == []
    versions = [
        r[0] for r in store.writer.query("SELECT version FROM schema_migrations").result_rows
    ]
    assert sorted(versions) == [m.version for m in load_migrations()] and len(versions) >= 3
    edited = [Migration(m.version, m.name, m.sql + "\n-- edited\n") for m in load_migrations()]
    monkeypatch.setattr(store_module, "load_migrations", lambda: edited)
    with pytest.raises(RuntimeError, match="changed after it was applied"):
        store.migrate()


def test_rollups_equal_the_raw_rows(store: UsageStore) -> None:
    rows = [event(i) for i in range(3000)]
    for start in range(0, len(rows), 700):
        store.insert(rows[start : start + 700])
    raw = store.writer.query(
        "SELECT tenant, model, count(), sum(prompt_tokens), sum(completion_tokens),"
        " countIf(outcome != 'completed') FROM usage_events GROUP BY tenant, model ORDER BY 1, 2"
    ).result_rows
    for table in ("usage_hourly", "usage_daily"):
        rolled = store.writer.query(
            f"SELECT tenant, model, sum(requests), sum(prompt_tokens), sum(completion_tokens),"
            f" sum(failed) FROM {table} GROUP BY tenant, model ORDER BY 1, 2"
        ).result_rows
        assert rolled == raw, table
    expected = sum(r["completion_tokens"] for r in rows if r["tenant"] == "acme")
    assert scalar(
        store, "SELECT sum(completion_tokens) FROM usage_events WHERE tenant = 'acme'"
    ) == (expected)
    # Latency quantiles merge from the hourly states.
    p95 = scalar(store, "SELECT quantilesMerge(0.5, 0.95, 0.99)(total_s)[2] FROM usage_hourly")
    exact = sorted(r["total_s"] for r in rows)[int(0.95 * len(rows))]
    assert abs(p95 - exact) < 0.15


def test_cost_view_applies_the_price_in_force(store: UsageStore) -> None:
    catalog = Catalog(
        models={
            "m/a": ModelEntry(
                id="m/a",
                source="file:///nowhere",
                prices=[
                    Price(
                        valid_from=date(2026, 1, 1), prompt=Decimal("1"), completion=Decimal("2")
                    ),
                    Price(
                        valid_from=date(2026, 11, 3), prompt=Decimal("3"), completion=Decimal("5")
                    ),
                ],
            ),
            "m/b": ModelEntry(
                id="m/b",
                source="file:///nowhere",
                prices=[
                    Price(
                        valid_from=date(2026, 1, 1),
                        valid_to=date(2026, 11, 3),
                        prompt=Decimal("0.5"),
                        completion=Decimal("0.5"),
                        currency="EUR",
                    )
                ],
            ),
        }
    )
    assert store.sync_prices(catalog) == 3
    store.sync_prices(catalog)  # idempotent: read with FINAL
    assert scalar(store, "SELECT count() FROM prices FINAL") == 3
    nov2, nov3 = DAY + 3600, DAY + 86400 + 3600
    store.insert(
        [
            event(1, time=nov2, model="m/a", prompt_tokens=1_000_000, completion_tokens=500_000),
            event(3, time=nov3, model="m/a", prompt_tokens=2_000_000, completion_tokens=0),
            event(4, time=nov2, model="m/b", prompt_tokens=1_000_000, completion_tokens=1_000_000),
            event(6, time=nov3, model="m/b", prompt_tokens=10, completion_tokens=10),
        ]
    )
    got = {
        (r[0], r[1].day): (r[2], r[3], r[4])
        for r in store.writer.query(
            "SELECT model, hour, cost, currency, priced FROM usage_cost"
        ).result_rows
    }
    assert got == {
        ("m/a", 2): (Decimal("2"), "USD", True),  # 1M x 1 + 0.5M x 2
        ("m/a", 3): (Decimal("6"), "USD", True),  # the new price: 2M x 3
        ("m/b", 2): (Decimal("1"), "EUR", True),
        ("m/b", 3): (None, None, False),  # past valid_to: unpriced, not free
    }


def test_an_adapters_usage_is_priced_at_its_own_price_else_its_base_models(
    store: UsageStore,
) -> None:
    def price(prompt: str, completion: str) -> Price:
        return Price(
            valid_from=date(2026, 1, 1), prompt=Decimal(prompt), completion=Decimal(completion)
        )

    catalog = Catalog(
        models={"m/a": ModelEntry(id="m/a", source="file:///nowhere", prices=[price("1", "2")])},
        adapters={
            "m/a-plain": AdapterEntry(id="m/a-plain", base="m/a", source="file:///x"),
            "m/a-dear": AdapterEntry(
                id="m/a-dear", base="m/a", source="file:///y", prices=[price("10", "20")]
            ),
        },
    )
    assert store.sync_prices(catalog) == 3
    nov2 = DAY + 3600
    store.insert(
        [
            event(1, time=nov2, model="m/a", prompt_tokens=1_000_000, completion_tokens=0),
            event(2, time=nov2, model="m/a-plain", prompt_tokens=1_000_000, completion_tokens=0),
            event(3, time=nov2, model="m/a-dear", prompt_tokens=1_000_000, completion_tokens=0),
        ]
    )
    got = dict(store.writer.query("SELECT model, cost FROM usage_cost").result_rows)
    assert got == {"m/a": Decimal("1"), "m/a-plain": Decimal("1"), "m/a-dear": Decimal("10")}


def test_existing_ids_finds_stored_requests(store: UsageStore) -> None:
    rows = [event(i) for i in range(50)]
    store.insert(rows[:30])
    ids = [r["request_id"] for r in rows]
    found = store.existing_ids(ids, rows[0]["time"], rows[-1]["time"])
    assert found == {f"req-{i}" for i in range(30)}


def test_queries_are_read_only(store: UsageStore) -> None:
    store.insert([event(i) for i in range(20)])
    refused = [
        "INSERT INTO usage_events (request_id, tenant) VALUES ('x', 'x')",
        "SELECT 1 SETTINGS readonly = 0",
        "CREATE TABLE sneaky (a UInt8) ENGINE = Memory",
        "DROP TABLE usage_events",
        "ALTER TABLE usage_events DELETE WHERE 1",
    ]
    for sql in refused:
        result = store.query(sql, {}, max_rows=10)
        assert result.error is not None, sql
        assert any(w in result.error for w in ("single SELECT", "readonly")), (sql, result)
    assert scalar(store, "SELECT count() FROM usage_events") == 20
    # The writer is untouched by the reader's read-only mode.
    store.insert([event(100)])
    result = store.query("SELECT request_id FROM usage_events ORDER BY request_id", {}, 5)
    assert result.error is None and len(result.rows) == 5 and result.truncated
    bad = store.query("SELEC nonsense", {}, 5)
    assert bad.error is not None and bad.error.startswith("ClickHouse error 62")
    assert "Traceback" not in bad.error


def test_a_query_is_read_no_further_than_its_row_limit(
    store: UsageStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ClickHouse's own row limit does not stop a UNION of an EXCEPT: the store
    stops reading the result once it has one row more than the limit."""
    reader = store._reader
    assert reader is not None
    opened = reader.query_row_block_stream
    read: list[int] = []

    def counted(*args: Any, **kwargs: Any) -> Any:
        context = opened(*args, **kwargs)
        blocks = context.gen

        def counting() -> Any:
            for block in blocks:
                read.append(len(block))
                yield block

        context.gen = counting()
        return context

    monkeypatch.setattr(reader, "query_row_block_stream", counted)
    sql = "(SELECT number FROM numbers(3000000)) UNION ALL SELECT 1 EXCEPT SELECT 2"
    result = store.query(sql, {}, max_rows=10)
    assert result.error is None, result.error
    assert len(result.rows) == 10 and result.truncated
    assert read and sum(read) < 3_000_000 and len(read) <= 2  # a block or two, not 46


def test_a_query_is_held_to_the_memory_limit(chdb_dsn: str) -> None:
    store = UsageStore(
        chdb_dsn, f"t_{uuid.uuid4().hex[:12]}", query_max_memory_bytes=50 * 1024**2
    ).open()
    try:
        result = store.query("SELECT length(groupArray(number)) FROM numbers(20000000)", {}, 10)
        assert result.error is not None and result.error.startswith("ClickHouse error 241")
        assert store.query("SELECT count() FROM numbers(1000)", {}, 10).rows == [[1000]]
    finally:
        store.writer.command(f"DROP DATABASE IF EXISTS {store.database}")
        store.close()


def test_usage_report_by_model_key_and_day(store: UsageStore) -> None:
    rng = random.Random(7)
    rows = [event(i, prompt_tokens=rng.randint(1, 500)) for i in range(600)]
    store.insert(rows)
    acme = [r for r in rows if r["tenant"] == "acme"]
    params = report_parameters("acme", date(2026, 11, 1), date(2026, 12, 1))
    by_model = store.query(report_sql("model"), params, 100)
    assert by_model.error is None, by_model.error
    got = {r[0]: (r[1], r[2], r[3]) for r in by_model.rows}
    want: dict[str, tuple[int, int, int]] = {}
    for r in acme:
        n, p, c = want.get(r["model"], (0, 0, 0))
        want[r["model"]] = (n + 1, p + r["prompt_tokens"], c + r["completion_tokens"])
    assert got == want
    by_key = store.query(report_sql("key"), params, 100)
    assert sum(r[1] for r in by_key.rows) == len(acme) and len(by_key.rows) == 4
    by_day = store.query(report_sql("day"), params, 100)
    days = {datetime.fromtimestamp(r["time"], UTC).date().isoformat() for r in acme}
    assert {r[0] for r in by_day.rows} == days
    # Nothing outside the range, nothing of other tenants.
    empty = store.query(
        report_sql("model"), report_parameters("acme", date(2026, 12, 1), date(2027, 1, 1)), 9
    )
    assert empty.rows == []

    table = render(by_model, "table").splitlines()
    assert table[0].split()[:3] == ["model", "requests", "prompt_tokens"]
    assert len(table) == 2 + len(want)
    parsed = list(csv.DictReader(io.StringIO(render(by_model, "csv"))))
    assert {r["model"]: int(r["requests"]) for r in parsed} == {m: v[0] for m, v in want.items()}
    objects = json.loads(render(by_model, "json"))
    assert {o["model"]: o["completion_tokens"] for o in objects} == {
        m: v[2] for m, v in want.items()
    }


def test_every_query_in_the_analytics_guide_runs(store: UsageStore) -> None:
    guide = (Path(__file__).parents[2] / "docs" / "analytics.md").read_text()
    queries = re.findall(r"```sql\n(.*?)```", guide, re.S)
    assert len(queries) >= 6
    # Recent rows (for queries relative to today) and rows in the month the
    # invoice example names.
    now = datetime.now(UTC).timestamp()
    store.insert([event(i, time=now - i * 60.0) for i in range(100)])
    store.insert([event(i, time=DAY + 13 * 86400 + i) for i in range(100, 200)])
    # captured exchanges (a cut-off answer, a long prompt, a loop) and a replay
    loop = "I am sure. " * 30
    store.insert_json(
        "exchanges",
        [
            exchange_row("x-1", now - 60, finish_reason="length", completion_tokens=512),
            exchange_row("x-2", now - 120, prompt_tokens=40_000),
            exchange_row("x-3", now - 180, response_text=loop),
        ],
        ("request_id",),
    )
    store.insert_json(
        "replays",
        [
            {
                "replay_id": "r1",
                "request_id": "x-1",
                "time": now,
                "original_model": "m/a",
                "model": "m/b",
                "http_status": 200,
                "original_completion_tokens": 512,
                "completion_tokens": 100,
                "original_finish_reason": "length",
                "finish_reason": "stop",
                "original_total_s": 3.0,
                "total_s": 1.0,
                "exact_match": False,
                "original_repetition": 0.0,
                "repetition": 0.0,
            }
        ],
        ("request_id",),
    )
    billing_rows(store, now)
    for sql in queries:
        result = store.query(sql.replace("'…'", "'req-1'"), {}, 100)
        assert result.error is None, (sql, result.error)
        if "raw != rolled" in sql:
            assert result.rows == [], "the rollup check finds no gap"
        else:
            assert result.rows, sql


def exchange_row(request_id: str, at: float, **fields: Any) -> dict[str, Any]:
    row: dict[str, Any] = {
        "request_id": request_id,
        "time": at,
        "tenant": "acme",
        "model": "m/a",
        "endpoint": "chat.completions",
        "streamed": False,
        "request_body": "{}",
        "request_truncated": False,
        "response_text": "hi",
        "response_body": "{}",
        "response_truncated": False,
        "outcome": "completed",
        "http_status": 200,
        "total_s": 0.1,
    }
    row.update(fields)
    return row


def test_a_block_inserted_again_is_dropped_everywhere(store: UsageStore) -> None:
    rows = [event(i) for i in range(50)]
    store.insert(rows)
    store.insert(list(reversed(rows)))  # a retry: the same rows make the same token
    for table, column in (("usage_events", "count()"), ("usage_hourly", "sum(requests)")):
        assert scalar(store, f"SELECT {column} FROM {table}") == 50, table
    assert scalar(store, "SELECT sum(requests) FROM usage_daily") == 50
    store.insert(rows[:10])  # a different block is a different insert
    assert scalar(store, "SELECT sum(requests) FROM usage_daily") == 60


def lose_rollups(store: UsageStore, day: date, where: str = "") -> None:
    """Both rollups of ``day`` (of the rows ``where`` picks) lost, as a crash between an
    insert's raw write and its rollup writes leaves them."""
    for table, column in (("usage_hourly", "toDate(hour)"), ("usage_daily", "day")):
        store.writer.command(
            f"ALTER TABLE {table} DELETE WHERE {column} = {{d:Date}} {where}",
            parameters={"d": day},
            settings={"mutations_sync": 2},
        )


def test_rollups_left_short_are_rebuilt_from_the_raw_rows(store: UsageStore) -> None:
    now = datetime.now(UTC).timestamp()
    rows = [event(i, time=now - i * 400.0) for i in range(400)]  # about two days
    store.insert(rows)
    old = [event(i, time=now - 10 * 86400 - i) for i in range(1000, 1010)]
    store.insert(old)
    assert store.repair_rollups(days=3) == []
    # A crash between the raw write and the rollup writes: rows missing from both rollups,
    # on a day that has rows whatever the time of the run (six hours ago: rows cover ~44 h).
    damaged = datetime.fromtimestamp(now - 6 * 3600, UTC).date()
    lose_rollups(store, damaged, "AND tenant = 'acme'")
    assert store.repair_rollups(days=3) == [damaged]
    raw = scalar(store, "SELECT count() FROM usage_events FINAL")
    assert raw == 410
    assert scalar(store, "SELECT sum(requests) FROM usage_hourly") == raw
    assert scalar(store, "SELECT sum(requests) FROM usage_daily") == raw
    assert scalar(store, "SELECT sum(completion_tokens) FROM usage_daily") == sum(
        r["completion_tokens"] for r in rows + old
    )
    assert store.repair_rollups(days=3) == []  # repaired, and a second pass changes nothing


def test_rollups_of_an_old_day_ingested_lately_are_checked(store: UsageStore) -> None:
    """A backlog (metering down for days) brings rows of an old day; a crash while
    ingesting it leaves that day short, and the check at start finds it."""
    now = datetime.now(UTC).timestamp()
    backlog = [event(i, time=now - 9 * 86400 - i, request_id=f"late-{i}") for i in range(20)]
    store.insert(backlog)
    old_day = datetime.fromtimestamp(now - 9 * 86400, UTC).date()
    lose_rollups(store, old_day)
    assert store.repair_rollups(days=2) == [old_day]
    assert scalar(
        store, f"SELECT sum(requests) FROM usage_daily WHERE day = '{old_day.isoformat()}'"
    ) == len(backlog)
    # rows ingested before the window are not read again
    store.writer.command(
        "ALTER TABLE usage_events UPDATE ingested_at = ingested_at - INTERVAL 5 DAY"
        " WHERE startsWith(request_id, 'late-')",
        settings={"mutations_sync": 2},
    )
    store.writer.command(
        "ALTER TABLE usage_daily DELETE WHERE day = {d:Date}",
        parameters={"d": old_day},
        settings={"mutations_sync": 2},
    )
    assert store.repair_rollups(days=2) == []


def test_the_scalers_demand_history_query(store: UsageStore) -> None:
    """The scaler's hour-of-week profile, from the SQL it asks the metering service to run."""
    from services.scaler.profile import HISTORY_SQL, WEEK_S, DemandProfile, hour_of_week

    now = datetime.now(UTC).timestamp()
    slot = (now - 3 * 3600) // 3600 * 3600 + 60  # three hours ago, one minute into the hour
    rows = [
        # 10 requests of 60 s in one 5-minute slot: 2 requests in flight, a week and two ago
        event(1000 + 10 * week + i, time=slot - week * WEEK_S, model="m/p", total_s=60.0)
        for week in (1, 2)
        for i in range(10)
    ]
    store.insert(rows)
    result = store.query(HISTORY_SQL, {"weeks": 4}, 1000)
    assert result.error is None, result.error
    profile = DemandProfile.from_rows(result.rows, weeks=4, now=now)
    how = hour_of_week(slot)
    # peaks of 2.0 in two of the three times that hour came round since the first event
    assert profile.loads["m/p"][how] == pytest.approx(4.0 / 3)
    assert sum(profile.loads["m/p"]) == pytest.approx(4.0 / 3)


def test_a_block_of_captures_sent_again_is_dropped_at_once(store: UsageStore) -> None:
    """Not left as duplicates until a merge: every table written from a stream
    remembers its recent blocks, so the writer's retry token counts."""
    now = datetime.now(UTC).timestamp()
    block = [exchange_row("a", now), exchange_row("b", now)]
    store.insert_json("exchanges", block, ("request_id",))
    store.insert_json("exchanges", block, ("request_id",))
    assert scalar(store, "SELECT count() FROM exchanges") == 2
    remembering = {
        name
        for (name,) in store.writer.query(
            "SELECT name FROM system.tables WHERE database = currentDatabase()"
            " AND engine_full LIKE '%non_replicated_deduplication_window = 1000%'"
        ).result_rows
    }
    assert {"exchanges", "replays", "budgets", "webhook_calls", "usage_events"} <= remembering


def test_captured_exchanges_expire_after_the_retention(store: UsageStore) -> None:
    now = datetime.now(UTC).timestamp()

    def exchange(request_id: str, age_days: float) -> dict[str, Any]:
        return exchange_row(request_id, now - age_days * 86400)

    store.set_capture_retention(10)
    engine = "SELECT engine_full FROM system.tables WHERE database = currentDatabase()"
    assert "toIntervalDay(10)" in scalar(store, f"{engine} AND name = 'exchanges'")
    store.insert_json("exchanges", [exchange("old", 12), exchange("new", 1)], ("request_id",))
    store.insert_json("exchanges", [exchange("old", 12), exchange("new", 1)], ("request_id",))
    store.writer.command("OPTIMIZE TABLE exchanges FINAL")
    kept = store.writer.query("SELECT request_id FROM exchanges ORDER BY request_id").result_rows
    assert kept == [("new",)], "the 12-day-old row expired; the block sent twice is stored once"
    store.set_capture_retention(10)  # unchanged: no ALTER
    store.set_capture_retention(30)
    assert "toIntervalDay(30)" in scalar(store, f"{engine} AND name = 'exchanges'")


def test_the_fault_switch_fails_inserts_only_while_its_file_exists(
    store: UsageStore, tmp_path: Path
) -> None:
    switch = tmp_path / "fail-inserts"
    store.fault_file = switch
    first = [event(i, request_id=f"fault-{i}") for i in range(5)]
    count = "SELECT count() FROM usage_events WHERE request_id LIKE 'fault-%'"
    store.insert(first)  # no file: no fault
    assert scalar(store, count) == 5

    switch.write_text("")
    refused = [event(i, request_id=f"fault-{i}") for i in range(5, 9)]
    with pytest.raises(store_module.StoreUnavailable, match="refused"):
        store.insert(refused)
    assert scalar(store, count) == 5  # refused before anything was written

    switch.write_text("after")
    with pytest.raises(store_module.StoreUnavailable, match="reported as failed"):
        store.insert(refused)
    assert scalar(store, count) == 9  # written, then reported as failed

    switch.unlink()
    store.insert(refused)  # the retry of an unclear failure is dropped as a duplicate
    assert scalar(store, count) == 9


def billing_rows(store: UsageStore, now: float) -> None:
    """Webhook calls and budgets, as the metering service stores them from the bus."""
    calls = [
        WebhookCall(
            call_id=f"call-{i}",
            alert_id="key-1.20261203.tokens.5000.80",
            webhook_id="wh-1",
            tenant="acme",
            url="https://hooks.example.com/tollgate",
            attempt=i + 1,
            time=now - 60 + i * 10,
            outcome="delivered" if i == 2 else "unreachable" if i == 0 else "refused",
            http_status=None if i == 0 else 204 if i == 2 else 503,
            error="ClientConnectorError" if i == 0 else None,
            seconds=0.05,
        )
        for i in range(3)
    ]
    store.insert_json("webhook_calls", [_row(c) for c in calls], ("call_id",))
    budgets = [
        BudgetSet(
            scope="key",
            tenant="acme",
            key_id="key-1",
            revision=7,
            time=now,
            period="total",
            budget_tokens=5000,
            state="active",
        ),
        BudgetSet(
            scope="tenant",
            tenant="acme",
            revision=3,
            time=now,
            period="month",
            budget_amount="25.5",
            budget_currency="USD",
            state="active",
        ),
        # an older version of the key's budgets, and a tenant whose limits were cleared
        BudgetSet(
            scope="key",
            tenant="acme",
            key_id="key-1",
            revision=5,
            time=now - 9,
            period="day",
            budget_tokens=10,
            state="active",
        ),
        BudgetSet(
            scope="tenant",
            tenant="globex",
            revision=4,
            time=now,
            period="day",
            budget_tokens=1,
            state="active",
        ),
        BudgetSet(scope="tenant", tenant="globex", revision=6, time=now, state="removed"),
    ]
    store.insert_json("budgets", [_row(b) for b in budgets], BUDGET_KEY)


def _row(event: WebhookCall | BudgetSet) -> dict[str, Any]:
    return event.model_dump(mode="json", exclude={"type"})


def test_budgets_keep_the_latest_version_of_each_key_and_tenant(store: UsageStore) -> None:
    now = datetime.now(UTC).timestamp()
    billing_rows(store, now)
    billing_rows(store, now)  # the same blocks again (a redelivered batch): no new rows
    current = store.writer.query(
        "SELECT scope, tenant, key_id, period, budget_tokens, toString(budget_amount),"
        " budget_currency, period_start = toStartOfMonth(now('UTC')) FROM budgets_current"
        " ORDER BY scope"
    ).result_rows
    assert current == [
        ("key", "acme", "key-1", "total", 5000, None, None, False),
        ("tenant", "acme", "", "month", None, "25.5", "USD", True),
    ]
    calls = store.writer.query(
        "SELECT attempt, outcome, http_status, error FROM webhook_calls ORDER BY time"
    ).result_rows
    assert calls == [
        (1, "unreachable", None, "ClientConnectorError"),
        (2, "refused", 503, None),
        (3, "delivered", 204, None),
    ]
