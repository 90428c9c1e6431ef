"""What the NATS side of a worker needs from an engine.

Two engines implement :class:`Engine`: :mod:`.vllm_engine` (vLLM with its own
OpenAI serving layer) and :mod:`.simulated` (a test double with the same
shape of output, for fast tests and gateway benchmarks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tollgate.wire.contracts import Endpoint, Usage


@dataclass
class TokenTally:
    """Tokens an engine request has seen so far.

    Used when a request is cancelled mid-way: the serving layer then never
    yields its usage, and billing needs what the engine did generate.
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0

    def usage(self) -> Usage:
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)


# The tally of the request the current task is serving.
current_tally: ContextVar[TokenTally | None] = ContextVar("tollgate_tally", default=None)


@dataclass
class StreamEvent:
    """One SSE event (``data: ...\\n\\n``) from the serving layer."""

    text: str
    is_usage: bool = False


@dataclass
class StreamResult:
    """A streaming response; ``usage``/``finish_reason`` are final once ``events`` ends."""

    events: AsyncIterator[StreamEvent]
    usage: Usage | None = None
    finish_reason: str | None = None


@dataclass
class FullResult:
    """A complete JSON response body."""

    body: str
    usage: Usage
    finish_reason: str | None = None


@dataclass
class ErrorResult:
    """An OpenAI-shaped error body with its HTTP status."""

    body: str
    status: int


EngineResult = StreamResult | FullResult | ErrorResult


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_cache_usage: float | None = None
    # Prefix cache, in prompt tokens as vLLM counts them, cumulative since the
    # engine started; None when the engine does not know (no stats, no cache)
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # hits / queries over the last HIT_RATE_WINDOW_S (None: nothing queried then)
    prefix_cache_hit_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


# The window of the recent prefix-cache hit rate: a few heartbeats (one a
# second), so one long prompt does not swing it, yet it follows a change of
# traffic within seconds.
HIT_RATE_WINDOW_S = 10.0


class RecentHitRate:
    """Hits / queries of the last ``window_s`` seconds, from cumulative counters.

    Fed the counters each time the engine's stats are read (every heartbeat
    and every scrape): the rate is the counters' growth since the newest
    reading at least ``window_s`` old (the oldest one while the engine is
    younger), so it does not depend on how often it is read.
    """

    def __init__(self, window_s: float = HIT_RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._readings: deque[tuple[float, int, int]] = deque()

    def update(self, now: float, queries: int | None, hits: int | None) -> float | None:
        if queries is None or hits is None:
            return None
        readings = self._readings
        if readings and (queries < readings[-1][1] or hits < readings[-1][2]):
            readings.clear()  # the counters restarted (a new engine)
        readings.append((now, queries, hits))
        # keep one reading at or before the window's start: the base of the rate
        while len(readings) > 1 and readings[1][0] <= now - self.window_s:
            readings.popleft()
        _, base_queries, base_hits = readings[0]
        if len(readings) == 1 and readings[0][0] == now:
            base_queries = base_hits = 0  # the first reading: all since the start
        queried = queries - base_queries
        if queried <= 0:
            return None
        # a read between two counters' updates must not make a rate above 1
        return min(1.0, max(0.0, (hits - base_hits) / queried))


class Engine(Protocol):
    name: str
    slots_total: int
    model_path: Path  # the prepared weights it serves
    # Whether start() holds the event loop (no heartbeats) until the engine has
    # loaded: the worker then says beforehand how long it may be silent.
    start_blocks_loop: bool

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> EngineResult:
        """Start one request; a StreamResult must be iterated to completion or closed."""
        ...

    async def load_adapter(self, name: str, path: Path) -> ErrorResult | None:
        """Load the LoRA adapter in ``path`` as model ``name``; the engine's refusal, if any."""
        ...

    def stats(self) -> EngineStats: ...


class LoadingEngine:
    """What a worker heartbeats with while its weights and engine load: no slots yet.

    The worker announces itself (state ``starting``, with its process start)
    before the slow part, so routers can hold calls for it and the scaler
    counts it; the real engine replaces this one once it is built.
    """

    slots_total = 0
    start_blocks_loop = False

    def __init__(self, name: str, model_path: Path) -> None:
        self.name = name
        self.model_path = model_path

    async def start(self) -> None:
        raise RuntimeError("the engine is still loading")

    async def stop(self) -> None:
        return None

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> EngineResult:
        raise RuntimeError("the engine is still loading")

    async def load_adapter(self, name: str, path: Path) -> ErrorResult | None:
        raise RuntimeError("the engine is still loading")

    def stats(self) -> EngineStats:
        return EngineStats()
