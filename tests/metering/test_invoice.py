"""Monthly invoices from the usage rows, on a real ClickHouse engine (chDB).

One tenant's November: a model whose price changes on the 15th, a model with
one price, a model without a price, and rows just outside the month and of
another tenant. The invoice matches a total computed by hand to the last
decimal; ``check`` finds the raw rows, the rollup and ``usage_cost`` in
agreement, and names the line a damaged rollup changes.
"""

from __future__ import annotations

import csv
import io
from datetime import UTC, datetime
from decimal import Decimal
from typing import Any

import pytest

from services.metering.store import UsageStore
from tests.metering.test_store import event
from tollgate.invoices import Period, check, compute
from tollgate.wire.contracts import QueryResult

TENANT = "acme"
NOVEMBER = Period.parse("2026-11")


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


# (time, model, prompt tokens, completion tokens[, tenant])
USAGE: list[tuple[Any, ...]] = [
    ("2026-11-02 10:00:00", "m/a", 1000, 333),
    ("2026-11-14 23:59:59.999", "m/a", 12345, 6789),
    ("2026-11-15 00:00:00", "m/a", 7, 3),
    ("2026-11-30 23:59:59", "m/a", 100000, 25000),
    ("2026-11-20 05:30:00", "m/b", 999999, 1),
    ("2026-11-05 08:00:00", "m/free", 50, 50),
    # not this invoice's
    ("2026-10-31 23:59:59", "m/a", 5000, 5000),
    ("2026-12-01 00:00:00", "m/a", 5000, 5000),
    ("2026-11-10 12:00:00", "m/a", 5000, 5000, "globex"),
]

# model, valid_from, prompt and completion per million tokens
PRICES = [
    ("m/a", "2026-11-01 00:00:00", "0.15", "0.60"),
    ("m/a", "2026-11-15 00:00:00", "0.20", "0.80"),
    ("m/b", "2026-01-01 00:00:00", "1.10", "4.40"),
]

# By hand: tokens x price per million / 1,000,000.
EXPECTED_LINES = [
    ("m/a", "completion", "2026-11-01", 333 + 6789, "0.6", "0.0042732"),
    ("m/a", "completion", "2026-11-15", 3 + 25000, "0.8", "0.0200024"),
    ("m/a", "prompt", "2026-11-01", 1000 + 12345, "0.15", "0.00200175"),
    ("m/a", "prompt", "2026-11-15", 7 + 100000, "0.2", "0.0200014"),
    ("m/b", "completion", "2026-01-01", 1, "4.4", "0.0000044"),
    ("m/b", "prompt", "2026-01-01", 999999, "1.1", "1.0999989"),
]
EXPECTED_TOTAL = "1.14628205"


@pytest.fixture
def billed(store: UsageStore) -> UsageStore:
    rows = []
    for i, (when, model, prompt, completion, *tenant) in enumerate(USAGE):
        rows.append(
            event(
                i,
                time=at(when),
                tenant=tenant[0] if tenant else TENANT,
                model=model,
                prompt_tokens=prompt,
                completion_tokens=completion,
            )
        )
    store.insert(rows)
    insert_prices(
        store,
        [
            [model, datetime.fromisoformat(start).replace(tzinfo=UTC), None, p, c, "USD"]
            for model, start, p, c in PRICES
        ],
    )
    return store


