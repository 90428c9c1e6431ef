"""One usage event per accepted request, kept until JetStream has it.

Each event is first written to a local durable outbox (an SQLite journal
under ``var/``), then published to the usage stream with ``Nats-Msg-Id`` =
request id, and removed from the outbox once the stream acknowledged it.
Events that could not be published (NATS down) are retried in order, and a
router that restarts replays what its outbox still holds: a NATS outage
delays usage events, it never drops them. A duplicate publish is dropped by
the stream's dedupe window.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
from pathlib import Path

from nats.js import JetStreamContext

from tollgate.wire import codec
from tollgate.wire.contracts import UsageEvent
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role, Topology

log = logging.getLogger("tollgate.router.usage")


class Outbox:
    """The SQLite journal: request id -> (subject, encoded event)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute(
            "CREATE TABLE IF NOT EXISTS events ("
            " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
            " request_id TEXT UNIQUE NOT NULL, subject TEXT NOT NULL, data BLOB NOT NULL)"
        )

    def add(self, request_id: str, subject: str, data: bytes) -> None:
        self.db.execute(
            "INSERT OR IGNORE INTO events (request_id, subject, data) VALUES (?, ?, ?)",
            (request_id, subject, data),
        )

    def remove(self, request_id: str) -> None:
        self.db.execute("DELETE FROM events WHERE request_id = ?", (request_id,))

    def pending(self, limit: int = 1000) -> list[tuple[str, str, bytes]]:
        rows = self.db.execute(
            "SELECT request_id, subject, data FROM events ORDER BY seq LIMIT ?", (limit,)
        )
        return list(rows.fetchall())

    def __len__(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM events").fetchone()[0])

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

    async def start(self) -> None:
        topology = Topology(self.subjects)
        with contextlib.suppress(Exception):  # NATS may be down: the replayer retries
            await topology.ensure_stream(self.js, topology.usage, Role.ROUTER)
        self._replayer = asyncio.create_task(self._replay_loop())

    def emit(self, event: UsageEvent) -> None:
        """Journal the event, then publish it in the background."""
        subject = self.subjects.usage(event.tenant)
        data = codec.encode(event)
        self.outbox.add(event.request_id, subject, data)
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
        self.outbox.remove(request_id)
        return True

    async def _replay_loop(self) -> None:
        """Publish what the outbox holds (from a failure or an earlier run), in order."""
        while not self._stopping:
            rows = self.outbox.pending()
            for request_id, subject, data in rows:
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
        for request_id, subject, data in self.outbox.pending():
            if not await self._publish(request_id, subject, data):
                break
        self.outbox.close()
