"""The scaler's live view of each model, built from events on the bus.

- worker heartbeats (``tg.workers.*``), kept by the shared
  :class:`~tollgate.runtime.workers.WorkerView`: who serves what, in which
  state, with how many busy slots; a worker that misses
  ``TOLLGATE_SCALER_HEARTBEAT_MISSES`` beats (3) is gone. Each beat also
  carries the tokens its worker has served so far: their growth is the
  model's tokens per second;
- arrivals (``tg.arrivals.<model>``), only for a model with no ready worker:
  a small event (no request body) for a request that enters its work queue,
  so a model at zero wakes the scaler at once. A model with ready workers is
  not followed request by request; its queue is read on the tick;
- the work-queue stream's message count: requests waiting for a worker
  (asked of JetStream each tick).

So what the scaler handles grows with workers and models, not with requests.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from tollgate.runtime.workers import WorkerView
from tollgate.wire import codec
from tollgate.wire.contracts import Arrival, WorkerHeartbeat, WorkerState
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
    served: dict[str, int] = field(default_factory=dict)  # worker id -> its latest tokens_total

    def live(self, now: float) -> list[WorkerHeartbeat]:
        """This model's live workers (their latest beats)."""
        return self.workers.live(self.model, now)

    def tokens_per_s(self, now: float) -> float:
        live = {beat.worker_id for beat in self.live(now)}
        for gone in [w for w in self.served if w not in live]:
            del self.served[gone]
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
        self._wakers: dict[str, Subscription] = {}  # arrivals followed, by model

    def view(self, model: str) -> ModelView:
        view = self.models.get(model)
        if view is None:
            view = self.models[model] = ModelView(model, self.workers)
        return view

    async def start(self) -> None:
        await self.workers.start(self.nc, self.subjects)

    async def follow_arrivals(self, model: str, follow: bool) -> None:
        """Be woken by each of ``model``'s arrivals (while it has no ready worker), or not."""
        sub = self._wakers.get(model)
        if follow and sub is None:
            subject = self.subjects.arrivals(model)
            self._wakers[model] = await self.nc.subscribe(subject, cb=self._on_arrival)
        elif not follow and sub is not None:
            del self._wakers[model]
            await sub.unsubscribe()

    def following(self, model: str) -> bool:
        return model in self._wakers

    def _on_beat(self, beat: WorkerHeartbeat) -> None:
        """What the scaler keeps per model beyond the live workers (the view has them)."""
        view = self.view(beat.model)
        self._count_tokens(view, beat)
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

    @staticmethod
    def _count_tokens(view: ModelView, beat: WorkerHeartbeat) -> None:
        """The tokens served since this worker's previous beat, into the model's window.

        A worker's first beat seen (it just started, or the scaler did) sets
        where it counts from; a stopped worker is forgotten.
        """
        if beat.state is WorkerState.STOPPED or beat.tokens_total is None:
            view.served.pop(beat.worker_id, None)
            return
        before = view.served.get(beat.worker_id)
        view.served[beat.worker_id] = beat.tokens_total
        if before is not None and beat.tokens_total > before:
            view.tokens.append((time.monotonic(), beat.tokens_total - before))

    async def queued(self, model: str) -> int:
        """Requests in the model's work queue that no worker has taken yet."""
        lanes = self.subjects.infer_lanes(model)
        try:
            info = await self.js.stream_info(self.subjects.infer_stream, subjects_filter=lanes)
        except NotFoundError:
            return 0
        return int(sum((info.state.subjects or {}).values()))
