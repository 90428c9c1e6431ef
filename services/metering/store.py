"""ClickHouse access for the metering service: schema, inserts and read-only queries.

The same SQL runs on the embedded engine (``chdb:///path``: ClickHouse in this
process) and on a ClickHouse server (``http(s)://...``). clickhouse-connect
has no async client for chDB, so every method here is blocking; the service
calls them from worker threads.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from importlib import resources
from pathlib import Path
from typing import Any

import clickhouse_connect
import orjson
from clickhouse_connect.driver.client import Client
from clickhouse_connect.driver.exceptions import DatabaseError, OperationalError

from services.metering.sqlguard import RefusedQuery, vet
from tollgate.models.catalog import Catalog
from tollgate.wire.contracts import QueryResult

log = logging.getLogger("tollgate.metering.store")

USAGE_TABLE = "usage_events"
_STATEMENT_END = re.compile(r";\s*(?:\n|$)")


# ClickHouse error codes that mean "this data cannot be stored": only these
# make the writer look for the rows to blame (and dead-letter them).
DATA_ERRORS = frozenset(
    {
        6,  # CANNOT_PARSE_TEXT
        26,  # CANNOT_PARSE_QUOTED_STRING
        27,  # CANNOT_PARSE_INPUT_ASSERTION_FAILED
        38,  # CANNOT_PARSE_DATE
        41,  # CANNOT_PARSE_DATETIME
        53,  # TYPE_MISMATCH
        69,  # ARGUMENT_OUT_OF_BOUND
        70,  # CANNOT_CONVERT_TYPE
        72,  # CANNOT_PARSE_NUMBER
        117,  # INCORRECT_DATA
        131,  # TOO_LARGE_STRING_SIZE
        321,  # VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
        349,  # CANNOT_INSERT_NULL_IN_ORDINARY_COLUMN
    }
)


def error_code(exc: Exception) -> int | None:
    code = getattr(exc, "code", None)
    if isinstance(code, int):
        return code
    match = re.search(r"Code: (\d+)\.", str(exc))
    return int(match[1]) if match else None


class StoreUnavailable(Exception):
    """ClickHouse cannot be reached (retry later); not a problem with the data."""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()

    @property
    def statements(self) -> list[str]:
        return [s.strip() for s in _STATEMENT_END.split(self.sql) if _has_code(s)]


def _has_code(text: str) -> bool:
    return any(line.strip() and not line.strip().startswith("--") for line in text.splitlines())


def load_migrations() -> list[Migration]:
    """The versioned schema files, in order (``NNNN_name.sql``)."""
    folder = resources.files("services.metering").joinpath("migrations")
    found = []
    for item in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", item.name)
        if match:
            found.append(Migration(int(match[1]), match[2], item.read_text()))
    return sorted(found, key=lambda m: m.version)


def _client(dsn: str, database: str | None = None) -> Client:
    kwargs: dict[str, Any] = {"dsn": dsn}
    if database is not None:
        kwargs["database"] = database
    if not dsn.startswith("chdb:"):
        kwargs.update(connect_timeout=5, send_receive_timeout=60, autogenerate_session_id=False)
    try:
        return clickhouse_connect.get_client(**kwargs)
    except OperationalError as exc:
        raise StoreUnavailable(str(exc)) from exc


def _midnight(day: date) -> datetime:
    return datetime.combine(day, datetime.min.time(), UTC)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime | date):
        return value.isoformat()
    if isinstance(value, bytes):
        return value.decode(errors="replace")
    return value


class UsageStore:
    """The metering service's ClickHouse connection (the only writer)."""

    def __init__(
        self,
        dsn: str,
        database: str,
        query_timeout_s: float = 30.0,
        query_dsn: str | None = None,
        query_max_memory_bytes: int = 2 * 1024**3,
        fault_file: Path | None = None,
    ) -> None:
        self.dsn = dsn
        self.fault_file = fault_file  # fault injection (soak runs); None: off
        self.database = database
        self.query_timeout_s = query_timeout_s
        self.query_max_memory_bytes = query_max_memory_bytes
        self.embedded = dsn.startswith("chdb:")
        # On a server, analysts' statements run as a user whose profile
        # (readonly = 1, its own limits, SELECT on the database only) the
        # server enforces; see deploy/clickhouse/users.d/tollgate.xml.
        self.query_dsn = None if self.embedded else query_dsn
        self._writer: Client | None = None
        self._reader: Client | None = None

    # -- connection --------------------------------------------------------

    def open(self) -> UsageStore:
        if self.embedded:
            path = self.dsn.removeprefix("chdb://")
            if path.startswith("/"):
                Path(path).mkdir(parents=True, exist_ok=True)
        admin = _client(self.dsn)
        try:
            admin.command(f"CREATE DATABASE IF NOT EXISTS {self.database}")
        finally:
            admin.close()
        self._writer = _client(self.dsn, self.database)
        try:
            self._reader = _client(self.query_dsn or self.dsn, self.database)
        except Exception:
            self._writer.close()
            raise
        if self.embedded:
            # A chDB handle applies per-query settings with SET and restores
            # them afterwards, which `readonly` forbids; this handle is made
            # read-only once, for good. (`readonly = 2` still lets a query set
            # its own limits, never `readonly` itself.)
            self._reader.command("SET readonly = 2")
        elif self.query_dsn is None:
            log.warning(
                "no query DSN (TOLLGATE_METERING_QUERY_DSN): analysts' queries run on the "
                "writer's user with readonly = 2; give them the read-only analyst user"
            )
        return self

    @property
    def writer(self) -> Client:
        if self._writer is None:
            raise RuntimeError("store is not open")
        return self._writer

    def ping(self) -> bool:
        try:
            self.writer.command("SELECT 1")
        except (DatabaseError, OperationalError):
            return False
        return True

    def close(self) -> None:
        for client in (self._reader, self._writer):
            if client is not None:
                client.close()
        self._reader = self._writer = None

    # -- schema ------------------------------------------------------------

    def migrate(self) -> list[Migration]:
        """Apply the migrations not applied yet; the ones applied now."""
        client = self.writer
        client.command(
            "CREATE TABLE IF NOT EXISTS schema_migrations"
            " (version UInt32, name String, checksum String,"
            " applied_at DateTime64(3, 'UTC') DEFAULT now64(3))"
            " ENGINE = MergeTree ORDER BY version"
        )
        applied = {
            int(row[0]): str(row[1])
            for row in client.query("SELECT version, checksum FROM schema_migrations").result_rows
        }
        done = []
        for migration in load_migrations():
            known = applied.get(migration.version)
            if known is not None:
                if known != migration.checksum:
                    raise RuntimeError(
                        f"migration {migration.version:04d}_{migration.name} was changed after "
                        "it was applied; add a new migration instead"
                    )
                continue
            for statement in migration.statements:
                client.command(statement)
            client.insert(
                "schema_migrations",
                [[migration.version, migration.name, migration.checksum]],
                column_names=["version", "name", "checksum"],
            )
            log.info("migration applied", extra={"version": migration.version})
            done.append(migration)
        return done

    def sync_prices(self, catalog: Catalog) -> int:
        """Write the catalog's prices.

        Rows are keyed by (model, valid_from) in a ReplacingMergeTree and read
        with FINAL, so writing them on every start is idempotent, and a price
        edited in the catalog replaces the stored one. An adapter's rows are
        its own prices, or its base model's when it has none.
        """
        billed = [*catalog.models, *catalog.adapters]
        rows = [
            [
                model,
                _midnight(price.valid_from),
                None if price.valid_to is None else _midnight(price.valid_to),
                price.prompt,
                price.completion,
                price.currency,
            ]
            for model in billed
            for price in catalog.prices_of(model)
        ]
        if rows:
            self.writer.insert(
                "prices",
                rows,
                column_names=[
                    "model",
                    "valid_from",
                    "valid_to",
                    "prompt_per_million",
                    "completion_per_million",
                    "currency",
                ],
            )
        return len(rows)

    def repair_rollups(self, days: int) -> list[date]:
        """Rebuild the rollups of the days that disagree with the raw rows.

        Only a crash between an insert's raw write and its rollup writes can
        cause a gap, so this runs at start, before any new insert. It checks
        the last ``days`` days, and every day of the rows ingested in them:
        a backlog (metering down for a weekend, a router's outbox replayed
        after a long outage) brings rows of older days, and a crash while
        ingesting it leaves those days short.
        """
        since = datetime.now(UTC) - timedelta(days=days)
        parameters = {"since": since.date(), "since_ts": since}
        touched = (
            "(SELECT DISTINCT toDate(time) FROM usage_events"
            " WHERE ingested_at >= {since_ts:DateTime64(3)})"
        )
        bad: set[date] = set()
        for table, day_expr in (("usage_daily", "day"), ("usage_hourly", "toDate(hour)")):
            rows = self.writer.query(
                "SELECT DISTINCT day FROM"
                " (SELECT toDate(time) AS day, tenant, model, count() AS raw"
                "  FROM usage_events FINAL"
                f"  WHERE toDate(time) >= {{since:Date}} OR toDate(time) IN {touched}"
                "  GROUP BY day, tenant, model) AS r"
                " FULL OUTER JOIN"
                f" (SELECT {day_expr} AS day, tenant, model, sum(requests) AS rolled"
                f"  FROM {table} WHERE {day_expr} >= {{since:Date}} OR {day_expr} IN {touched}"
                "  GROUP BY day, tenant, model) AS d"
                " USING (day, tenant, model)"
                " WHERE raw != rolled",
                parameters=parameters,
            ).result_rows
            bad.update(row[0] for row in rows)
        for day in sorted(bad):
            for table, day_expr in (("usage_hourly", "toDate(hour)"), ("usage_daily", "day")):
                self.writer.command(
                    f"ALTER TABLE {table} DELETE WHERE {day_expr} = {{day:Date}}",
                    parameters={"day": day},
                    settings={"mutations_sync": 2},
                )
                # insert_deduplicate off: a rebuilt block may equal an earlier one.
                self.writer.command(
                    f"INSERT INTO {table} SELECT * FROM {table}_rebuild(day = {{day:Date}})",
                    parameters={"day": day},
                    settings={"insert_deduplicate": 0},
                )
            log.warning("rollups rebuilt from the raw rows", extra={"day": day.isoformat()})
        return sorted(bad)

    # -- writes ------------------------------------------------------------

    def existing_ids(self, ids: list[str], time_from: float, time_to: float) -> set[str]:
        """The ids among ``ids`` already stored (rows of one event share its time)."""
        if not ids:
            return set()
        result = self._call_any(
            self.writer.query,
            f"SELECT request_id FROM {USAGE_TABLE}"
            " WHERE time >= toDateTime64({lo:Float64}, 3, 'UTC')"
            " AND time <= toDateTime64({hi:Float64}, 3, 'UTC')"
            " AND request_id IN {ids:Array(String)}",
            parameters={"lo": time_from - 0.001, "hi": time_to + 0.001, "ids": ids},
        )
        return {str(row[0]) for row in result.result_rows}

    def insert(self, rows: list[dict[str, Any]]) -> None:
        """Insert usage rows (JSON objects with the usage_events columns)."""
        if not rows:
            return
        block = b"\n".join(orjson.dumps(row) for row in rows)
        # The same rows always make the same token: a block inserted again
        # (a retry after an unclear failure) is dropped by ClickHouse, in the
        # raw table and in the rollups its materialized views feed.
        ids = "\n".join(sorted(str(row["request_id"]) for row in rows))
        token = hashlib.sha256(ids.encode()).hexdigest()
        fault = self._injected_fault()
        if fault == "before":
            raise StoreUnavailable("injected fault: insert refused")
        self._call(
            self.writer.raw_insert,
            USAGE_TABLE,
            insert_block=block,
            fmt="JSONEachRow",
            settings={
                "input_format_skip_unknown_fields": 1,
                "insert_deduplication_token": token,
                "deduplicate_blocks_in_dependent_materialized_views": 1,
            },
        )
        if fault == "after":
            raise StoreUnavailable("injected fault: insert written, reported as failed")

    def _injected_fault(self) -> str | None:
        """The fault switch (``fault_file``): None (off), "before" or "after" the write."""
        if self.fault_file is None:
            return None
        try:
            mode = self.fault_file.read_text().strip()
        except OSError:
            return None  # no file: no fault
        return "after" if mode == "after" else "before"

    def insert_json(self, table: str, rows: list[dict[str, Any]], key: tuple[str, ...]) -> None:
        """Insert JSON rows into ``table``; a block sent again (same ``key`` values) is dropped."""
        if not rows:
            return
        block = b"\n".join(orjson.dumps(row) for row in rows)
        ids = "\n".join(sorted("|".join(str(row[k]) for k in key) for row in rows))
        token = f"{table}:" + hashlib.sha256(ids.encode()).hexdigest()
        self._call(
            self.writer.raw_insert,
            table,
            insert_block=block,
            fmt="JSONEachRow",
            settings={
                "input_format_skip_unknown_fields": 1,
                "insert_deduplication_token": token,
            },
        )

    def set_capture_retention(self, days: int) -> None:
        """Captured exchanges expire ``days`` after their request (changed only if different)."""
        ttl = f"toDateTime(time) + toIntervalDay({int(days)})"
        current = self.writer.query(
            "SELECT engine_full FROM system.tables WHERE database = {db:String}"
            " AND name = 'exchanges'",
            parameters={"db": self.database},
        ).result_rows
        if current and f"TTL {ttl}" in str(current[0][0]):
            return
        self.writer.command(f"ALTER TABLE exchanges MODIFY TTL {ttl}")

    def _call_any(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """A call whose every failure means "try again later" (a lookup, not data)."""
        try:
            return fn(*args, **kwargs)
        except DatabaseError as exc:
            raise StoreUnavailable(str(exc)) from exc

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except OperationalError as exc:
            raise StoreUnavailable(str(exc)) from exc
        except DatabaseError as exc:
            if error_code(exc) in DATA_ERRORS:
                raise
            # Too many parts, memory limits, timeouts, a replica in read-only
            # mode...: the server's state, not the rows. Retried, never
            # blamed on the data.
            raise StoreUnavailable(str(exc)) from exc

    # -- reads -------------------------------------------------------------

    def query(self, sql: str, parameters: dict[str, Any], max_rows: int) -> QueryResult:
        """Run one analyst's SELECT on Tollgate's tables, within limits ClickHouse enforces.

        The statement is vetted first from ClickHouse's own parse of it
        (:mod:`services.metering.sqlguard`); a refusal or a ClickHouse error
        comes back as the result's ``error``. Its rows are read block by block
        and no further than ``max_rows`` + 1: ClickHouse's own row limit does
        not hold for every shape of statement (a UNION of an EXCEPT), and a
        result held whole would be held in this process.
        """
        reader = self._reader
        if reader is None:
            raise RuntimeError("store is not open")
        settings: dict[str, Any] = {}
        if self.query_dsn is None:
            # The analyst user's profile holds its own limits (readonly = 1
            # refuses any setting sent with a query); elsewhere the service sets them.
            settings = {
                "max_result_rows": max_rows + 1,
                "result_overflow_mode": "break",
                "max_execution_time": self.query_timeout_s,
                "max_memory_usage": self.query_max_memory_bytes,
            }
            if not self.embedded:
                settings["readonly"] = 2

        def explain(statement: str, values: dict[str, Any]) -> str:
            raw = reader.raw_query(statement, parameters=values, settings=settings)
            return raw.decode(errors="replace")

        rows: list[list[Any]] = []
        try:
            vet(sql, parameters, self.database, explain)
            with reader.query_row_block_stream(
                sql, parameters=parameters, settings=settings
            ) as stream:
                columns = list(stream.source.column_names)
                types = [t.name for t in stream.source.column_types]
                for block in stream:
                    rows.extend([_json_value(v) for v in row] for row in block)
                    if len(rows) > max_rows:
                        break  # the stream's end stops the query
        except RefusedQuery as exc:
            return QueryResult(error=str(exc))
        except (DatabaseError, OperationalError) as exc:
            return QueryResult(error=_clickhouse_message(exc))
        return QueryResult(
            columns=columns, types=types, rows=rows[:max_rows], truncated=len(rows) > max_rows
        )


def _clickhouse_message(exc: Exception) -> str:
    """ClickHouse's own message, without the client's wrapping or a stack trace."""
    text = str(exc).split("Stack trace")[0].strip()
    code = error_code(exc)
    message = text.rsplit("DB::Exception: ", 1)[-1].split(" (version ")[0].strip()
    return (f"ClickHouse error {code}: {message}" if code is not None else message)[:2000]
