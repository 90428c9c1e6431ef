"""The life of one accepted call, from dispatch to its one usage event.

"Exactly one usage event per accepted request" has one owner: :class:`CallLife`,
an async context manager that a handler enters as soon as the call is in the
model's queue. The handler iterates :meth:`CallLife.events` and writes bytes;
the life records what it sees (the worker's END, an error response) and the
status the handler chose. On exit, however the handler leaves (normally, by a
TollgateError, a client that went away, a reset connection, a cancelled task
or a bug), it

- sends one cancel to the worker when the call did not run to its end, and
- hands one :class:`Ending` to the finisher, which settles the reservation,
  publishes the usage event, counts the metrics and captures the exchange.

The life never swallows the exception: the handler still turns it into the
right reply (an error body, an SSE error event, a 499).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from services.router.dispatch import Call
from services.router.errors import (
    DeadlineExceeded,
    ServiceUnavailable,
    TollgateError,
    UsageUnrecorded,
    WorkerLost,
)
from tollgate.wire.contracts import ChunkKind, Outcome, ResponseChunk

log = logging.getLogger("tollgate.router")


class Keepalive:
    """Yielded instead of a chunk when a wait passes with none."""


KEEPALIVE: Final = Keepalive()

Item = ResponseChunk | Keepalive


class ClientGone(Exception):
    """The client closed the connection."""


# What a TollgateError raised while following a call means for its usage row.
# Their codes are these outcomes' values, as usage rows have always held them.
_ERROR_OUTCOMES: Final[tuple[tuple[type[TollgateError], Outcome], ...]] = (
    (UsageUnrecorded, Outcome.INTERNAL_ERROR),  # before its base class
    (ServiceUnavailable, Outcome.NO_CAPACITY),
    (WorkerLost, Outcome.WORKER_LOST),
    (DeadlineExceeded, Outcome.DEADLINE_EXCEEDED),
)


def error_outcome(exc: TollgateError) -> Outcome:
    """The usage-row outcome of a call that ``exc`` ended."""
    for kind, outcome in _ERROR_OUTCOMES:
        if isinstance(exc, kind):
            return outcome
    return Outcome.ERROR


@dataclass(frozen=True)
class Ending:
    """How an accepted call ended, as its life saw it."""

    status: int  # the HTTP status the client got (499: it had gone)
    end: ResponseChunk | None = None  # the worker's END chunk, when it came
    # None: the worker's final report (END) says, once it comes.
    outcome: Outcome | None = None


class CallLife:
    """Owns one accepted call until it ends; see the module docstring.

    ``events`` opens the call's chunk iterator, ``cancel`` tells the worker to
    stop (with a reason), and ``finish`` takes the ending; the serving layer
    binds them (:meth:`OpenAIServing.life`).
    """

    def __init__(
        self,
        call: Call,
        events: Callable[[], AsyncIterator[Item]],
        cancel: Callable[[Call, str], Awaitable[None]],
        finish: Callable[[Ending], None],
    ) -> None:
        self.call = call
        # The status the client gets; the handler sets it when it is not 200.
        self.status = 200
        self.end: ResponseChunk | None = None
        self._open_events = events
        self._cancel = cancel
        self._finish = finish
        self._events: AsyncGenerator[Item] | None = None
        # The worker answered with an error response: it ends the call itself
        # (its END follows), so there is nothing to cancel.
        self._worker_ending = False
        self._state = "new"

    async def __aenter__(self) -> CallLife:
        if self._state != "new":
            raise RuntimeError("a call's life is entered once")
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state != "open":
            return
        self._state = "over"
        ending, cancel_reason = self._ending(exc)
        # Scheduled before anything is awaited: a second cancellation of this
        # task cannot lose the usage event.
        self._finish(ending)
        try:
            if self._events is not None:
                await self._events.aclose()
        finally:
            if cancel_reason is not None:
                await asyncio.shield(self._cancel(self.call, cancel_reason))

    def events(self) -> AsyncIterator[Item]:
        """The call's chunks in order, until END (see :meth:`OpenAIServing.events`)."""
        if self._state != "open" or self._events is not None:
            raise RuntimeError("events() is read once, inside the call's life")
        self._events = self._watch()
        return self._events

    async def _watch(self) -> AsyncGenerator[Item]:
        source = self._open_events()
        try:
            async for item in source:
                if isinstance(item, ResponseChunk):
                    if item.kind is ChunkKind.END:
                        self.end = item
                    elif item.kind is ChunkKind.ERROR:
                        self._worker_ending = True
                yield item
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()

    def _ending(self, exc: BaseException | None) -> tuple[Ending, str | None]:
        """The call's ending and, when it did not run to its end, why to cancel it."""
        if self.end is not None:
            return Ending(self.status, self.end), None
        if exc is None:
            if self._worker_ending:
                return Ending(self.status), None
            # The handler stopped reading before the end: the worker stops too,
            # and its final report tells what it had done.
            return Ending(self.status), "abandoned"
        if isinstance(exc, TollgateError):
            outcome = error_outcome(exc)
            if outcome is Outcome.ERROR:
                log.info("call ended by an error", extra={"code": exc.code or exc.type})
            return Ending(exc.status, outcome=outcome), exc.code or "error"
        if isinstance(exc, ClientGone | ConnectionResetError | asyncio.CancelledError):
            return Ending(499, outcome=Outcome.CLIENT_DISCONNECTED), "client_disconnected"
        return Ending(500, outcome=Outcome.INTERNAL_ERROR), "internal_error"
