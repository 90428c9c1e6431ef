"""One usage event per accepted request, kept until JetStream has it.

Each event is first written to a local durable outbox (an SQLite journal
under ``var/``), then published to the usage stream with ``Nats-Msg-Id`` =
request id, and removed from the outbox once the stream acknowledged it:
removals wait to ride in the next event's transaction (or, when no event
comes, a batch a moment later), so a call costs the outbox two commits, not
three (a call that held a budget, a third: its settlement's removal,
:mod:`services.router.settlement`). An event acknowledged but not yet
removed when the router dies is published again by its next run: the
stream drops the copy within its duplicate window (10 minutes), and
metering drops copies by request id at any time.
Events that could not be published (NATS down) are retried in order, and a
router that restarts replays what its outbox still holds: a NATS outage
delays usage events, it never drops them. A duplicate publish is dropped by
the stream's dedupe window.

A router killed mid-call (SIGKILL, OOM, a lost host) never wrote those calls'
events, so the outbox also keeps an *open* record of each call from the
moment it is queued until its event replaces it, in one transaction. The
router's next run on the same outbox finds the records its previous run left
open (:class:`LostCalls`): it bills each from the worker's final report, which
the worker kept in the orphans bucket when no router acknowledged it, or with
zero tokens once the call's deadline has passed without one; and it gives back
what the call held of the key's limits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from services.router.limits import Change, Reservation, journaled
from tollgate.wire import codec
from tollgate.wire.contracts import (
    ChunkKind,
    InferenceRequest,
    Outcome,
    ResponseChunk,
    Usage,
    UsageEvent,
)
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

if TYPE_CHECKING:
    from services.router.settlement import Settler

log = logging.getLogger("tollgate.router.usage")

# Acknowledged events are removed from the outbox with the next event's
# write, or at the latest this long after, or at once when this many wait.
REMOVE_AFTER_S = 0.25
REMOVE_BATCH = 256


class Outbox:
    """The SQLite journal: request id -> (subject, encoded event)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        # seq keeps the events in the order they were written: a new row's rowid
        # is above every row's in the table (AUTOINCREMENT would also keep ids of
        # removed rows from coming back, at a write per event). open_calls is
        # one B-tree keyed by request id (WITHOUT ROWID), not a table and its
        # index. An outbox written with the earlier schema (AUTOINCREMENT, and
        # open_calls with a rowid) keeps its tables, which answer the same.
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS events ("
            " seq INTEGER PRIMARY KEY,"
            " request_id TEXT UNIQUE NOT NULL, subject TEXT NOT NULL, data BLOB NOT NULL)"
        )
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS open_calls"
            " (request_id TEXT PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID"
        )
        # a call's counter writes that replace its reservation by its count,
        # from its event's transaction until every one of them is made
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS settlements"
            " (request_id TEXT PRIMARY KEY, data BLOB NOT NULL) WITHOUT ROWID"
        )

    def open(self, request_id: str, record: dict[str, Any]) -> None:
        """A call was queued: what its event will need, should this process die first."""
        self.db.execute(
            "INSERT OR REPLACE INTO open_calls (request_id, data) VALUES (?, ?)",
            (request_id, orjson.dumps(record)),
        )

    def opened(self) -> list[tuple[str, dict[str, Any]]]:
        """The open records (at start: the calls an earlier run never finished)."""
        rows = self.db.execute(
            "SELECT request_id, data FROM open_calls"
            " WHERE request_id NOT IN (SELECT request_id FROM events)"
        )
        return [(rid, orjson.loads(data)) for rid, data in rows.fetchall()]

    def add(
        self,
        request_id: str,
        subject: str,
        data: bytes,
        published: Sequence[str] = (),
        settlement: Sequence[Change] = (),
        settled: Sequence[str] = (),
    ) -> None:
        """Journal the call's event; it replaces the call's open record (one transaction).

        ``settlement``: the counter writes that settle the call's reservation,
        kept until :meth:`remove` is told they are made. ``published``: events
        the stream has acknowledged; ``settled``: calls whose settlement is
        made; both removed in the same transaction.
        """
        with self._transaction():
            self.db.execute(
                "INSERT OR IGNORE INTO events (request_id, subject, data) VALUES (?, ?, ?)",
                (request_id, subject, data),
            )
            self.db.execute("DELETE FROM open_calls WHERE request_id = ?", (request_id,))
            if settlement:
                self.db.execute(
                    "INSERT OR IGNORE INTO settlements (request_id, data) VALUES (?, ?)",
                    (request_id, orjson.dumps([list(change) for change in settlement])),
                )
            self._remove(published, settled)

    def remove(self, request_ids: Sequence[str], settled: Sequence[str] = ()) -> None:
        """Remove published events and made settlements (one transaction)."""
        if not request_ids and not settled:
            return
        with self._transaction():
            self._remove(request_ids, settled)

    def settlements(self) -> list[tuple[str, list[Change]]]:
        """The settlements not yet made (at start: those an earlier run left)."""
        rows = self.db.execute("SELECT request_id, data FROM settlements")
        return [
            (
                rid,
                [
                    Change(str(store), str(counter), int(amount))
                    for store, counter, amount in orjson.loads(data)
                ],
            )
            for rid, data in rows.fetchall()
        ]

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """One SQLite transaction: committed when the block ends, rolled back if it raises."""
        self.db.execute("BEGIN")
        try:
            yield
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    def _remove(self, request_ids: Sequence[str], settled: Sequence[str] = ()) -> None:
        if request_ids:
            self.db.executemany(
                "DELETE FROM events WHERE request_id = ?", [(rid,) for rid in request_ids]
            )
        if settled:
            self.db.executemany(
                "DELETE FROM settlements WHERE request_id = ?", [(rid,) for rid in settled]
            )

    def pending(self, limit: int = 1000) -> list[tuple[str, str, bytes]]:
        rows = self.db.execute(
            "SELECT request_id, subject, data FROM events ORDER BY seq LIMIT ?", (limit,)
        )
        return list(rows.fetchall())

    def __len__(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

    def open_count(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM open_calls").fetchone()[0])

    def close(self) -> None:
        self.db.close()


class UsagePublisher:
    def __init__(
        self, js: JetStreamContext, subjects: Subjects, outbox: Outbox, retry_every_s: float = 1.0
    ) -> None:
        self.js = js
        self.subjects = subjects
        self.outbox = outbox
        self.retry_every_s = retry_every_s
        self._pending: set[asyncio.Task[bool]] = set()
        self._replayer: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        # acknowledged events and made settlements still in the outbox, removed
        # with the next event or by the timer (see the module's docs)
        self._published: list[str] = []
        self._settled: list[str] = []
        self._removal: asyncio.TimerHandle | None = None

    async def start(self) -> None:
        topology = Topology(self.subjects)
        with contextlib.suppress(Exception):  # NATS may be down: the replayer retries
            await topology.ensure_stream(self.js, topology.usage, Role.ROUTER)
        self._replayer = asyncio.create_task(self._replay_loop())

    def opened(
        self, request: InferenceRequest, streamed: bool, reservation: dict[str, Any] | None
    ) -> None:
        """The call is queued: keep what its event needs until the event is written."""
        self.outbox.open(
            request.request_id,
            {
                "tenant": request.tenant or "anonymous",
                "key_id": request.key_id,
                "model": request.billed_model,
                "endpoint": request.endpoint.value,
                "streamed": streamed,
                "enqueued_at": request.enqueued_at,
                "deadline": request.deadline,
                "reservation": reservation,
            },
        )

    def emit(
        self, event: UsageEvent, budget: bool = False, settlement: Sequence[Change] = ()
    ) -> None:
        """Journal the event, then publish it in the background.

        ``budget``: the key held a token budget when the call was accepted, so
        the budget ledger counts the event too. ``settlement``: the counter
        writes that settle the call's reservation (:meth:`Limiter.plan
        <services.router.limits.Limiter.plan>`), journaled with the event
        until :meth:`settled` says they are made.
        """
        subject = self.subjects.usage(event.tenant, budget)
        data = codec.encode(event)
        published, self._published = self._published, []
        settled, self._settled = self._settled, []
        try:
            self.outbox.add(event.request_id, subject, data, published, settlement, settled)
        except BaseException:
            self._published[:0] = published  # still to remove
            self._settled[:0] = settled
            raise
        if (published or settled) and self._removal is not None:
            if not self._published and not self._settled:
                self._removal.cancel()  # nothing left for it to remove
                self._removal = None
        task = asyncio.create_task(self._publish(event.request_id, subject, data))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _publish(self, request_id: str, subject: str, data: bytes) -> bool:
        try:
            await self.js.publish(subject, data, headers={"Nats-Msg-Id": request_id}, timeout=5)
        except Exception as exc:
            log.warning(
                "usage event kept in the outbox: %s: %s",
                type(exc).__name__,
                exc,
                extra={"request_id": request_id},
            )
            self._wake.set()
            return False
        self._published.append(request_id)
        self._remove_soon()
        return True

    def settled(self, request_id: str) -> None:
        """The call's settlement is made: its journal entry goes at once.

        At once, not with the next removal: the next run makes again what
        the journal still holds, and that is idempotent only inside the
        counters' duplicate window (see :meth:`Limiter.apply
        <services.router.limits.Limiter.apply>`), so the window between the
        writes and their entry's removal is kept to one commit.
        """
        try:
            self.outbox.remove((), [request_id])
        except Exception as exc:  # made again by the next run
            self._settled.append(request_id)
            self._remove_soon()
            log.warning("a made settlement left in the outbox: %s: %s", type(exc).__name__, exc)

    def _remove_soon(self) -> None:
        if len(self._published) + len(self._settled) >= REMOVE_BATCH:
            self._remove_published()
        elif self._removal is None:
            self._removal = asyncio.get_running_loop().call_later(
                REMOVE_AFTER_S, self._remove_published
            )

    def _remove_published(self) -> None:
        """Remove the acknowledged events and made settlements no later event took out yet."""
        if self._removal is not None:
            self._removal.cancel()
            self._removal = None
        published, self._published = self._published, []
        settled, self._settled = self._settled, []
        try:
            self.outbox.remove(published, settled)
        except Exception as exc:  # kept: published again later, and the stream drops the copy
            log.warning("published events left in the outbox: %s: %s", type(exc).__name__, exc)

    async def _replay_loop(self) -> None:
        """Publish what the outbox holds (from a failure or an earlier run), in order."""
        while not self._stopping:
            rows = self.outbox.pending()
            published = set(self._published)
            for request_id, subject, data in rows:
                if request_id in published:
                    continue
                if self._stopping or not await self._publish(request_id, subject, data):
                    break
            self._wake.clear()
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can turn a
            # cancel that meets its own timeout into a TimeoutError, and this loop
            # would never stop
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.retry_every_s):
                    await self._wake.wait()

    async def flush(self, timeout: float = 10) -> None:
        """Publish what can be published now; the rest stays in the outbox."""
        if self._pending:
            await asyncio.wait(self._pending, timeout=timeout)
        # A flag as well as the cancel: nats.py can turn a cancel that lands in
        # a publish into its own TimeoutError, which _publish takes for a failed
        # publish, and the loop would go on.
        self._stopping = True
        if self._replayer is not None:
            self._replayer.cancel()
            await asyncio.gather(self._replayer, return_exceptions=True)
        published = set(self._published)
        for request_id, subject, data in self.outbox.pending():
            if request_id not in published and not await self._publish(request_id, subject, data):
                break
        self._remove_published()
        self.outbox.close()


class LostCalls:
    """Bills the calls an earlier run of this router accepted and never finished.

    Each open record left in the outbox at start is a call whose router was
    killed while the call ran or waited in the queue. A worker that finished
    it found no router to acknowledge its final report and kept the report in
    the orphans bucket: the call is billed from it (outcome ``router_lost``,
    the engine's own counts). A call whose deadline has passed (plus
    ``grace_s``) without such a report never reached a worker, or its worker
    died too: it is billed zero tokens. Either way its reservation is settled
    (:class:`~services.router.settlement.Settler`, journaled with the event).
    """

    def __init__(
        self,
        usage: UsagePublisher,
        records: list[tuple[str, dict[str, Any]]],
        orphans: Callable[[], Awaitable[Any]],
        settler: Settler | None = None,
        every_s: float = 2.0,
        grace_s: float = 30.0,
    ) -> None:
        self.usage = usage
        self.records = dict(records)
        self.orphans = orphans
        self.settler = settler
        self.every_s = every_s
        self.grace_s = grace_s
        self._task: asyncio.Task[None] | None = None
        if self.records:
            log.warning(
                "an earlier run of this router left %d call(s) unfinished; billing them",
                len(self.records),
            )

    def start(self) -> None:
        if self.records:
            self._task = asyncio.create_task(self._loop(), name="lost-calls")

    async def stop(self) -> None:
        """Stop looking; what is left stays open in the outbox for the next run."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _loop(self) -> None:
        while self.records:
            for request_id, record in list(self.records.items()):
                try:
                    await self._try(request_id, record)
                except Exception as exc:  # NATS down: the next round tries again
                    log.warning("billing a lost call: %s: %s", type(exc).__name__, exc)
                    break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every_s):
                    await asyncio.Event().wait()

    async def _try(self, request_id: str, record: dict[str, Any]) -> None:
        kv = await self.orphans()
        try:
            entry = await kv.get(request_id)
        except KeyNotFoundError:
            entry = None
        end = None
        if entry is not None and entry.value:
            chunk = codec.decode(ResponseChunk, entry.value)
            if chunk.kind is ChunkKind.END and chunk.request_id == request_id:
                end = chunk
        if end is None and time.time() < float(record["deadline"]) + self.grace_s:
            return  # a worker may still be running it
        usage = end.usage if end is not None and end.usage is not None else Usage()
        held = Reservation.from_held(record.get("reservation") or {})
        settlement: list[Change] = []
        if self.settler is not None and record.get("reservation"):
            settlement = self.settler.plan(held, usage.total_tokens, usage.prompt_tokens)
        now = time.time()
        self.usage.emit(
            UsageEvent(
                request_id=request_id,
                time=now,
                tenant=record["tenant"],
                key_id=record.get("key_id"),
                model=record["model"],
                worker_id=end.worker_id if end is not None else None,
                prompt_tokens=usage.prompt_tokens,
                completion_tokens=usage.completion_tokens,
                outcome=Outcome.ROUTER_LOST,
                finish_reason=end.finish_reason if end is not None else None,
                streamed=bool(record["streamed"]),
                endpoint=str(record.get("endpoint") or ""),
                total_s=max(0.0, now - float(record["enqueued_at"])),
                http_status=502,  # the client's connection broke with its router
            ),
            budget=held.budget,
            settlement=journaled(settlement),
        )
        del self.records[request_id]
        if self.settler is not None:
            await self.settler.settle(request_id, settlement)
        log.info(
            "lost call billed",
            extra={
                "request_id": request_id,
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "final_report": end is not None,
            },
        )