def insert_prices(store: UsageStore, rows: list[list[Any]]) -> None:
    """Price rows: model, valid_from, valid_to, prompt and completion per million, currency."""
    store.writer.insert(
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


def querying(store: UsageStore) -> Any:
    async def query(sql: str, parameters: dict[str, Any]) -> QueryResult:
        return store.query(sql, parameters, 10_000)

    return query


async def test_the_invoice_matches_the_hand_computed_total(billed: UsageStore) -> None:
    invoice = await compute(querying(billed), TENANT, NOVEMBER)
    lines = [
        (line.model, line.kind, line.price_from, line.quantity, line.unit_price, line.amount)
        for line in invoice.lines
    ]
    assert lines == [(m, k, f, q, Decimal(u), Decimal(a)) for m, k, f, q, u, a in EXPECTED_LINES]
    assert invoice.totals == {"USD": Decimal(EXPECTED_TOTAL)}
    assert str(invoice.totals["USD"].normalize()) == EXPECTED_TOTAL  # to the last decimal
    assert invoice.due == {"USD": Decimal("1.15")}
    assert invoice.requests == 6  # the unpriced one included
    assert [(u.model, u.requests, u.prompt_tokens) for u in invoice.unpriced] == [("m/free", 1, 50)]

    body = invoice.to_json()
    assert body["totals"] == {"USD": EXPECTED_TOTAL} and body["due"] == {"USD": "1.15"}
    assert [line["amount"] for line in body["lines"]] == [a for *_, a in EXPECTED_LINES]
    table = list(csv.DictReader(io.StringIO(invoice.to_csv())))
    assert [r["amount"] for r in table] == [a for *_, a in EXPECTED_LINES] + [EXPECTED_TOTAL]
    assert table[-1]["model"] == "TOTAL"


async def test_check_agrees_then_names_the_line_a_damaged_rollup_changes(
    billed: UsageStore,
) -> None:
    report = await check(querying(billed), TENANT, NOVEMBER)
    assert report.ok, report.differences
    assert report.invoice.totals == {"USD": Decimal(EXPECTED_TOTAL)}

    # A rollup row no raw row backs (as a write outside the metering service would make).
    billed.writer.command(
        "INSERT INTO usage_hourly (hour, tenant, key_id, model, requests, failed,"
        " prompt_tokens, completion_tokens)"
        " VALUES ('2026-11-20 05:00:00', 'acme', 'key-x', 'm/b', 1, 0, 1000, 0)"
    )
    report = await check(querying(billed), TENANT, NOVEMBER)
    assert not report.ok
    joined = "\n".join(report.differences)
    assert "requests: raw rows 6, hourly rollup 7" in joined
    assert "m/b prompt 2026-01-01: raw rows 999999 tokens" in joined
    assert "hourly rollup 1000999 tokens" in joined
    assert "daily rollup" not in joined  # that one is whole
    # the invoice itself still comes from the raw rows
    assert report.invoice.totals == {"USD": Decimal(EXPECTED_TOTAL)}


async def test_check_names_the_model_a_damaged_daily_rollup_changes(
    billed: UsageStore,
) -> None:
    billed.writer.command(
        "INSERT INTO usage_daily (day, tenant, key_id, model, requests, failed,"
        " prompt_tokens, completion_tokens)"
        " VALUES ('2026-11-03', 'acme', 'key-x', 'm/a', 0, 0, 0, 17)"
    )
    report = await check(querying(billed), TENANT, NOVEMBER)
    assert report.differences == [
        "m/a (requests, prompt tokens, completion tokens): raw rows (4, 113352, 32125), "
        "daily rollup (4, 113352, 32142)"
    ]


async def test_a_month_without_usage_has_no_lines(billed: UsageStore) -> None:
    invoice = await compute(querying(billed), TENANT, Period.parse("2026-09"))
    assert invoice.lines == [] and invoice.totals == {} and invoice.requests == 0


def test_a_month_is_parsed_strictly() -> None:
    assert Period.parse("2026-12").end == datetime(2027, 1, 1, tzinfo=UTC)
    for bad in (
        "2026-13",
        "11-2026",
        "2026-11-01",
        "",
        "2026-1",
        "0999-01",
        "\uff12026-11",
        "1969-12",
        "2106-01",
    ):
        with pytest.raises(ValueError, match="YYYY-MM"):
            Period.parse(bad)


async def test_a_price_from_mid_day_prices_each_hour_from_its_start(billed: UsageStore) -> None:
    """Prices that start at midnight allow sums per day; one that starts at 05:00 does not."""
    insert_prices(
        billed,
        [["m/b", datetime(2026, 11, 20, 5, tzinfo=UTC), None, "2.2", "8.8", "USD"]],
    )
    report = await check(querying(billed), TENANT, NOVEMBER)
    assert report.ok, report.differences
    m_b = [line for line in report.invoice.lines if line.model == "m/b"]
    # the call at 05:30 falls in the hour from 05:00: the new price
    assert [(line.kind, line.price_from, line.amount) for line in m_b] == [
        ("completion", "2026-11-20T05:00:00Z", Decimal("0.0000088")),
        ("prompt", "2026-11-20T05:00:00Z", Decimal("2.1999978")),
    ]


async def test_two_prices_on_one_day_are_two_lines_the_check_tells_apart(
    billed: UsageStore,
) -> None:
    """A price from 05:00 and one from 06:00 on the same day: a damaged hour of either shows."""
    insert_prices(
        billed,
        [
            ["m/b", datetime(2026, 11, 20, 5, tzinfo=UTC), None, "2.2", "8.8", "USD"],
            ["m/b", datetime(2026, 11, 20, 6, tzinfo=UTC), None, "3.3", "9.9", "USD"],
        ],
    )
    billed.writer.command(
        "INSERT INTO usage_hourly (hour, tenant, key_id, model, requests, failed,"
        " prompt_tokens, completion_tokens)"
        " VALUES ('2026-11-20 07:00:00', 'acme', 'key-x', 'm/b', 0, 0, 1000000, 0)"
    )
    report = await check(querying(billed), TENANT, NOVEMBER)
    assert any(
        d.startswith("m/b prompt 2026-11-20T06:00:00Z: raw rows no line")
        for d in report.differences
    ), report.differences


async def test_usage_of_no_tokens_checks_out(store: UsageStore) -> None:
    store.insert(
        [
            event(
                1,
                time=at("2026-11-03 10:00:00"),
                tenant=TENANT,
                model="m/b",
                prompt_tokens=0,
                completion_tokens=0,
            )
        ]
    )
    insert_prices(
        store,
        [["m/b", datetime(2026, 1, 1, tzinfo=UTC), None, "1.1", "4.4", "EUR"]],
    )
    report = await check(querying(store), TENANT, NOVEMBER)
    assert report.ok, report.differences
    assert report.invoice.requests == 1 and report.invoice.lines == []
