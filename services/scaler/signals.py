"""The scaler's live view of each model, built from events on the bus.

- worker heartbeats (``tg.workers.*``), kept by the shared
  :class:`~tollgate.runtime.workers.WorkerView`: who serves what, in which
  state, with how many busy slots; a worker that misses
  ``TOLLGATE_SCALER_HEARTBEAT_MISSES`` beats (3) is gone;
- arrivals (``tg.arrivals.*``): a small event (no request body) for every
  request that enters a model's work queue, so a model at zero wakes the
  scaler at once;
- usage events (``tg.usage.*``): tokens per second per model;
- the work-queue stream's message count: requests waiting for a worker
  (asked of JetStream each tick).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.errors import NotFoundError

from tollgate.runtime.workers import WorkerView
from tollgate.wire import codec
from tollgate.wire.contracts import Arrival, UsageEvent, WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects

_TOKENS_WINDOW_S = 60.0


@dataclass
class ModelView:
    model: str
    workers: WorkerView  # every model's live workers, shared by the views
    slots_per_worker: int | None = None
    startup_s: float | None = None  # latest measured time-to-ready
    arrivals: int = 0
    last_arrival_at: float | None = None
    tokens: deque[tuple[float, int]] = field(default_factory=deque)

    def live(self, now: float) -> list[WorkerHeartbeat]:
        """This model's live workers (their latest beats)."""
        return self.workers.live(self.model, now)

    def tokens_per_s(self, now: float) -> float:
        while self.tokens and self.tokens[0][0] < now - _TOKENS_WINDOW_S:
            self.tokens.popleft()
        return sum(n for _, n in self.tokens) / _TOKENS_WINDOW_S


class BusSignals:
    """Subscriptions that keep :class:`ModelView` per model up to date."""

    def __init__(self, nc: NATS, subjects: Subjects, heartbeat_misses: int = 3) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.subjects = subjects
        self.workers = WorkerView(heartbeat_misses, on_beat=self._on_beat)
        self.models: dict[str, ModelView] = {}
        self.arrived = asyncio.Event()  # set on every arrival: a tick may be due now

    def view(self, model: str) -> ModelView:
        view = self.models.get(model)
        if view is None:
            view = self.models[model] = ModelView(model, self.workers)
        return view

    async def start(self) -> None:
        await self.workers.start(self.nc, self.subjects)
        await self.nc.subscribe(self.subjects.arrivals_all, cb=self._on_arrival)
        await self.nc.subscribe(self.subjects.usage_all, cb=self._on_usage)

    def _on_beat(self, beat: WorkerHeartbeat) -> None:
        """What the scaler keeps per model beyond the live workers (the view has them)."""
        view = self.view(beat.model)
        if beat.state is WorkerState.STOPPED:
            return
        if beat.slots_total > 0:
            view.slots_per_worker = beat.slots_total
        if beat.startup_s is not None:
            view.startup_s = beat.startup_s

    async def _on_arrival(self, msg: Msg) -> None:
        try:
            arrival = codec.decode(Arrival, msg.data)
        except Exception:
            return
        view = self.view(arrival.model)
        view.arrivals += 1
        view.last_arrival_at = time.monotonic()
        self.arrived.set()

    async def _on_usage(self, msg: Msg) -> None:
        try:
            event = codec.decode(UsageEvent, msg.data)
        except Exception:
            return
        tokens = event.prompt_tokens + event.completion_tokens
        self.view(event.model).tokens.append((time.monotonic(), tokens))

    async def queued(self, model: str) -> int:
        """Requests in the model's work queue that no worker has taken yet."""
        lanes = self.subjects.infer_lanes(model)
        try:
            info = await self.js.stream_info(self.subjects.infer_stream, subjects_filter=lanes)
        except NotFoundError:
            return 0
        return int(sum((info.state.subjects or {}).values()))
