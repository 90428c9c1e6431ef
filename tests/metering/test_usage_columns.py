"""A usage row's attempts and class (migration 0007) and endpoint (0008), on the real
ClickHouse engine (chDB)."""

from __future__ import annotations

import time
import uuid
from typing import Any

import orjson
import pytest

from services.metering import store as store_module
from services.metering.ingest import to_row
from services.metering.store import UsageStore, load_migrations
from tests.metering.test_ingest import Harness, harness, usage  # noqa: F401  (a fixture)

COLUMNS = "SELECT request_id, attempts, priority FROM usage_events ORDER BY request_id"


def stored(store: UsageStore) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in store.writer.query(COLUMNS).result_rows]


def test_the_columns_have_their_types_and_defaults(store: UsageStore) -> None:
    columns = {
        row[0]: (row[1], row[2])
        for row in store.writer.query(
            "SELECT name, type, default_expression FROM system.columns"
            " WHERE database = {db:String} AND table = 'usage_events'"
            " AND name IN ('attempts', 'priority')",
            parameters={"db": store.database},
        ).result_rows
    }
    assert columns == {
        "attempts": ("UInt8", "1"),
        "priority": ("LowCardinality(String)", "'interactive'"),
    }


def test_a_row_carries_the_events_attempts_and_class() -> None:
    row = to_row(orjson.dumps(usage(1, attempts=2, priority="batch")), 7, time.time())
    assert (row["attempts"], row["priority"]) == (2, "batch")
    assert type(row["priority"]) is str


def test_an_event_without_them_is_one_interactive_attempt() -> None:
    row = to_row(orjson.dumps(usage(1)), 7, time.time())
    assert (row["attempts"], row["priority"]) == (1, "interactive")


async def test_events_land_with_their_values_or_the_defaults(harness: Harness) -> None:  # noqa: F811
    await harness.publish(usage(1, attempts=2, priority="batch"), msg_id="r00001")
    await harness.publish(usage(2), msg_id="r00002")  # a router without the fields
    await harness.publish(usage(3, priority="interactive", attempts=1), msg_id="r00003")
    await harness.until(lambda: harness.count("SELECT count() FROM usage_events") == 3)
    assert stored(harness.store) == [
        ("r00001", 2, "batch"),
        ("r00002", 1, "interactive"),
        ("r00003", 1, "interactive"),
    ]


def test_rows_without_the_columns_take_the_tables_defaults(store: UsageStore) -> None:
    row = to_row(orjson.dumps(usage(1)), 1, time.time())
    del row["attempts"], row["priority"]  # a writer that predates them
    store.insert([row])
    assert stored(store) == [("r00001", 1, "interactive")]


def test_existing_tables_get_the_columns_and_keep_their_rows(
    chdb_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = UsageStore(chdb_dsn, f"t_{uuid.uuid4().hex[:12]}").open()
    try:
        every = [m for m in load_migrations() if m.version < 9]
        before = [m for m in every if m.version < 7]
        monkeypatch.setattr(store_module, "load_migrations", lambda: before)
        store.migrate()
        old = to_row(orjson.dumps(usage(1, attempts=2, priority="batch")), 1, time.time())
        store.insert([old])  # the fields are unknown columns yet: skipped
        monkeypatch.setattr(store_module, "load_migrations", lambda: every)
        assert [m.name for m in store.migrate()] == ["attempts_priority", "endpoint"]
        new = to_row(orjson.dumps(usage(2, attempts=2, priority="batch")), 2, time.time())
        store.insert([new])
        assert stored(store) == [("r00001", 1, "interactive"), ("r00002", 2, "batch")]
        # the rollups still count every row once
        assert store.writer.query("SELECT sum(requests) FROM usage_daily").result_rows == [(2,)]
    finally:
        store.writer.command(f"DROP DATABASE IF EXISTS {store.database}")
        store.close()


def test_the_endpoint_column_has_its_type_and_default(store: UsageStore) -> None:
    [(kind, default)] = store.writer.query(
        "SELECT type, default_expression FROM system.columns"
        " WHERE database = {db:String} AND table = 'usage_events' AND name = 'endpoint'",
        parameters={"db": store.database},
    ).result_rows
    assert (kind, default) == ("LowCardinality(String)", "''")


def test_a_row_carries_the_events_endpoint_or_none_said(store: UsageStore) -> None:
    said = to_row(orjson.dumps(usage(1, endpoint="embeddings")), 1, time.time())
    unsaid = to_row(orjson.dumps(usage(2)), 2, time.time())  # a router that predates it
    assert (said["endpoint"], unsaid["endpoint"]) == ("embeddings", "")
    older = dict(unsaid, request_id="r00003")
    del older["endpoint"]  # a writer that predates the column
    store.insert([said, unsaid, older])
    rows = store.writer.query("SELECT request_id, endpoint FROM usage_events ORDER BY request_id")
    assert [tuple(r) for r in rows.result_rows] == [
        ("r00001", "embeddings"),
        ("r00002", ""),
        ("r00003", ""),
    ]
