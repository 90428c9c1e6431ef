"""A tenant's monthly invoice, computed from the usage rows with exact decimals.

An invoice has one line per model, token kind (prompt, completion) and price
period: the quantity of tokens, the unit price per million tokens, and the
amount, ``quantity * unit price / 1,000,000`` in :class:`~decimal.Decimal`
(never a float), kept to the last digit. Totals are per currency; each total
is also given rounded to cents (half up), the figure to charge.

Prices come from the ``prices`` table as ``usage_cost`` applies them: each
hour of usage is priced by the model's latest price whose ``valid_from`` is at
or before the hour's start (and whose ``valid_to``, when set, is after it).
Usage no price covers is listed apart (``unpriced``), never billed at zero.
Usage is read summed per hour, or per day when every price starts and ends at
midnight (the catalog's do), so an invoice reads a few rows per model.

:func:`compute` reads the deduplicated raw rows (``usage_events FINAL``); the
same computation over the hourly rollup is :func:`compute` with
``source="rollup"``. :func:`check` runs both and compares them line by line,
compares each model's requests and tokens with the daily rollup's, and the
hourly rollup's priced total with the ``usage_cost`` view's: a damaged
rollup, a lost or doubled row shows as a difference.
"""

from __future__ import annotations

import csv
import io
import re
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from decimal import ROUND_HALF_UP, Context, Decimal, localcontext
from typing import Any, Literal

from nats.aio.client import Client as NATS

from tollgate.analytics import ask_metering
from tollgate.wire import codec
from tollgate.wire.contracts import InvoiceAnswer, InvoiceRequest, QueryResult
from tollgate.wire.subjects import Subjects

Query = Callable[[str, dict[str, Any]], Awaitable[QueryResult]]
Source = Literal["raw", "rollup"]

# Months ClickHouse's DateTime holds (1970 to 2105).
_MONTH = re.compile(r"(19[7-9][0-9]|20[0-9][0-9]|210[0-5])-(0[1-9]|1[0-2])")
# Most rows one of an invoice's queries may read (rows per model and hour or day).
INVOICE_MAX_ROWS = 200_000
MILLION = Decimal(1_000_000)
CENT = Decimal("0.01")
# Enough digits for any amount: quantities up to 2^64, prices with 6 decimals.
EXACT = Context(prec=60)

_USAGE_SQL: dict[Source, str] = {
    "raw": (
        "SELECT model, toUnixTimestamp({bucket}(time)) AS hour, count() AS requests,"
        " sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens"
        " FROM usage_events FINAL"
        " WHERE tenant = {tenant:String}"
        " AND time >= {start:DateTime('UTC')} AND time < {end:DateTime('UTC')}"
        " GROUP BY model, hour ORDER BY model, hour"
    ),
    "rollup": (
        "SELECT model, toUnixTimestamp({bucket}(hour)) AS hour, sum(requests) AS requests,"
        " sum(prompt_tokens) AS prompt_tokens, sum(completion_tokens) AS completion_tokens"
        " FROM usage_hourly"
        " WHERE tenant = {tenant:String}"
        " AND hour >= {start:DateTime('UTC')} AND hour < {end:DateTime('UTC')}"
        " GROUP BY model, hour ORDER BY model, hour"
    ),
}
_PRICES_SQL = (
    "SELECT model, toUnixTimestamp(valid_from) AS valid_from,"
    " toUnixTimestamp(valid_to) AS valid_to,"
    " toString(prompt_per_million) AS prompt, toString(completion_per_million) AS completion,"
    " currency FROM prices FINAL ORDER BY model, valid_from"
)
# Per-model totals, from the raw rows and from the daily rollup, for the check.
_TOTALS_SQL = {
    "raw": (
        "SELECT model, count() AS requests, sum(prompt_tokens) AS prompt_tokens,"
        " sum(completion_tokens) AS completion_tokens FROM usage_events FINAL"
        " WHERE tenant = {tenant:String}"
        " AND time >= {start:DateTime('UTC')} AND time < {end:DateTime('UTC')}"
        " GROUP BY model ORDER BY model"
    ),
    "daily": (
        "SELECT model, sum(requests) AS requests, sum(prompt_tokens) AS prompt_tokens,"
        " sum(completion_tokens) AS completion_tokens FROM usage_daily"
        " WHERE tenant = {tenant:String}"
        " AND day >= toDate({start:DateTime('UTC')}) AND day < toDate({end:DateTime('UTC')})"
        " GROUP BY model ORDER BY model"
    ),
}
_COST_SQL = (
    "SELECT currency, toString(sum(cost)) AS cost FROM usage_cost"
    " WHERE tenant = {tenant:String} AND priced"
    " AND hour >= {start:DateTime('UTC')} AND hour < {end:DateTime('UTC')}"
    " GROUP BY currency ORDER BY currency"
)


