"""The calls a killed router left open are billed once by its next run.

The outbox (SQLite) and :class:`LostCalls` run for real here; the orphans
bucket and the usage stream are stood in for by dictionaries.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from nats.js.errors import KeyNotFoundError

from services.router.limits import Change, Limiter
from services.router.settlement import Settler
from services.router.usage import LostCalls, Outbox
from tollgate.wire import codec
from tollgate.wire.contracts import (
    ChunkKind,
    Outcome,
    ResponseChunk,
    Usage,
    UsageEvent,
)
from tollgate.wire.subjects import Subjects


class Orphans:
    """The orphans bucket: request id -> END chunk."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    async def get(self, key: str) -> Any:
        if key not in self.values:
            raise KeyNotFoundError
        return SimpleNamespace(value=self.values[key])


class Publisher:
    """The usage publisher's journal half: events go to the outbox, as emit does."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.events: list[UsageEvent] = []
        self.budget: dict[str, bool] = {}  # request id -> sent for the budget ledger too
        self.changed = asyncio.Event()

    def emit(
        self, event: UsageEvent, budget: bool = False, settlement: Sequence[Change] = ()
    ) -> None:
        subject = Subjects().usage("acme", budget)
        self.outbox.add(event.request_id, subject, codec.encode(event), settlement=settlement)
        self.events.append(event)
        self.budget[event.request_id] = budget
        self.changed.set()

    def settled(self, request_id: str) -> None:
        self.outbox.remove((), [request_id])

    async def until(self, count: int) -> None:
        async with asyncio.timeout(10):
            while len(self.events) < count:
                self.changed.clear()
                await self.changed.wait()


class Counters:
    """A counter bucket that records each write: (counter, amount, write id)."""

    def __init__(self) -> None:
        self.writes: list[tuple[str, int, str | None]] = []

    async def add(
        self,
        key: str,
        amount: int,
        limit: int | None = None,
        floor: int | None = None,
        write_id: str | None = None,
    ) -> tuple[bool, int]:
        self.writes.append((key, amount, write_id))
        return True, 0


def open_call(outbox: Outbox, request_id: str, deadline: float, reserved: int | None) -> None:
    """What the router journals when it queues a call (UsagePublisher.opened)."""
    reservation = None
    if reserved is not None:
        reservation = {"tokens": reserved, "tpm_key": "tpm.k1.1", "budget_key": "k1.total"}
    outbox.open(
        request_id,
        {
            "tenant": "acme",
            "key_id": "k1",
            "model": "m/a",
            "streamed": True,
            "enqueued_at": time.time() - 5,
            "deadline": deadline,
            "reservation": reservation,
        },
    )


async def test_each_open_call_is_billed_once_from_its_report_or_at_zero(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    now = time.time()
    open_call(outbox, "reported", now + 60, reserved=500)
    open_call(outbox, "never-ran", now - 60, reserved=None)  # deadline long past
    open_call(outbox, "still-running", now + 60, reserved=200)
    open_call(outbox, "finished", now + 60, reserved=None)
    outbox.add("finished", "tg.usage.acme", b"{}")  # its event was written before the kill

    orphans = Orphans()
    report = ResponseChunk(
        request_id="reported",
        seq=9,
        kind=ChunkKind.END,
        usage=Usage(prompt_tokens=31, completion_tokens=25),
        outcome=Outcome.COMPLETED,
        finish_reason="length",
        worker_id="w-1",
    )
    orphans.values["reported"] = codec.encode(report)
    rates, budgets = Counters(), Counters()
    publisher = Publisher(outbox)
    settler = Settler(Limiter(rates, budgets), publisher)  # type: ignore[arg-type]
    records = outbox.opened()
    assert sorted(r for r, _ in records) == ["never-ran", "reported", "still-running"]

    async def bucket() -> Orphans:
        return orphans

    lost = LostCalls(publisher, records, bucket, settler, every_s=0.05)  # type: ignore[arg-type]
    lost.start()
    await publisher.until(2)
    await asyncio.sleep(0.2)  # another round: nothing more may be billed
    await lost.stop()

    by_id = {e.request_id: e for e in publisher.events}
    assert sorted(by_id) == ["never-ran", "reported"]
    reported, never = by_id["reported"], by_id["never-ran"]
    assert (reported.prompt_tokens, reported.completion_tokens) == (31, 25)
    assert (reported.outcome, reported.finish_reason, reported.worker_id) == (
        Outcome.ROUTER_LOST,
        "length",
        "w-1",
    )
    assert (never.prompt_tokens, never.completion_tokens, never.outcome) == (
        0,
        0,
        Outcome.ROUTER_LOST,
    )
    assert reported.tenant == "acme" and reported.key_id == "k1" and reported.streamed
    # the key held a budget when the call was accepted: the budget ledger counts it too
    assert publisher.budget == {"reported": True, "never-ran": False}
    # the reservation of the reported call (500 tokens) is replaced by its real count (56),
    # by writes the next run would make again without counting them twice
    assert rates.writes == [("tpm.k1.1", 56 - 500, "reported.tpm.k1.1")]
    assert budgets.writes == [("k1.total", 56 - 500, "reported.k1.total")]
    assert outbox.settlements() == []  # made: nothing left for the next run
    # billed calls are closed; the one still running stays open for the next round or run
    assert [r for r, _ in outbox.opened()] == ["still-running"]

    # the worker reports it later: billed then, and only then
    orphans.values["still-running"] = codec.encode(
        report.model_copy(update={"request_id": "still-running"})
    )
    again = LostCalls(publisher, outbox.opened(), bucket, settler, every_s=0.05)  # type: ignore[arg-type]
    again.start()
    await publisher.until(3)
    await again.stop()
    assert [e.request_id for e in publisher.events].count("still-running") == 1
    assert outbox.opened() == [] and len(outbox) == 4


def test_an_event_replaces_its_open_record_in_one_transaction(tmp_path: Path) -> None:
    outbox = Outbox(tmp_path / "outbox.db")
    open_call(outbox, "r1", time.time() + 60, reserved=None)
    assert outbox.open_count() == 1 and len(outbox) == 0
    outbox.add("r1", "tg.usage.acme", b"{}")
    assert outbox.open_count() == 0 and len(outbox) == 1
    reopened = Outbox(tmp_path / "outbox.db")  # the next run of the router
    assert reopened.opened() == [] and [r for r, _, _ in reopened.pending()] == ["r1"]
