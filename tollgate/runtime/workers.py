"""The live view of workers, built from their heartbeats: one for the router and the scaler.

Every worker beats on ``tg.workers.<model-token>`` each ``interval_s``
(its own interval, carried in the beat). A worker is alive while it has been
heard from within ``misses`` of its intervals; a ``stopped`` beat removes it
at once. The router asks whether the worker running a call is still alive;
the scaler lists each model's live workers.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from tollgate.wire import codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.workers")

_UNKNOWN_INTERVAL_S = 1.0  # a worker never heard from: assume a one-second beat


@dataclass
class SeenWorker:
    """A worker's latest beat and when it arrived."""

    beat: WorkerHeartbeat
    seen_at: float  # monotonic time of arrival

    def window(self, misses: int) -> float:
        """Seconds of silence after which this worker counts as lost."""
        return self.beat.interval_s * misses

    def alive(self, now: float, misses: int) -> bool:
        return now - self.seen_at <= self.window(misses)


class WorkerView:
    """Live workers by id, from heartbeats; alive after at most ``misses`` missed beats.

    ``start`` subscribes to every model's heartbeats; ``observe`` applies one
    beat (for callers that receive beats another way). ``on_beat`` is called
    with every beat after it has been applied.
    """

    def __init__(
        self,
        misses: int = 3,
        *,
        on_beat: Callable[[WorkerHeartbeat], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if misses < 1:
            raise ValueError("misses must be at least 1")
        self.misses = misses
        self.on_beat = on_beat
        self.clock = clock
        self._workers: dict[str, SeenWorker] = {}
        # Workers that said they are starting, kept apart: a worker loading its
        # engine can fall silent for seconds (imports that hold the interpreter)
        # and still be on its way.
        self._starting: dict[str, SeenWorker] = {}
        self._subscription: Subscription | None = None

    async def start(self, nc: NATS, subjects: Subjects) -> None:
        self._subscription = await nc.subscribe(subjects.heartbeat_all, cb=self._on_message)

    async def stop(self) -> None:
        if self._subscription is not None:
            await self._subscription.unsubscribe()
            self._subscription = None

    async def _on_message(self, msg: Msg) -> None:
        try:
            beat = codec.decode(WorkerHeartbeat, msg.data)
        except Exception:
            log.warning("malformed heartbeat ignored", extra={"subject": msg.subject})
            return
        self.observe(beat)

    def observe(self, beat: WorkerHeartbeat) -> None:
        """Apply one beat: a ``stopped`` worker is gone, any other is seen now."""
        if beat.state is WorkerState.STOPPED:
            self._workers.pop(beat.worker_id, None)
        else:
            self._workers[beat.worker_id] = SeenWorker(beat, self.clock())
        if beat.state is WorkerState.STARTING:
            self._starting[beat.worker_id] = SeenWorker(beat, self.clock())
        else:
            self._starting.pop(beat.worker_id, None)
        if self.on_beat is not None:
            self.on_beat(beat)

    def get(self, worker_id: str) -> SeenWorker | None:
        return self._workers.get(worker_id)

    def alive(self, worker_id: str) -> bool:
        """Whether ``worker_id`` has beaten within its window (unknown: not alive)."""
        seen = self._workers.get(worker_id)
        return seen is not None and seen.alive(self.clock(), self.misses)

    def window(self, worker_id: str) -> float:
        """Seconds of silence after which ``worker_id`` counts as lost."""
        seen = self._workers.get(worker_id)
        return seen.window(self.misses) if seen else _UNKNOWN_INTERVAL_S * self.misses

    def live(self, model: str | None = None, now: float | None = None) -> list[WorkerHeartbeat]:
        """Latest beats of the live workers (of ``model``, or all); the lost ones are forgotten."""
        now = self.clock() if now is None else now
        lost = [wid for wid, seen in self._workers.items() if not seen.alive(now, self.misses)]
        for wid in lost:
            del self._workers[wid]
        return [
            seen.beat
            for seen in self._workers.values()
            if model is None or seen.beat.model == model
        ]

    def starting(self, model: str, within_s: float = 30.0) -> list[WorkerHeartbeat]:
        """Latest beats of the model's starting workers, heard from within ``within_s``.

        Or within the worker's own window, when its last beat said the next one
        comes later (a worker whose engine start holds its event loop says so).
        """
        now = self.clock()
        gone = [
            wid
            for wid, seen in self._starting.items()
            if now - seen.seen_at > max(within_s, seen.window(self.misses))
        ]
        for wid in gone:
            del self._starting[wid]
        return [seen.beat for seen in self._starting.values() if seen.beat.model == model]