class InvoiceError(Exception):
    """The usage data could not be read."""


@dataclass(frozen=True)
class Period:
    """A calendar month, UTC."""

    year: int
    month: int

    @classmethod
    def parse(cls, text: str) -> Period:
        found = _MONTH.fullmatch(text)
        if found is None:
            raise ValueError(f"{text[:20]!r} is not a month (YYYY-MM)")
        return cls(int(found[1]), int(found[2]))

    @property
    def start(self) -> datetime:
        return datetime(self.year, self.month, 1, tzinfo=UTC)

    @property
    def end(self) -> datetime:
        if self.month == 12:
            return datetime(self.year + 1, 1, 1, tzinfo=UTC)
        return datetime(self.year, self.month + 1, 1, tzinfo=UTC)

    def __str__(self) -> str:
        return f"{self.year:04d}-{self.month:02d}"


@dataclass(frozen=True)
class Price:
    valid_from: int  # unix seconds
    valid_to: int | None
    prompt: Decimal  # per million tokens
    completion: Decimal
    currency: str


@dataclass(frozen=True)
class Line:
    model: str
    kind: Literal["prompt", "completion"]
    price_from: str  # the price's start: an ISO date, or an instant when not at midnight
    quantity: int  # tokens
    unit_price: Decimal  # per million tokens
    currency: str
    amount: Decimal


@dataclass(frozen=True)
class Unpriced:
    model: str
    requests: int
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Invoice:
    tenant: str
    period: str
    source: Source
    requests: int = 0
    lines: list[Line] = field(default_factory=list)
    unpriced: list[Unpriced] = field(default_factory=list)

    @property
    def totals(self) -> dict[str, Decimal]:
        """The exact total per currency."""
        sums: dict[str, Decimal] = defaultdict(Decimal)
        with localcontext(EXACT):
            for line in self.lines:
                sums[line.currency] += line.amount
        return dict(sorted(sums.items()))

    @property
    def due(self) -> dict[str, Decimal]:
        """Each currency's total rounded to cents, half up: what is charged."""
        return {c: t.quantize(CENT, rounding=ROUND_HALF_UP) for c, t in self.totals.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "object": "invoice",
            "tenant": self.tenant,
            "period": self.period,
            "source": self.source,
            "requests": self.requests,
            "lines": [
                {**asdict(line), "unit_price": plain(line.unit_price), "amount": plain(line.amount)}
                for line in self.lines
            ],
            "totals": {c: plain(t) for c, t in self.totals.items()},
            "due": {c: str(t) for c, t in self.due.items()},
            "unpriced": [asdict(u) for u in self.unpriced],
        }

    def to_csv(self) -> str:
        """One row per line, then one total row per currency (model ``TOTAL``)."""
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(
            [
                *("tenant", "period", "model", "kind", "price_from", "quantity"),
                *("unit_price_per_million", "currency", "amount"),
            ]
        )
        for line in self.lines:
            writer.writerow(
                [
                    *(self.tenant, self.period, line.model, line.kind, line.price_from),
                    *(line.quantity, plain(line.unit_price), line.currency, plain(line.amount)),
                ]
            )
        for currency, total in self.totals.items():
            writer.writerow(
                [self.tenant, self.period, "TOTAL", "", "", "", "", currency, plain(total)]
            )
        return out.getvalue()


