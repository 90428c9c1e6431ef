"""Captured exchanges, replay results, webhook calls and budgets: JetStream into ClickHouse.

Simpler than usage ingest, because nothing is billed from these rows: a
durable consumer per stream, batches of up to 500 messages, one insert per
batch through the usage writer's thread, acks after the insert. A message
that is not a valid event is terminated (never redelivered); an insert that
fails is retried by redelivery (nak with a delay). The tables are
ReplacingMergeTree on each message's id, and a batch sent again carries the same
deduplication token, so a redelivery does not double a row.

The consumers pull with :class:`~tollgate.wire.bus.BatchPull` on nats.py: a
FastStream batch subscriber stored about half as many captures per second
(``bench/control_plane.py``, docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.client import Client as NATS
from pydantic import BaseModel, ValidationError

from services.metering.store import UsageStore, error_code
from tollgate.wire.bus import BatchPull
from tollgate.wire.contracts import BudgetSet, CaptureEvent, ReplayResult, WebhookCall
from tollgate.wire.topology import ConsumerSpec, Topology

log = logging.getLogger("tollgate.metering.exchanges")

Write = Callable[..., Awaitable[Any]]


class StreamToTable:
    def __init__(
        self,
        nc: NATS,
        store: UsageStore,
        write: Write,
        *,
        consumer: ConsumerSpec,
        table: str,
        key: tuple[str, ...],
        contract: type[BaseModel],
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.store = store
        self.write = write
        self.consumer = consumer
        self.table = table
        self.key = key
        self.contract = contract
        self.stored = 0
        self.refused = 0
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def ensure_consumer(self) -> None:
        """The durable consumer; retried while JetStream is not ready."""
        delay = 0.2
        while True:
            try:
                await self.js.add_consumer(
                    self.consumer.stream, self.consumer.config(ack_wait=60, max_deliver=-1)
                )
                return
            except Exception as exc:
                log.warning(
                    "%s consumer not set up yet: %s: %s", self.table, type(exc).__name__, exc
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def run(self) -> None:
        await self.ensure_consumer()
        pull = await BatchPull(self.nc, self.consumer.stream, self.consumer.durable).start()
        try:
            while not self._stopping.is_set():
                msgs = await pull.fetch(500, timeout=1.0, window=0.5)
                if msgs:
                    await self.store_batch(msgs)
        finally:
            await pull.stop()

    async def store_batch(self, msgs: list[Any]) -> None:
        """One insert for the valid messages, then ack them (nak all if it failed)."""
        rows, kept = [], []
        for msg in msgs:
            try:
                event = self.contract.model_validate_json(msg.data)
            except ValidationError:
                self.refused += 1
                log.error("malformed %s message dropped", self.table)
                await msg.term()
                continue
            rows.append(event.model_dump(mode="json", exclude={"type"}))
            kept.append(msg)
        if not rows:
            return
        try:
            await self.write(self.store.insert_json, self.table, rows, self.key)
        except Exception as exc:
            log.warning("%s insert failed, retried: %s", self.table, _insert_error(exc))
            for msg in kept:
                await msg.nak(delay=5)
            return
        for msg in kept:
            await msg.ack()
        self.stored += len(rows)


# one row per version of a key's or tenant's budgets
BUDGET_KEY = ("scope", "tenant", "key_id", "revision")


def exchange_ingests(
    nc: NATS, store: UsageStore, write: Write, topology: Topology
) -> list[StreamToTable]:
    """The consumers of captures, replays, webhook calls and budgets (the caller runs them)."""
    tables: tuple[tuple[ConsumerSpec, str, tuple[str, ...], type[BaseModel]], ...] = (
        (topology.metering_capture, "exchanges", ("request_id",), CaptureEvent),
        (topology.metering_replay, "replays", ("replay_id", "request_id"), ReplayResult),
        (topology.metering_webhook_log, "webhook_calls", ("call_id",), WebhookCall),
        (topology.metering_budgets, "budgets", BUDGET_KEY, BudgetSet),
    )
    return [
        StreamToTable(nc, store, write, consumer=consumer, table=table, key=key, contract=contract)
        for consumer, table, key, contract in tables
    ]


def _insert_error(exc: Exception) -> str:
    """Why an insert failed, fit for the log.

    ClickHouse quotes the rows it could not take in its message, and these rows
    are captured request and response bodies: only its error code is logged then.
    """
    code = error_code(exc)
    if code is not None:
        return f"{type(exc).__name__}: ClickHouse error {code}"
    return f"{type(exc).__name__}: {str(exc)[:200]}"
