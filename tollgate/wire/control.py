"""FastStream on the control plane: typed handlers over a service's own NATS connection.

FastStream serves where its per-message cost disappears in the handler's own
work: the auth service's budget ledger (one to three KV round trips per usage
event). Everywhere the bus itself is the cost it measured slower than plain
nats.py (``python -m bench.control_plane``, docs/benchmarks.md), so the hot path
(router dispatch, the worker's fetch loop, chunk relay, compare-and-set on KV),
the metering query responder, the capture and replay consumers and the
scaler's signals and status stay on nats.py.

:class:`ControlBroker` runs on the connection the service already holds
(:func:`tollgate.wire.bus.connect`): one connection, one identity per service.
It never creates streams (the topology does), and its ``stop`` leaves the
connection to the service, which drains it last. Bodies are read with
:func:`tollgate.wire.codec.decode`, as every other reader on the bus reads them.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from faststream.message import StreamMessage
from faststream.nats import JStream, NatsBroker
from faststream.nats.subscriber.usecases import stream_pull_subscriber
from nats.aio.client import Client as NATS
from pydantic import BaseModel, ValidationError

from tollgate.wire import codec
from tollgate.wire.topology import StreamSpec

M = TypeVar("M", bound=BaseModel)

# FastStream's pull loop catches nats.py's TimeoutError, but nats.py's fetch
# also raises asyncio's own when a batch window runs out between two pulls.
# That one escaped the loop: the task was restarted, and the messages of the
# partial batch it held waited out the consumer's ack wait before they came
# again (a budget ledger seconds behind). nats.py's TimeoutError derives from
# the builtin one, so catching the builtin catches both.
stream_pull_subscriber.TimeoutError = TimeoutError  # type: ignore[attr-defined,assignment]

log = logging.getLogger("tollgate.control")


class ControlBroker(NatsBroker):
    """A FastStream broker on a connection the service already holds.

    ``graceful_timeout`` bounds how long :meth:`stop` waits for a handler in
    flight (a batch being counted) before it cancels it.
    """

    def __init__(self, nc: NATS, *, name: str, graceful_timeout: float = 15.0) -> None:
        # FastStream logs every message received and processed: debug here.
        super().__init__(
            name=name,
            logger=log,
            log_level=logging.DEBUG,
            graceful_timeout=graceful_timeout,
            description=f"the {name} service's control-plane subscribers",
        )
        self._nc = nc

    async def _connect(self) -> NATS:
        self.config.connect(self._nc)
        return self._nc

    async def stop(
        self,
        exc_type: type[BaseException] | None = None,
        exc_val: BaseException | None = None,
        exc_tb: TracebackType | None = None,
    ) -> None:
        """Stop taking messages and let the handlers in flight finish.

        NatsBroker.stop also drains the connection it holds; the service
        drains this one itself, once its nats.py consumers have finished too.
        """
        self._connection = None
        await super().stop(exc_type, exc_val, exc_tb)


def stream(spec: StreamSpec) -> JStream:
    """A topology stream for a subscriber: named, never declared by FastStream."""
    return JStream(spec.name, declare=False)


def contracts(model: type[M]) -> Callable[[StreamMessage[Any]], Awaitable[list[M | None]]]:
    """A batch decoder: each message read as ``model``, ``None`` for one that is not.

    The list matches the batch's raw messages one to one, so a handler can
    ack, or skip, each message itself.
    """

    async def decode(message: StreamMessage[Any]) -> list[M | None]:
        out: list[M | None] = []
        for raw in message.raw_message:
            try:
                out.append(codec.decode(model, raw.data))
            except (ValidationError, ValueError):
                out.append(None)
        return out

    return decode
