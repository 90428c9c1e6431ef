"""Usage queries for operators and analysts, answered by the metering service.

The CLI (``tollgate usage report``, ``tollgate sql``) and other services ask
the metering service over NATS request/reply; it runs the statement on a
ClickHouse connection that ClickHouse holds read-only.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, date, datetime
from typing import Any, Literal

import orjson
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from tollgate.wire import codec
from tollgate.wire.contracts import QueryRequest, QueryResult
from tollgate.wire.subjects import Subjects

ReportBy = Literal["model", "key", "day"]
OutputFormat = Literal["table", "csv", "json"]


class MeteringUnavailable(Exception):
    """No metering service answered."""


async def run_query(
    nc: NATS,
    subjects: Subjects,
    sql: str,
    parameters: dict[str, Any] | None = None,
    max_rows: int = 10_000,
    timeout: float = 60.0,
) -> QueryResult:
    request = QueryRequest(sql=sql, parameters=parameters or {}, max_rows=max_rows)
    reply = await ask_metering(nc, subjects.metering_query, codec.encode(request), timeout)
    return codec.decode(QueryResult, reply)


async def ask_metering(nc: NATS, subject: str, body: bytes, timeout: float) -> bytes:
    """The metering service's reply on one of its request subjects, or MeteringUnavailable."""
    try:
        reply = await nc.request(subject, body, timeout=timeout)
    except NoRespondersError:
        raise MeteringUnavailable("no metering service is running") from None
    except (TimeoutError, NatsTimeoutError):
        raise MeteringUnavailable(f"the metering service did not answer in {timeout:g} s") from None
    return bytes(reply.data)


_GROUPS: dict[str, tuple[str, str]] = {
    "model": ("c.model", "model"),
    "key": ("c.key_id", "key_id"),
    "day": ("toDate(c.hour)", "day"),
}


def report_sql(by: ReportBy) -> str:
    """One tenant's usage and cost over [from, to), grouped by model, key or day.

    Reads the hourly rollup through the ``usage_cost`` view, so prices apply
    per hour; ``unpriced_requests`` counts usage no price covers (its
    currency is empty). A group priced in two currencies has one line each.
    """
    expr, name = _GROUPS[by]
    # Columns are qualified (c.) so that the output aliases never shadow them.
    return (
        f"SELECT {expr} AS {name},"
        " sum(c.requests) AS requests,"
        " sum(c.prompt_tokens) AS prompt_tokens,"
        " sum(c.completion_tokens) AS completion_tokens,"
        " sum(c.prompt_tokens + c.completion_tokens) AS total_tokens,"
        " sum(c.cost) AS cost,"
        " c.currency AS currency,"
        " sumIf(c.requests, NOT c.priced) AS unpriced_requests"
        " FROM usage_cost AS c"
        " WHERE c.tenant = {tenant:String}"
        " AND c.hour >= {start:DateTime('UTC')} AND c.hour < {end:DateTime('UTC')}"
        f" GROUP BY {name}, currency ORDER BY {name}, currency"
    )


def report_parameters(tenant: str, start: date, end: date) -> dict[str, Any]:
    def midnight(day: date) -> str:
        return datetime.combine(day, datetime.min.time(), UTC).strftime("%Y-%m-%d %H:%M:%S")

    return {"tenant": tenant, "start": midnight(start), "end": midnight(end)}


def render(result: QueryResult, fmt: OutputFormat) -> str:
    """A result as an aligned table, CSV (with header) or JSON objects."""
    if fmt == "json":
        objects = [dict(zip(result.columns, row, strict=True)) for row in result.rows]
        return orjson.dumps(objects, option=orjson.OPT_INDENT_2).decode()
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(result.columns)
        writer.writerows(["" if v is None else v for v in row] for row in result.rows)
        return out.getvalue().rstrip("\n")
    cells = [result.columns, *[[_cell(v) for v in row] for row in result.rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(result.columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(line.rstrip() for line in lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, list | dict):
        return orjson.dumps(value).decode()
    return str(value)
