"""What the router measures to answer an overloaded model honestly.

- :class:`DrainMeter`: per model, how fast its queue drains (requests that
  workers took per second, as this router saw them) and how long a call
  runs once taken. A refusal's ``Retry-After`` comes from these: the time
  the queue needs to drain to where a retry fits, or the time one running
  call needs to end.
- :func:`hold_until`: while a worker for the model is starting, how long a
  request may wait for it (its expected time to ready plus a margin) before
  the router gives up.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable

from tollgate.wire.contracts import WorkerHeartbeat, WorkerState

# The window the drain rate is measured over.
WINDOW_S = 60.0
# Retry-After stays within these bounds (seconds).
RETRY_MIN_S = 1
RETRY_MAX_S = 120
# A starting worker is waited for until its expected time to ready times this,
# plus HOLD_MARGIN_S.
HOLD_FACTOR = 1.5
HOLD_MARGIN_S = 60.0


class DrainMeter:
    """Per model: requests taken by workers per second, and how long a call runs."""

    def __init__(self) -> None:
        self._taken: dict[str, deque[float]] = {}
        self._service: dict[str, float] = {}  # moving mean of a call's seconds once taken

    def taken(self, model: str, now: float | None = None) -> None:
        """A worker took one of the model's requests."""
        now = time.monotonic() if now is None else now
        times = self._taken.setdefault(model, deque())
        times.append(now)
        while times and times[0] < now - WINDOW_S:
            times.popleft()

    def served(self, model: str, seconds: float) -> None:
        """A call ran ``seconds`` from the moment a worker took it to its end."""
        mean = self._service.get(model)
        self._service[model] = seconds if mean is None else 0.9 * mean + 0.1 * seconds

    def rate(self, model: str, now: float | None = None) -> float:
        """Requests taken per second over the window (0: none seen)."""
        now = time.monotonic() if now is None else now
        times = self._taken.get(model)
        if not times:
            return 0.0
        while times and times[0] < now - WINDOW_S:
            times.popleft()
        if not times:
            return 0.0
        span = max(now - times[0], 1.0)
        return len(times) / span

    def queue_retry_after(self, model: str, excess: int, fallback: int) -> int:
        """Seconds until ``excess`` more of the model's queued requests have been taken."""
        rate = self.rate(model)
        if rate <= 0:
            return fallback
        return _bounded(excess / rate)

    def slot_retry_after(self, model: str, fallback: int) -> int:
        """Seconds until one running call of the model is expected to end."""
        mean = self._service.get(model)
        return fallback if mean is None else _bounded(mean)


def _bounded(seconds: float) -> int:
    return int(min(RETRY_MAX_S, max(RETRY_MIN_S, math.ceil(seconds))))


def expected_ready_s(beats: Iterable[WorkerHeartbeat], catalog_s: float) -> float:
    """A worker's expected time to ready: the latest one measured, else the catalog's."""
    measured = [b.startup_s for b in beats if b.startup_s is not None]
    return measured[-1] if measured else catalog_s


def hold_until(beats: Iterable[WorkerHeartbeat], expected_s: float) -> float | None:
    """Unix time until which a request may wait for the model's starting workers (None: none).

    The latest of the starting workers' expected ready times (their start plus
    ``expected_s``, times :data:`HOLD_FACTOR`, plus :data:`HOLD_MARGIN_S`).
    """
    ends = [
        b.started_at + expected_s * HOLD_FACTOR + HOLD_MARGIN_S
        for b in beats
        if b.state is WorkerState.STARTING and b.started_at is not None
    ]
    return max(ends) if ends else None