def plain(value: Decimal) -> str:
    """A decimal in positional notation without trailing zeros: ``0.0375``, ``12``."""
    return format(value.normalize(EXACT), "f")


def _parameters(tenant: str, period: Period) -> dict[str, Any]:
    fmt = "%Y-%m-%d %H:%M:%S"
    return {"tenant": tenant, "start": period.start.strftime(fmt), "end": period.end.strftime(fmt)}


async def _rows(query: Query, sql: str, parameters: dict[str, Any]) -> list[dict[str, Any]]:
    result = await query(sql, parameters)
    if result.error is not None:
        raise InvoiceError(result.error)
    if result.truncated:
        raise InvoiceError(
            "the usage query returned more rows than the metering service sends"
            " (TOLLGATE_METERING_QUERY_MAX_ROWS)"
        )
    return [dict(zip(result.columns, row, strict=True)) for row in result.rows]


async def _prices(query: Query) -> dict[str, list[Price]]:
    prices: dict[str, list[Price]] = defaultdict(list)
    for row in await _rows(query, _PRICES_SQL, {}):
        prices[row["model"]].append(
            Price(
                int(row["valid_from"]),
                None if row["valid_to"] is None else int(row["valid_to"]),
                Decimal(row["prompt"]),
                Decimal(row["completion"]),
                str(row["currency"]),
            )
        )
    return prices


def _instant(seconds: int) -> str:
    """A price's start: its date when it starts at midnight (as the catalog's do), else
    the instant, so two prices starting on one day are two lines."""
    start = datetime.fromtimestamp(seconds, UTC)
    if seconds % 86400 == 0:
        return start.date().isoformat()
    return start.strftime("%Y-%m-%dT%H:%M:%SZ")


def _price_at(prices: list[Price], hour: int) -> Price | None:
    """The latest price from at or before ``hour`` (as ``usage_cost``'s ASOF join), if valid."""
    index = bisect_right([p.valid_from for p in prices], hour)
    if index == 0:
        return None
    price = prices[index - 1]
    if price.valid_to is not None and hour >= price.valid_to:
        return None
    return price


async def compute(query: Query, tenant: str, period: Period, source: Source = "raw") -> Invoice:
    """``tenant``'s invoice for ``period`` from the raw rows or the hourly rollup."""
    parameters = _parameters(tenant, period)
    prices = await _prices(query)
    # Usage is summed per hour, the unit prices apply to; per day when every price
    # starts and ends at midnight (as the catalog's do), which prices the same.
    daily = all(
        p.valid_from % 86400 == 0 and (p.valid_to is None or p.valid_to % 86400 == 0)
        for model_prices in prices.values()
        for p in model_prices
    )
    bucket = "toStartOfDay" if daily else "toStartOfHour"
    usage = await _rows(query, _USAGE_SQL[source].replace("{bucket}", bucket), parameters)
    tokens: dict[tuple[str, str, int], int] = defaultdict(int)  # (model, kind, price) -> tokens
    period_of: dict[tuple[str, int], Price] = {}
    unpriced: dict[str, list[int]] = {}
    invoice = Invoice(tenant, str(period), source)
    for row in usage:
        model, hour = str(row["model"]), int(row["hour"])
        invoice.requests += int(row["requests"])
        price = _price_at(prices.get(model, []), hour)
        if price is None:
            counts = unpriced.setdefault(model, [0, 0, 0])
            counts[0] += int(row["requests"])
            counts[1] += int(row["prompt_tokens"])
            counts[2] += int(row["completion_tokens"])
            continue
        period_of[(model, price.valid_from)] = price
        tokens[(model, "prompt", price.valid_from)] += int(row["prompt_tokens"])
        tokens[(model, "completion", price.valid_from)] += int(row["completion_tokens"])
    with localcontext(EXACT):
        for (model, kind, valid_from), quantity in sorted(tokens.items()):
            if quantity == 0:
                continue
            price = period_of[(model, valid_from)]
            unit = price.prompt if kind == "prompt" else price.completion
            invoice.lines.append(
                Line(
                    model=model,
                    kind="prompt" if kind == "prompt" else "completion",
                    price_from=_instant(valid_from),
                    quantity=quantity,
                    unit_price=unit,
                    currency=price.currency,
                    amount=Decimal(quantity) * unit / MILLION,
                )
            )
    invoice.unpriced = [Unpriced(m, *counts) for m, counts in sorted(unpriced.items())]
    return invoice


