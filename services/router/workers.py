"""The router's live view of workers, built from their heartbeats."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from tollgate.wire import codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects

log = logging.getLogger("tollgate.router.workers")


@dataclass
class _Seen:
    beat: WorkerHeartbeat
    at: float  # monotonic time of arrival


class WorkerView:
    def __init__(self, misses: int) -> None:
        self.misses = misses
        self._workers: dict[str, _Seen] = {}

    async def start(self, nc: NATS, subjects: Subjects) -> None:
        await nc.subscribe(subjects.heartbeat_all, cb=self._on_beat)

    async def _on_beat(self, msg: Msg) -> None:
        try:
            beat = codec.decode(WorkerHeartbeat, msg.data)
        except Exception:
            log.warning("malformed heartbeat ignored")
            return
        if beat.state is WorkerState.STOPPED:
            self._workers.pop(beat.worker_id, None)
        else:
            self._workers[beat.worker_id] = _Seen(beat, time.monotonic())

    def alive(self, worker_id: str) -> bool:
        seen = self._workers.get(worker_id)
        if seen is None:
            return False
        return time.monotonic() - seen.at <= seen.beat.interval_s * self.misses

    def window(self, worker_id: str) -> float:
        """Seconds of silence after which ``worker_id`` counts as lost."""
        seen = self._workers.get(worker_id)
        return (seen.beat.interval_s if seen else 1.0) * self.misses
