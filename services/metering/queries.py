"""Read-only queries over NATS (``tg.metering.query``), for the CLI, the scaler and replay;
monthly invoices (``tg.metering.invoice``), for the admin API.

Only the metering service opens ClickHouse (chDB allows one process per data
directory), so everything else that needs usage data asks here. The query
runs on a connection that ClickHouse itself holds read-only.

It stays a plain nats.py subscription (queue group ``metering``): as a
FastStream subscriber it answered measurably slower (``bench/control_plane.py``,
docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import ValidationError

from services.metering.metrics import MeteringMetrics
from services.metering.store import UsageStore
from tollgate.invoices import INVOICE_MAX_ROWS, InvoiceError, Period, check
from tollgate.wire import codec
from tollgate.wire.contracts import InvoiceAnswer, InvoiceRequest, QueryRequest, QueryResult
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.metering.queries")


class QueryResponder:
    def __init__(
        self,
        nc: NATS,
        store: UsageStore,
        subjects: Subjects,
        max_rows: int,
        metrics: MeteringMetrics,
    ) -> None:
        self.nc = nc
        self.store = store
        self.subjects = subjects
        self.max_rows = max_rows
        self.metrics = metrics
        # Queries run one at a time beside the writer: an analyst's scan must
        # not take every core from ingestion.
        self._one_at_a_time = asyncio.Semaphore(1)

    async def start(self) -> None:
        await self.nc.subscribe(self.subjects.metering_query, queue="metering", cb=self._on_query)
        await self.nc.subscribe(
            self.subjects.metering_invoice, queue="metering", cb=self._on_invoice
        )

    async def _on_invoice(self, msg: Msg) -> None:
        try:
            request: InvoiceRequest | None = codec.decode(InvoiceRequest, msg.data)
        except (ValidationError, ValueError):
            request = None
        body = await self.invoice(request)
        if msg.reply:
            await msg.respond(body)

    async def invoice(self, request: InvoiceRequest | None) -> bytes:
        """The encoded :class:`InvoiceAnswer` (``None``: the request was not valid)."""
        if request is None:
            answer = InvoiceAnswer(error="Not a valid tg.invoice_request.v1 message.")
            return codec.encode(answer)

        async def query(sql: str, parameters: dict[str, Any]) -> QueryResult:
            async with self._one_at_a_time:
                return await asyncio.to_thread(self.store.query, sql, parameters, INVOICE_MAX_ROWS)

        try:
            report = await check(query, request.tenant, Period.parse(request.month))
        except (InvoiceError, ValueError) as exc:
            log.error("invoice failed", extra={"tenant": request.tenant, "error": str(exc)})
            return codec.encode(InvoiceAnswer(error="The invoice could not be computed."))
        invoice = report.invoice.to_json()
        invoice["check"] = {"ok": report.ok, "differences": report.differences}
        body = codec.encode(InvoiceAnswer(invoice=invoice))
        if len(body) > self.nc.max_payload:
            error = f"The invoice is larger than {self.nc.max_payload} bytes."
            body = codec.encode(InvoiceAnswer(error=error))
        return body

    async def _on_query(self, msg: Msg) -> None:
        try:
            request: QueryRequest | None = codec.decode(QueryRequest, msg.data)
        except (ValidationError, ValueError):
            request = None
        body = await self.answer(request)
        if msg.reply:
            await msg.respond(body)

    async def answer(self, request: QueryRequest | None) -> bytes:
        """The encoded :class:`QueryResult` (``None``: the request was not valid)."""
        if request is None:
            result = QueryResult(error="The query request is not a valid tg.query.v1 message.")
        else:
            async with self._one_at_a_time:
                try:
                    result = await asyncio.to_thread(
                        self.store.query,
                        request.sql,
                        request.parameters,
                        min(request.max_rows, self.max_rows),
                    )
                except Exception:
                    log.exception("query failed")
                    result = QueryResult(error="The metering service could not run the query.")
        body = codec.encode(result)
        if len(body) > self.nc.max_payload:
            result = QueryResult(
                error=f"The result is larger than {self.nc.max_payload} bytes; "
                "select fewer rows or columns."
            )
            body = codec.encode(result)
        self.metrics.queries.labels("error" if result.error else "ok").inc()
        return body