@dataclass
class CheckReport:
    invoice: Invoice
    differences: list[str]

    @property
    def ok(self) -> bool:
        return not self.differences


async def check(query: Query, tenant: str, period: Period) -> CheckReport:
    """The invoice from the raw rows, compared with both rollups' and ``usage_cost``'s figures.

    The hourly rollup gives a whole second invoice, compared line by line; the
    daily rollup gives each model's requests and tokens.
    """
    raw = await compute(query, tenant, period, "raw")
    rollup = await compute(query, tenant, period, "rollup")
    differences: list[str] = []
    if raw.requests != rollup.requests:
        differences.append(f"requests: raw rows {raw.requests}, hourly rollup {rollup.requests}")

    def keyed(invoice: Invoice) -> dict[tuple[str, str, str], Line]:
        return {(line.model, line.kind, line.price_from): line for line in invoice.lines}

    raw_lines, rollup_lines = keyed(raw), keyed(rollup)
    for key in sorted(raw_lines.keys() | rollup_lines.keys()):
        a, b = raw_lines.get(key), rollup_lines.get(key)
        if a != b:
            what = " ".join(key)
            differences.append(
                f"{what}: raw rows {_describe(a)}, hourly rollup {_describe(b)}",
            )
    if raw.unpriced != rollup.unpriced:
        differences.append(
            f"unpriced usage: raw rows {raw.unpriced}, hourly rollup {rollup.unpriced}"
        )
    parameters = _parameters(tenant, period)
    totals: dict[str, dict[str, tuple[int, int, int]]] = {}
    for source, sql in _TOTALS_SQL.items():
        rows = await _rows(query, sql, parameters)
        totals[source] = {
            str(r["model"]): (
                int(r["requests"]),
                int(r["prompt_tokens"]),
                int(r["completion_tokens"]),
            )
            for r in rows
        }
    for model in sorted(totals["raw"].keys() | totals["daily"].keys()):
        in_raw, in_daily = totals["raw"].get(model), totals["daily"].get(model)
        if in_raw != in_daily:
            differences.append(
                f"{model} (requests, prompt tokens, completion tokens): raw rows {in_raw}, "
                f"daily rollup {in_daily}"
            )
    viewed = {
        str(row["currency"]): Decimal(row["cost"])
        for row in await _rows(query, _COST_SQL, parameters)
        if Decimal(row["cost"]) != 0  # usage of no tokens makes no invoice line
    }
    if viewed != rollup.totals:
        differences.append(
            "usage_cost: "
            + ", ".join(f"{c} {t}" for c, t in sorted(viewed.items()))
            + "; invoice from the hourly rollup: "
            + ", ".join(f"{c} {t}" for c, t in rollup.totals.items())
        )
    return CheckReport(raw, differences)


def _describe(line: Line | None) -> str:
    if line is None:
        return "no line"
    return (
        f"{line.quantity} tokens at {plain(line.unit_price)} = {plain(line.amount)} {line.currency}"
    )


async def request_invoice(
    nc: NATS, subjects: Subjects, tenant: str, period: Period, timeout: float = 60.0
) -> dict[str, Any]:
    """The metering service's invoice (with its check) for ``tenant`` and ``period``.

    Raises :class:`~tollgate.analytics.MeteringUnavailable` when no metering
    service answers, :class:`InvoiceError` when it could not compute one.
    """
    request = codec.encode(InvoiceRequest(tenant=tenant, month=str(period)))
    reply = await ask_metering(nc, subjects.metering_invoice, request, timeout)
    answer = codec.decode(InvoiceAnswer, reply)
    if answer.invoice is None:
        raise InvoiceError(answer.error or "no invoice")
    return answer.invoice
