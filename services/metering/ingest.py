"""Usage events from the JetStream stream into ClickHouse, exactly once.

A durable pull consumer collects a batch (up to ``batch_max_rows`` events, or
whatever arrived ``batch_max_wait_s`` after the batch's first event), inserts
it, and acks its messages only after ClickHouse has the rows. A crash between
insert and ack redelivers the batch; the writer then finds those request ids
already stored and skips them, so neither the raw table nor the rollups built
from each insert count an event twice. The consumer acks all: one ack, of a
batch's last event, acks every event before it (:class:`AckFloor` says when
that is safe).

A message that is not a valid usage event goes to the dead-letter stream with
the reason and is acked, so it never blocks the events behind it. A batch
that ClickHouse rejects is split in halves until the rows it refuses are
isolated and dead-lettered; an unreachable ClickHouse is retried with back-off
while the messages are kept from redelivery.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from clickhouse_connect.driver.exceptions import DatabaseError
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerInfo
from nats.js.errors import NoStreamResponseError, NotFoundError
from pydantic import ValidationError

from services.metering.metrics import MeteringMetrics
from services.metering.settings import MeteringSettings
from services.metering.store import DATA_ERRORS, StoreUnavailable, UsageStore, error_code
from tollgate.wire.bus import BatchPull
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.metering.ingest")

T = TypeVar("T")

_DEAD_LETTER_MAX_BYTES = 64 * 1024
# How soon a batch that failed is delivered again.
_REDELIVER_FAILED_S = 2.0


class PoisonEvent(ValueError):
    """A message that can never become a usage row."""


@dataclass
class Pending:
    """One message of the current batch and its row (None: dead-lettered)."""

    msg: Msg
    row: dict[str, Any] | None


class AckFloor:
    """Which stored usage event may be acked, when one ack acks every earlier one.

    The metering consumer acks all (``AckPolicy.ALL``): an ack of one message
    acks every message before it in the stream, so a batch costs one ack, not
    one per event. Such an ack may go out only when every earlier event is
    stored. One delivered to a writer that died, or lost in flight during a
    reconnect, is still pending on the server, and an ack past it would drop
    it unstored. So stored events are acked up to the first gap above the
    floor (the last sequence acked). The server fills a gap by delivering the
    missing event again after the ack wait; :meth:`server_says` passes a gap
    that is pending nowhere (an event the stream no longer holds).
    """

    def __init__(self, floor: int) -> None:
        self.floor = floor
        self._stored: dict[int, Msg] = {}  # stored, above the floor: seq -> message
        self.acks = 0  # acks handed out, so that a reading of the server can be dated

    @property
    def waiting(self) -> int:
        """Stored events not acked yet (each after a gap)."""
        return len(self._stored)

    def stored(self, msgs: Iterable[Msg]) -> Msg | None:
        """Note stored messages; return the one to ack now, if any."""
        again: Msg | None = None  # an event at or below the floor, delivered again
        for msg in msgs:
            seq = msg.metadata.sequence.stream
            if seq > self.floor:
                self._stored[seq] = msg
            elif again is None or seq > again.metadata.sequence.stream:
                again = msg
        # An event delivered again below the floor lost its ack on the way (a
        # reconnect): acking it once more stops its redeliveries.
        return self._advance() or again

    def server_says(
        self, ack_floor: int, delivered: int, pending: int, stored_then: int, acks_then: int
    ) -> Msg | None:
        """Apply a reading of the consumer; return the message to ack now, if any.

        ``ack_floor``, ``delivered`` (the last sequence delivered) and
        ``pending`` (events delivered and not acked) are the server's;
        ``stored_then`` and ``acks_then`` were :attr:`waiting` and :attr:`acks`
        just before the reading was asked for. Every stored event above the
        server's floor is pending there (once the server knows it delivered
        them all: a server restarted from older state may not), so when
        nothing was stored or acked since and the server's pending events are
        as many as the stored ones, they are the same events: nothing below
        the highest stored one waits to be stored, and the gaps before it
        hold nothing.
        """
        unchanged = acks_then == self.acks and stored_then == self.waiting
        if ack_floor > self.floor:
            self._drop_through(ack_floor)
        if (
            unchanged
            and self._stored
            and pending == self.waiting
            and delivered >= max(self._stored)
        ):
            self._drop_through(max(self._stored) - 1)
        return self._advance()

    def _drop_through(self, floor: int) -> None:
        self.floor = floor
        for seq in [s for s in self._stored if s <= floor]:
            del self._stored[seq]

    def _advance(self) -> Msg | None:
        last: Msg | None = None
        while self.floor + 1 in self._stored:
            self.floor += 1
            last = self._stored.pop(self.floor)
        if last is not None:
            self.acks += 1
        return last


def to_row(data: bytes, stream_seq: int, now: float) -> dict[str, Any]:
    """Validate a usage event and return its ``usage_events`` row.

    The checks are the contract's own (``UsageEvent``: token counts, time,
    status; timings read as 0 or unknown rather than refused), the same the
    budget ledger applies, with ``now`` as the reader's clock.
    """
    try:
        event = UsageEvent.model_validate(orjson.loads(data), context={"now": now})
    except orjson.JSONDecodeError as exc:
        raise PoisonEvent(f"not a tg.usage.v1 event: body: not JSON ({exc})") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise PoisonEvent(f"not a tg.usage.v1 event: {where}: {first['msg']}") from None
    row = event.model_dump(mode="json", exclude={"type"})
    row["stream_seq"] = stream_seq
    return row


class UsageIngest:
    def __init__(
        self,
        nc: NATS,
        store: UsageStore,
        subjects: Subjects,
        settings: MeteringSettings,
        metrics: MeteringMetrics,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.store = store
        self.subjects = subjects
        self.topology = Topology(subjects)
        self.settings = settings
        self.metrics = metrics
        self.running = False
        self._stopping = asyncio.Event()
        self._floor = AckFloor(0)  # read from the consumer once it is set up
        self._ack_all = True  # False for a consumer made to ack each event
        # One thread for every write: batches reach ClickHouse in order.
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="clickhouse-writer")

    def stop(self) -> None:
        """Finish the current batch (insert and ack), then leave :meth:`run`."""
        self._stopping.set()

    async def write(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a ClickHouse write in the writer thread (every write, in order)."""
        return await asyncio.get_running_loop().run_in_executor(self._writes, fn, *args)

    async def _setup(self) -> None:
        """Streams and the durable consumer; retried while JetStream is not ready."""
        delay = 0.2
        while True:
            try:
                # Every stream the metering service reads or writes.
                await self.topology.ensure(self.js, Role.METERING)
                info = await self._ensure_consumer()
                floor = info.ack_floor.stream_seq if info.ack_floor else 0
                self._floor = AckFloor(floor)
                self._ack_all = info.config.ack_policy == AckPolicy.ALL
                return
            except Exception as exc:
                log.warning("usage consumer not set up yet: %s: %s", type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.retry_max_s)

    async def _ensure_consumer(self) -> ConsumerInfo:
        """Create the usage consumer, or update its tuning; keep where it is. Its state."""
        spec = self.topology.metering_usage
        config = spec.config(
            ack_wait=self.settings.ack_wait_s,
            max_ack_pending=self.settings.batch_max_rows * 4,
            max_deliver=-1,
        )
        try:
            info = await self.js.consumer_info(spec.stream, spec.durable)
        except NotFoundError:
            return await self.js.add_consumer(spec.stream, config)
        # What an existing consumer was made with cannot change. One made by an
        # earlier version acks each event, and is kept so: making it again would
        # need a delete this service may not send, and would deliver again every
        # event above its ack floor.
        config.ack_policy = info.config.ack_policy
        config.deliver_policy = info.config.deliver_policy
        config.opt_start_seq = info.config.opt_start_seq
        updated = await self.js.add_consumer(spec.stream, config)
        if config.ack_policy != AckPolicy.ALL:
            log.info("the usage consumer acks each event (it was made so)")
        return updated

    async def _watch_pending(self, every_s: float = 5.0) -> None:
        """Keep the consumer-lag gauge current (events waiting in the stream).

        The same reading passes gaps before stored events that nothing fills
        (:meth:`AckFloor.server_says`).
        """
        while True:
            with contextlib.suppress(Exception):  # NATS away for a moment: next time
                consumer = self.topology.metering_usage
                stored, acks = self._floor.waiting, self._floor.acks
                info = await self.js.consumer_info(consumer.stream, consumer.durable)
                self.metrics.pending.set(info.num_pending)
                if self._ack_all:
                    ack = self._floor.server_says(
                        info.ack_floor.stream_seq if info.ack_floor else 0,
                        info.delivered.stream_seq if info.delivered else 0,
                        info.num_ack_pending or 0,
                        stored,
                        acks,
                    )
                    if ack is not None:
                        await self._ack(ack)
            await asyncio.sleep(every_s)

    async def run(self) -> None:
        await self._setup()
        consumer = self.topology.metering_usage
        puller = await BatchPull(self.nc, consumer.stream, consumer.durable).start()
        self.running = True
        watch = asyncio.create_task(self._watch_pending(), name="pending")
        # The next batch is collected while the previous one is written: the
        # insert runs in the writer thread, off the event loop.
        writing: asyncio.Task[None] | None = None
        try:
            while not self._stopping.is_set():
                msgs = await self._collect(puller)
                if writing is not None:
                    await writing
                    writing = None
                if msgs:
                    writing = asyncio.create_task(self._process_safely(msgs))
            if writing is not None:
                await writing
        finally:
            self.running = False
            watch.cancel()
            await puller.stop()
            # A ClickHouse call still running finishes in its thread; the
            # event loop does not wait for it.
            self._writes.shutdown(wait=False)

    async def _process_safely(self, msgs: list[Msg]) -> None:
        try:
            await self._process(msgs)
        except Exception:
            # Nothing of this batch was acked: the server delivers it again,
            # asked to within seconds rather than after the ack wait (no later
            # event is acked past it meanwhile), and the ids already stored
            # are skipped then.
            log.exception("usage batch failed; it will be delivered again")
            for msg in msgs:
                with contextlib.suppress(Exception):
                    await msg.nak(delay=_REDELIVER_FAILED_S)

    async def _collect(self, puller: BatchPull) -> list[Msg]:
        """A batch: up to batch_max_rows, or what arrived batch_max_wait_s after the first."""
        try:
            return await puller.fetch(
                self.settings.batch_max_rows, timeout=1.0, window=self.settings.batch_max_wait_s
            )
        except Exception as exc:  # NATS reconnecting: ask again shortly
            log.warning("usage fetch failed: %s: %s", type(exc).__name__, exc)
            await asyncio.sleep(0.5)
            return []

    async def _process(self, msgs: list[Msg]) -> None:
        now = time.time()
        batch: list[Pending] = []
        for msg in msgs:
            try:
                row = to_row(msg.data, msg.metadata.sequence.stream, now)
            except PoisonEvent as exc:
                await self._dead_letter(msg, str(exc))
                batch.append(Pending(msg, None))
                continue
            batch.append(Pending(msg, row))
        self.metrics.consumed.inc(len(msgs))
        rows = [p.row for p in batch if p.row is not None]
        if rows:
            keep = [p.msg for p in batch]
            fresh = await self._with_retry(lambda: self._fresh_rows(rows), keep)
            self.metrics.duplicates.inc(len(rows) - len(fresh))
            started = time.perf_counter()
            # A failed insert is retried with the very same blocks: one that
            # did reach ClickHouse (a timeout after the commit, or a rollup
            # write that failed after the raw one) is recognised by its
            # deduplication token, in the raw table and in every rollup.
            refused = await self._with_retry(lambda: self._insert_all(fresh), keep)
            self.metrics.insert_seconds.observe(time.perf_counter() - started)
            self.metrics.inserted.inc(len(fresh) - len(refused))
            by_id = {id(p.row): p for p in batch if p.row is not None}
            for row, reason in refused:
                pending = by_id.get(id(row))
                if pending is not None:
                    await self._dead_letter(pending.msg, reason)
        if self._ack_all:
            ack = self._floor.stored(p.msg for p in batch)
            if ack is not None:
                await self._ack(ack)
        else:
            for pending in batch:
                await self._ack(pending.msg)
        if rows:
            newest = max(r["time"] for r in rows)
            self.metrics.lag.observe(max(0.0, time.time() - newest))

    async def _fresh_rows(self, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The rows whose request ids are not stored yet (first of each id)."""
        unique: dict[str, dict[str, Any]] = {}
        for row in rows:
            unique.setdefault(row["request_id"], row)
        times = [r["time"] for r in unique.values()]
        stored = await self.write(self.store.existing_ids, list(unique), min(times), max(times))
        return [row for rid, row in unique.items() if rid not in stored]

    async def _insert_all(self, rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], str]]:
        refused = await self._insert_or_split(rows)
        if len(rows) > 1 and len(refused) == len(rows):
            # Every row refused, though each passed validation: the table
            # changed (schema drift), not the data. Retry; blame no row.
            raise StoreUnavailable(f"ClickHouse refused the whole batch: {refused[0][1]}")
        return refused

    async def _insert_or_split(
        self, rows: list[dict[str, Any]]
    ) -> list[tuple[dict[str, Any], str]]:
        """Insert; when ClickHouse rejects the data, bisect to find the rows it refuses."""
        if not rows:
            return []
        try:
            await self.write(self.store.insert, rows)
            return []
        except DatabaseError as exc:
            if error_code(exc) not in DATA_ERRORS:
                raise StoreUnavailable(str(exc)) from exc
            if len(rows) == 1:
                return [(rows[0], f"ClickHouse refused the row: {str(exc)[:500]}")]
        half = len(rows) // 2
        return [
            *await self._insert_or_split(rows[:half]),
            *await self._insert_or_split(rows[half:]),
        ]

    async def _with_retry(self, attempt: Callable[[], Awaitable[T]], keep: list[Msg]) -> T:
        """Retry while ClickHouse is unreachable; the messages stay in progress meanwhile."""
        delay = 0.2
        touched = time.monotonic()
        while True:
            if time.monotonic() - touched > self.settings.ack_wait_s / 3:
                touched = time.monotonic()
                for msg in keep:
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            try:
                return await attempt()
            except StoreUnavailable as exc:
                self.metrics.insert_failures.inc()
                log.warning("ClickHouse unavailable, retrying: %s", str(exc)[:200])
            if self._stopping.is_set():
                # Leave unacked: delivered again when the service is back.
                raise StoreUnavailable("stopping with the batch not stored")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.retry_max_s)

    async def _dead_letter(self, msg: Msg, reason: str) -> None:
        """Keep the message on the dead-letter stream, with why; retried until stored."""
        seq = msg.metadata.sequence.stream
        data = msg.data
        headers = {
            "Nats-Msg-Id": f"usage-{seq}",
            "Tollgate-Reason": reason[:500],
            "Tollgate-Subject": msg.subject[:200],
            "Tollgate-Stream-Seq": str(seq),
            "Tollgate-Sha256": hashlib.sha256(data).hexdigest(),
        }
        if len(data) > _DEAD_LETTER_MAX_BYTES:
            # The headers must fit beside the body; the digest names the original.
            data = data[:_DEAD_LETTER_MAX_BYTES]
            headers["Tollgate-Truncated"] = str(len(msg.data))
        delay = 0.2
        while True:
            try:
                await self.js.publish(
                    self.subjects.usage_dead_letter, data, headers=headers, timeout=5
                )
                break
            except NoStreamResponseError:
                with contextlib.suppress(Exception):
                    await self.topology.ensure_stream(
                        self.js, self.topology.dead_letter, Role.METERING
                    )
            except Exception as exc:
                log.warning("dead-letter publish failed: %s: %s", type(exc).__name__, exc)
            if self._stopping.is_set():
                raise StoreUnavailable("stopping with a dead letter not stored")
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.settings.retry_max_s)
        self.metrics.dead_lettered.inc()
        log.error("usage message dead-lettered", extra={"stream_seq": seq, "reason": reason})

    async def _ack(self, msg: Msg) -> None:
        # Acks this message and every earlier one. An ack lost to a reconnect
        # only causes redeliveries, which are deduplicated and acked again.
        with contextlib.suppress(Exception):
            await msg.ack()
